"""What the HTTP services (environments, inference) share about running uvicorn.

Imported only by services installed with uvicorn (the ``env-server`` and ``inference`` extras).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import uvicorn

__all__ = ["UvicornWithoutSignals", "serve_until_signalled"]


class UvicornWithoutSignals(uvicorn.Server):
    """uvicorn without its own signal capture: it re-raises SIGTERM after shutdown, which would skip the
    service's cleanup (closing environment instances such as SciWorld's JVMs, stopping the inference
    engine). The service's ``serve`` handles the signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_until_signalled(app: Any, host: str, port: int, log_level: str) -> None:
    """Serve the ASGI `app` on `host:port` until SIGINT or SIGTERM (or uvicorn stops), then return: the caller's
    own cleanup (a `finally`) runs after it."""
    server = UvicornWithoutSignals(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False))
    running = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not in the main thread
            running.add_signal_handler(signum, lambda: setattr(server, "should_exit", True))
    await server.serve()
