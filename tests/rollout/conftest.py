"""Real parts for rollout tests: the tiny model behind the inference server, environment services, NATS."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn

from agentgym.envs.server.http_api import create_app as create_env_app
from agentgym.envs.server.manager import ManagerConfig
from agentgym.envs.server.runner import build_manager
from agentgym.inference.engine import Engine
from agentgym.inference.models import load_tokenizer, tiny_model_dir
from agentgym.inference.server import create_app as create_inference_app
from agentgym.messaging import free_port
from agentgym.rollout.tokens import ChatTokenizer


class ThreadServer:
    """An ASGI app served by uvicorn on a loopback port in a background thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="session")
def chat(tiny_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(load_tokenizer(tiny_dir))


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[Engine]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = Engine(tiny_dir, max_batch_size=32, batch_window_ms=5.0, served_model_name="tiny")
    yield eng
    eng.close()
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def inference_url(engine: Engine) -> Iterator[str]:
    with ThreadServer(create_inference_app(engine)) as server:
        yield server.url


@pytest.fixture(scope="module")
def babyai_url() -> Iterator[str]:
    manager = build_manager("babyai", ManagerConfig(max_episodes=128))
    with ThreadServer(create_env_app(manager)) as server:
        yield server.url
