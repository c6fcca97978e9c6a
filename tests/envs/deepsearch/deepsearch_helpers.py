"""Helpers for the Deep Search tests: real HTTP servers on loopback, small corpora and QA files."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

TINY_CORPUS = [
    {
        "id": "0",
        "contents": '"Aurelia"\nAurelia is the capital of the island nation of Veloria, on its north coast.',
    },
    {"id": "1", "contents": '"Veloria"\nVeloria is an island nation. Its largest river is the Silverrun.'},
    {"id": "2", "contents": '"Silverrun"\nThe Silverrun flows from Mount Kest to the sea near Aurelia.'},
    {"id": "3", "contents": '"Mount Kest"\nMount Kest is the highest peak of Veloria, 2,914 metres high.'},
]


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """Run `app` under uvicorn on a loopback port in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def closed_port_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def stub_retriever_app(behaviour: str, delay_s: float = 0.0) -> FastAPI:
    """A misbehaving /retrieve: 'slow' (sleeps), 'error' (HTTP 500), 'garbage' (not Search-R1's shape)."""
    app = FastAPI()

    @app.post("/retrieve", response_model=None)
    def retrieve(body: dict[str, Any]) -> Any:
        if behaviour == "slow":
            time.sleep(delay_s)
            return {"result": [[] for _ in body["queries"]]}
        if behaviour == "error":
            from fastapi.responses import PlainTextResponse

            return PlainTextResponse("index offline", status_code=500)
        return {"hits": "nope"}

    return app
