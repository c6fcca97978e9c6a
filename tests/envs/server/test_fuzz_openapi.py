"""Schemathesis against each service's own OpenAPI document, over real HTTP on 127.0.0.1 (uvicorn).

Fuzzed: the BabyAI, TextCraft and Deep Search services (Deep Search on its bundled BM25 corpus, no
search server) with their AgentGym routes, and the inference server (the tiny test model, its context
cut to 64 tokens so that no generated request samples for long). Not fuzzed: SciWorld (a JVM per
simulator) and WebArena (Chromium), too slow to start for this budget; their routes are built from the
same bodies, limits and handlers (`agentgym.envs.server.compat`, `.limits`), which these runs cover.

Each operation gets up to 30 generated valid requests and 15 invalid ones (Hypothesis, derandomized, so
a run is reproducible), and every response is checked with Schemathesis's checks: no 5xx, a status the
document declares, the declared content type, headers and schema, invalid input refused with a 4xx,
schema-valid input not refused as invalid (but by inference, see below). About 55 s of CPU on the
2-core dev machine (marked slow).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from agentgym.envs.server.http_api import create_app
from agentgym.envs.server.manager import ManagerConfig
from agentgym.envs.server.runner import build_manager
from agentgym.messaging import free_port

pytestmark = pytest.mark.slow

# Up to 30 valid requests per operation, and 15 invalid ones (those mostly meet the same validation).
POSITIVE = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
NEGATIVE = settings(POSITIVE, max_examples=15)


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` behind uvicorn on a loopback port in a background thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the service did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@contextmanager
def env_schema(environment: str) -> Iterator[Any]:
    manager = build_manager(environment, ManagerConfig(max_episodes=64, worker_threads=2))
    with serving(create_app(manager)) as url:  # the app starts and stops the manager
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


@pytest.fixture(scope="module")
def babyai_schema() -> Iterator[Any]:
    with env_schema("babyai") as schema:
        yield schema


@pytest.fixture(scope="module")
def textcraft_schema() -> Iterator[Any]:
    with env_schema("textcraft") as schema:
        yield schema


@pytest.fixture(scope="module")
def deepsearch_schema(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch_module.delenv("SEARCH_URL", raising=False)  # the bundled corpus, not a search server
    with env_schema("deepsearch") as schema:
        yield schema


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def inference_schema() -> Iterator[Any]:
    import torch

    from agentgym.inference.engine import Engine
    from agentgym.inference.models import tiny_model_dir
    from agentgym.inference.server import create_app as inference_app

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(tiny_model_dir(), max_batch_size=4, batch_window_ms=5.0, max_model_len=64, served_model_name="tiny")
    try:
        with serving(inference_app(engine)) as url:
            yield schemathesis.openapi.from_url(f"{url}/openapi.json")
    finally:
        engine.close()
        torch.set_num_threads(threads)


def _negatable(operation: Any) -> bool:
    """Whether some input of the operation can be made invalid: a body, or a parameter that is not any
    string. (Hypothesis would try hundreds of times before giving up on the others.)"""
    raw = operation.definition.raw
    parameters = raw.get("parameters", [])
    return "requestBody" in raw or any(p.get("schema", {}).get("type") != "string" for p in parameters)


def fuzz(schema: Any, *, skip: frozenset[str] = frozenset(), excluded_checks: tuple[Any, ...] = ()) -> None:
    """Every operation of `schema` (but `skip`), with valid then invalid generated requests, under all of
    Schemathesis's checks but `excluded_checks`; all failures are collected and reported together, each
    with the request that reproduces it."""
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()  # a malformed operation raises here, which fails the test
        if operation.path in skip:
            continue
        operations += 1
        for mode in (
            (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if _negatable(operation) else (GenerationMode.POSITIVE,)
        ):

            @(POSITIVE if mode is GenerationMode.POSITIVE else NEGATIVE)
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                case.call_and_validate(excluded_checks=list(excluded_checks))

            try:
                run()
            except (Exception, BaseExceptionGroup) as error:  # a check failed, shrunk to a minimal request
                failures.append(f"{operation.method.upper()} {operation.path} ({mode.value}): {error}")
    assert operations >= 3
    assert not failures, "\n\n".join(failures)


def test_babyai_service(babyai_schema: Any) -> None:
    fuzz(babyai_schema)


def test_textcraft_service(textcraft_schema: Any) -> None:
    fuzz(textcraft_schema)


def test_deepsearch_service(deepsearch_schema: Any) -> None:
    fuzz(deepsearch_schema)


def test_inference_server(inference_schema: Any) -> None:
    # /v1/load_weights reads whatever path it is given: fuzzing it means reading random local files. Its
    # statuses and schema are checked in tests/inference/test_inference_server.py.
    # A schema-valid request can still be refused with the documented 400: its prompt plus max_tokens
    # past the context, n past the batch size, a sampling option this engine only takes at its neutral
    # value. Those are cross-field rules a JSON schema does not state, so valid-looking data may be refused.
    fuzz(
        inference_schema,
        skip=frozenset({"/v1/load_weights"}),
        excluded_checks=(schemathesis.checks.positive_data_acceptance,),
    )
