"""The trainer process's compute on its main thread, its event loop on another.

The loop (NATS pings, the collector's heartbeats, publishing) must keep running while a step computes,
so the compute cannot share its thread. It used to run in a worker thread (``asyncio.to_thread``), where
glibc's malloc serves it from a secondary arena: those grow in heaps of at most 64 MiB, so every larger
tensor (logits of a few hundred tokens over a 49k vocabulary, the model's gradients) is a fresh ``mmap``,
zero-filled page by page and unmapped when freed, however the thresholds are set
(``agentgym.allocator`` keeps freed memory only in the main arena). A BabyAI-shaped GRPO step took
1.2-1.3x as long in a worker thread as on the main thread on the 2-core Xeon, 1.7x on the 2-core EPYC
(``benchmarks/trainer_thread_bench.py``).
So the main thread computes, and the loop runs beside it:

    executor = MainThreadExecutor()
    result = run_loop_beside(lambda stop: coroutine(executor, stop), executor)   # on the main thread

and the coroutine hands compute over with ``await loop.run_in_executor(executor, fn, *args)``; SIGTERM and
SIGINT set its ``stop`` event (asyncio's own signal handling works on the main thread only).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import signal
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["MainThreadExecutor", "run_loop_beside"]

T = TypeVar("T")

_STOP = object()
_POLL_S = 0.5
"""How long ``serve`` blocks before looking again: Python runs signal handlers on the main thread only between
bytecodes, and a signal the kernel gave another thread does not wake a blocked wait."""


class MainThreadExecutor(Executor):
    """An executor whose one worker is the thread that calls :meth:`serve` (the main thread).

    Calls run one at a time, in the order submitted; ``serve`` returns once :meth:`shutdown` was called and the
    calls submitted before it have run. A call submitted after shutdown is refused (``RuntimeError``)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot submit to a MainThreadExecutor after shutdown")
            self._calls.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Ends :meth:`serve` after the calls already submitted (``wait`` cannot apply: the caller of ``serve``
        runs them)."""
        with self._lock:
            if not self._shut:
                self._shut = True
                self._calls.put(_STOP)

    def serve(self) -> None:
        """Run submitted calls on this thread until :meth:`shutdown`. A call's exception, of any kind, goes to
        its future (the awaiting coroutine decides); serving goes on."""
        while True:
            try:
                item = self._calls.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(result)


def run_loop_beside(
    main: Callable[[asyncio.Event], Coroutine[Any, Any, T]],
    executor: MainThreadExecutor,
    stop_signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> T:
    """Run ``main(stop)`` to completion on a new event loop in another thread while this (the main) thread serves
    ``executor``; ``stop_signals`` set ``stop`` meanwhile. Returns ``main``'s result or raises its exception here.
    The executor is shut down when ``main`` ends; the signals' previous handlers are restored."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    outcome: dict[str, Any] = {}

    def request_stop(signum: int, frame: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing is left to stop
            loop.call_soon_threadsafe(stop.set)

    def run() -> None:
        try:
            with asyncio.Runner(loop_factory=lambda: loop) as runner:
                outcome["result"] = runner.run(main(stop))
        except BaseException as error:  # re-raised on the main thread
            outcome["error"] = error
        finally:
            executor.shutdown()

    previous = {sig: signal.signal(sig, request_stop) for sig in stop_signals}
    thread = threading.Thread(target=run, name="event-loop")
    try:
        thread.start()
        executor.serve()
    finally:
        thread.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
