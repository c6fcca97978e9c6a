"""The trainer process's compute on the main thread with its event loop beside it (agentgym.trainer.main_thread)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from agentgym.trainer.main_thread import MainThreadExecutor, run_loop_beside


def test_calls_run_on_the_main_thread_in_order_while_the_loop_runs_elsewhere() -> None:
    assert threading.current_thread() is threading.main_thread()  # pytest runs tests on it
    executor = MainThreadExecutor()
    ran: list[tuple[int, bool]] = []

    def call(n: int) -> int:
        ran.append((n, threading.current_thread() is threading.main_thread()))
        return n * n

    async def main(stop: asyncio.Event) -> tuple[list[int], bool]:
        loop = asyncio.get_running_loop()
        squares = [await loop.run_in_executor(executor, call, n) for n in range(3)]
        together = await asyncio.gather(*(loop.run_in_executor(executor, call, n) for n in (3, 4, 5)))
        return squares + list(together), threading.current_thread() is threading.main_thread()

    results, loop_on_main = run_loop_beside(main, executor, stop_signals=())
    assert results == [0, 1, 4, 9, 16, 25]
    assert ran == [(n, True) for n in range(6)]  # submitted order, every one on the main thread
    assert not loop_on_main


def test_a_calls_exception_reaches_the_coroutine_and_serving_goes_on() -> None:
    executor = MainThreadExecutor()

    def fail() -> None:
        raise ValueError("step failed")

    def leave() -> None:
        raise SystemExit(3)  # not an Exception: still the awaiting coroutine's to handle

    async def main(stop: asyncio.Event) -> list[str]:
        loop = asyncio.get_running_loop()
        seen = []
        with pytest.raises(ValueError, match="step failed"):
            await loop.run_in_executor(executor, fail)
        seen.append("ValueError")
        with pytest.raises(SystemExit):
            await loop.run_in_executor(executor, leave)
        seen.append("SystemExit")
        seen.append(str(await loop.run_in_executor(executor, lambda: "still serving")))
        return seen

    assert run_loop_beside(main, executor, stop_signals=()) == ["ValueError", "SystemExit", "still serving"]


def test_the_coroutines_exception_is_raised_on_the_main_thread_and_serving_ends() -> None:
    executor = MainThreadExecutor()

    async def main(stop: asyncio.Event) -> None:
        await asyncio.get_running_loop().run_in_executor(executor, lambda: None)
        raise RuntimeError("lost NATS")

    with pytest.raises(RuntimeError, match="lost NATS"):
        run_loop_beside(main, executor, stop_signals=())
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(print, "late")


def test_sigterm_sets_stop_while_the_main_thread_waits_and_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGTERM)
    executor = MainThreadExecutor()

    async def main(stop: asyncio.Event) -> float:
        started = time.monotonic()
        # sent from the loop's thread while the main thread blocks waiting for work
        await asyncio.get_running_loop().run_in_executor(None, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), timeout=10)
        return time.monotonic() - started

    waited = run_loop_beside(main, executor, stop_signals=(signal.SIGTERM,))
    assert waited < 5  # within a poll or two, not the 10 s timeout
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_during_a_long_call_sets_stop_and_the_call_finishes() -> None:
    executor = MainThreadExecutor()

    def long_call(stop: asyncio.Event) -> tuple[bool, bool]:
        os.kill(os.getpid(), signal.SIGTERM)  # on the main thread, mid-call
        deadline = time.monotonic() + 10
        while not stop.is_set() and time.monotonic() < deadline:  # what trainer.sft's should_stop reads
            time.sleep(0.01)
        return stop.is_set(), True

    async def main(stop: asyncio.Event) -> tuple[bool, bool]:
        return await asyncio.get_running_loop().run_in_executor(executor, long_call, stop)

    assert run_loop_beside(main, executor, stop_signals=(signal.SIGTERM,)) == (True, True)
