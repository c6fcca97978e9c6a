"""The inference package's errors: the engine's (the HTTP layer maps each to a status code) and its clients'."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base class of the engine's errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as asked (the HTTP layer answers 400)."""


class EngineClosedError(EngineError):
    """The engine is shutting down (the HTTP layer answers 503)."""


class WeightLoadError(EngineError):
    """New weights could not be loaded; the old ones keep serving (the HTTP layer answers 400)."""


class StaleVersionError(EngineError):
    """A weight update older than the version being served (the HTTP layer answers 409)."""


TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class InferenceError(RuntimeError):
    """An inference call failed: `status` is the HTTP status (None when no response came back)."""

    def __init__(self, message: str, status: int | None = None, transient: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.transient = (status is None or status in TRANSIENT_STATUSES) if transient is None else transient
