"""What the HTTP services (environments, inference) share about running uvicorn.

Imported only by services installed with uvicorn (the ``env-server`` and ``inference`` extras).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn

__all__ = ["UvicornWithoutSignals"]


class UvicornWithoutSignals(uvicorn.Server):
    """uvicorn without its own signal capture: it re-raises SIGTERM after shutdown, which would skip the
    service's cleanup (closing environment instances such as SciWorld's JVMs, stopping the inference
    engine). The service's ``serve`` handles the signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
