"""Shared fixtures: the tiny model (built once, cached under $AGENTGYM_CACHE_DIR), engines, live servers."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import uvicorn

from agentgym.inference.engine import Engine
from agentgym.inference.models import tiny_model_dir
from agentgym.inference.server import create_app
from agentgym.messaging import free_port


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="session")
def other_tiny_dir() -> Path:
    """Same architecture and tokenizer as `tiny_dir`, different weights (seed 1)."""
    return tiny_model_dir(seed=1)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # On a shared 2-core machine oversubscribed OpenMP threads make every forward pass erratic.
    # Module scope: the process-wide setting is restored before other test folders run.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_engine(model_dir: Path, **kwargs: object) -> Engine:
    settings: dict[str, object] = {"max_batch_size": 16, "batch_window_ms": 30.0, "served_model_name": "tiny"}
    settings.update(kwargs)
    return Engine(model_dir, **settings)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[Engine]:
    """A shared engine whose weights the tests never change."""
    eng = make_engine(tiny_dir)
    yield eng
    eng.close()


@pytest.fixture
def fresh_engine(tiny_dir: Path) -> Iterator[Engine]:
    """An engine of its own, for tests that swap weights."""
    eng = make_engine(tiny_dir)
    yield eng
    eng.close()


class LiveServer:
    """The FastAPI app over an engine, served by uvicorn on a loopback port in a background thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(engine), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def live_server(engine: Engine) -> Iterator[LiveServer]:
    with LiveServer(engine) as server:
        yield server


def _rescore(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> list[float]:
    """log p(generated[i] | prompt + generated[:i]) from one plain forward pass over the whole sequence."""
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(generated)]


@pytest.fixture(scope="session")
def rescore() -> Callable[[torch.nn.Module, list[int], list[int]], list[float]]:
    return _rescore


@pytest.fixture(scope="session")
def engine_factory() -> Callable[..., Engine]:
    return make_engine


@pytest.fixture(scope="session")
def live_server_factory() -> Callable[[Engine], LiveServer]:
    return LiveServer
