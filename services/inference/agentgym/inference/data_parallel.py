"""Data parallelism on CPU: several single-threaded engine processes behind one HTTP front, one URL to clients.

On a 2-core machine one engine's decode step is bound by its own thread: the `decoder.ForwardHelper` thread shares
the large operations, but every other step (dozens of small operations a layer, sampling, admitting the next
turn's prompts) runs on the engine's thread while the helper waits, and both take turns with the HTTP server for
Python's interpreter lock. On the quickstart's rollout step (py-spy) the engine's thread was busy 96 % of the time
and the helper 33 %. Two engine processes of one thread each, each decoding its share of the episodes, keep both
cores busy with no lock between them, as vLLM and SGLang run data-parallel engines behind one API server. On the
2-core AVX512-BF16 EPYC (`benchmarks/rollout_engines_bench.py`, `hf:bf16+data-parallel=N`, interleaved, two runs):
SmolLM2's rollout step 1.14-1.40x one engine with its helper, the tiny model's 1.04-1.18x (its steps are short: the
front's hop and the prefill of conversations moved between replicas weigh more). But beside a process keeping one
core busy, three compute threads share two cores and each replica's episodes wait for its slices: 0.79-0.90x and
0.84-0.85x one engine with its helper, which holds 77-82 % of its speed there against data parallelism's 46-63 %.
So one engine stays the default (the quickstart's engine shares the cores with its trainer), and `--data-parallel
N` (the spec's `inference.dataParallel`) is for inference with cores of its own.

`agentgym inference serve --data-parallel N` starts N replicas, each an `agentgym inference serve` of its own on a
local port with `AGENTGYM_CPUS` set to its share of the cores (its threads and helper sized to that share), and
serves the same API in front of them:

- `POST /v1/completions` goes to one replica, chosen by `PrefixRouter`: the replica that last served the longest
  prefix of the prompt (its prefix cache holds that prefix's keys and values: a conversation's next turn extends
  its previous prompt and completion), unless that replica has `AFFINITY_SLACK` (16) or more sequences in flight
  than the least loaded one, which then takes it. The replica's answer is passed through unchanged.
- `POST /v1/load_weights` goes to every replica at once and succeeds when all have loaded the version (a failed
  replica's error is answered; the weight roll's retry brings the others level: a version equal to the served one
  is loaded again). The last loaded weights are reloaded into a replica that restarts.
- `GET /health` and `/v1/policy_version` answer the oldest version a ready replica serves (what every response may
  carry), `/health` with each replica's state (ready, version, restarts, sequences in flight, process id);
  `GET /metrics` is every replica's metrics with a `replica` label, and the front's own
  (`agentgym_inference_replica_restarts`); other paths (`/v1/models`, `/docs`) are the first ready replica's.

A replica that exits loses nothing but time: the requests it held are sent again to another replica (generation
has no side effects; with no replica left they are answered 503, which clients retry), and it is restarted with a
growing pause, then given the last loaded weights, while the others serve. The replicas die with the front
(parent-death signal) and are stopped with it. The front forwards with aiohttp: httpx took three times its CPU a
request, 15 % of a core on the tiny model's rollout step, taken from the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentgym.children import die_with_parent
from agentgym.cpus import CPUS_VARIABLE, available_cpus, available_memory
from agentgym.inference.client import POLICY_VERSION_HEADER
from agentgym.inference.engine import DEFAULT_PREFIX_CACHE_BYTES
from agentgym.inference.prefix_cache import BLOCK_SIZE, block_keys
from agentgym.inference.server import (
    LoadWeightsRequest,
    error_payload,
    error_response,
    limit_body_size,
    validation_message,
)
from agentgym.inference.weights import pick_device
from agentgym.messaging import free_port
from agentgym.serving import serve_until_signalled

log = logging.getLogger(__name__)

__all__ = [
    "AFFINITY_SLACK",
    "ROUTING_BLOCK",
    "PrefixRouter",
    "ReplicaSet",
    "create_front",
    "data_parallel_refusal",
    "merge_metrics",
    "replica_arguments",
    "replica_bytes",
    "run",
    "serve_replicas",
]

ROUTING_BLOCK = BLOCK_SIZE
"""Tokens per block of a prompt's prefix as the router remembers it: the engine's prefix cache's block size."""

AFFINITY_SLACK = 16
"""A prompt goes to the replica holding its longest prefix unless that replica has this many more sequences in
flight than the least loaded one. Moving a conversation costs a prefill of its whole history on the other replica,
while a few more rows cost a batched decode step little: on the tiny model's rollout step a slack of 4 prefilled
4x the tokens of 16 (13,177 against 3,316 over 5 steps; two servers given half of the episodes each: 2,761) and
was 7 % slower. A turn's episodes arrive together and share their group's first prompt, so the first 16 of them go
to one replica and the rest to the other, which then holds their prefix."""

ROUTER_CAPACITY = 200_000
"""Prefix blocks remembered (least recently used forgotten): ~1,600 conversations of 2,000 tokens."""

RESTART_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Pauses before a replica's restarts: the first after it ran a minute or more, then each after a shorter run (the
last repeats)."""


class PrefixRouter:
    """Which replica a prompt goes to: the one that last served its longest prefix (in `ROUTING_BLOCK` blocks),
    unless it has `slack` or more sequences in flight than the least loaded ready replica; then (or with no prefix
    served yet) the least loaded ready replica, the lowest index on a tie."""

    def __init__(self, replicas: int, slack: int = AFFINITY_SLACK, capacity: int = ROUTER_CAPACITY) -> None:
        self.replicas = replicas
        self.slack = slack
        self.capacity = capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix block hash -> replica that last served it

    def choose(self, blocks: Sequence[int], ready: Sequence[bool], in_flight: Sequence[int]) -> int | None:
        """A ready replica for a prompt of these block keys (`prefix_cache.block_keys`; none: a text prompt or a
        short one, routed by load), or None when none is ready."""
        candidates = [index for index in range(self.replicas) if ready[index]]
        if not candidates:
            return None
        least = min(candidates, key=lambda index: (in_flight[index], index))
        owner = None
        for block in blocks:
            holder = self._owner.get(block)
            if holder is None:
                break
            owner = holder
        if owner is not None and ready[owner] and in_flight[owner] < in_flight[least] + self.slack:
            return owner
        return least

    def record(self, blocks: Sequence[int], replica: int) -> None:
        """`replica` now holds the prefix of these `prefix_cache.block_keys` (it served them)."""
        for block in blocks:
            self._owner[block] = replica
            self._owner.move_to_end(block)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: int) -> None:
        """`replica` restarted: its prefix cache is empty."""
        for block in [block for block, holder in self._owner.items() if holder == replica]:
            del self._owner[block]


@dataclass
class Replica:
    index: int
    port: int
    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    in_flight: int = 0
    restarts: int = 0
    policy_version: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ReplicaSet:
    """N replica processes of `argv(port)`, kept running: a replica that exits is restarted (see the module's
    docstring) and given the last weights loaded through `load_weights`."""

    def __init__(
        self,
        argv: Callable[[int], list[str]],
        count: int,
        environment: dict[str, str],
        *,
        ready_timeout_s: float = 600.0,
    ) -> None:
        self.argv = argv
        self.environment = environment
        self.ready_timeout_s = ready_timeout_s
        self.replicas = [Replica(index, free_port()) for index in range(count)]
        self.router = PrefixRouter(count)
        self._session: aiohttp.ClientSession | None = None
        self.last_load: dict[str, Any] | None = None
        """The body of the last `load_weights` every replica accepted (a restarted replica loads it)."""
        self._load_lock = asyncio.Lock()
        self._watchers: list[asyncio.Task[None]] = []
        self._closing = False

    @property
    def ready(self) -> list[bool]:
        return [replica.ready for replica in self.replicas]

    async def call(
        self, replica: Replica, method: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> Answer:
        """One HTTP call to `replica`, its whole answer read (aiohttp: a third of httpx's CPU a request, which the
        front takes from the replicas' cores). Raises `aiohttp.ClientError` (or `TimeoutError`) when it fails."""
        if self._session is None:  # made in the running loop, on first use
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(connect=10))
        limit = aiohttp.ClientTimeout(total=timeout, connect=10) if timeout is not None else None
        async with self._session.request(method, f"{replica.url}{path}", timeout=limit, **kwargs) as response:
            headers = {name: value for name, value in response.headers.items() if name.lower() in _PASSED_HEADERS}
            return Answer(response.status, await response.read(), headers)

    async def start(self) -> None:
        """Start every replica and wait until all are ready (raises when one exits or times out first)."""
        await asyncio.gather(*(self._spawn(replica) for replica in self.replicas))
        try:
            await asyncio.gather(*(self._wait_ready(replica) for replica in self.replicas))
        except BaseException:
            await self.stop()
            raise
        self._watchers = [asyncio.create_task(self._watch(replica)) for replica in self.replicas]

    async def stop(self) -> None:
        self._closing = True
        for task in self._watchers:
            task.cancel()
        for replica in self.replicas:
            replica.ready = False
            if replica.process is not None and replica.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    replica.process.send_signal(signal.SIGTERM)
        for replica in self.replicas:
            if replica.process is None:
                continue
            try:
                await asyncio.wait_for(replica.process.wait(), 30)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    replica.process.kill()
                await replica.process.wait()
        if self._session is not None:
            await self._session.close()

    async def _spawn(self, replica: Replica) -> None:
        replica.process = await asyncio.create_subprocess_exec(
            *self.argv(replica.port), env=self.environment, preexec_fn=die_with_parent
        )

    async def _wait_ready(self, replica: Replica) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        assert replica.process is not None
        while True:
            if replica.process.returncode is not None:
                raise RuntimeError(f"inference replica {replica.index} exited with {replica.process.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                answer = await self.call(replica, "GET", "/health", timeout=2)
                if answer.status == 200:
                    replica.policy_version = int(json.loads(answer.content).get("policy_version", 0))
                    replica.ready = True
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"inference replica {replica.index} not ready in {self.ready_timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    async def _watch(self, replica: Replica) -> None:
        """Restart `replica` whenever it exits, with the last loaded weights, until the set stops."""
        failures = 0
        while not self._closing:
            assert replica.process is not None
            started = time.monotonic()
            code = await replica.process.wait()
            if self._closing:
                return
            replica.ready = False
            self.router.forget(replica.index)
            failures = failures + 1 if time.monotonic() - started < 60 else 0
            delay = RESTART_DELAYS[min(failures, len(RESTART_DELAYS) - 1)]
            log.warning("inference replica %d exited with %s; restarting in %.0f s", replica.index, code, delay)
            await asyncio.sleep(delay)
            replica.restarts += 1
            try:
                await self._spawn(replica)
                await self._wait_ready(replica)
                replica.ready = False  # until it serves the last loaded weights too
                await self._catch_up(replica)
            except (RuntimeError, OSError, aiohttp.ClientError, TimeoutError) as error:
                log.warning("inference replica %d did not come back: %s", replica.index, error)
                if replica.process is not None and replica.process.returncode is None:
                    replica.process.kill()
                continue
            replica.ready = True
            log.warning("inference replica %d is back (policy version %d)", replica.index, replica.policy_version)

    async def _catch_up(self, replica: Replica) -> None:
        """Load the last weights every replica accepted into a restarted `replica` (again if a newer one came)."""
        while self.last_load is not None and replica.policy_version < int(self.last_load["version"]):
            body = self.last_load
            answer = await self.call(replica, "POST", "/v1/load_weights", json=body)
            if answer.status != 200:
                raise RuntimeError(f"reloading policy {body['version']} failed: {answer.content[:500]!r}")
            replica.policy_version = int(body["version"])

    async def load_weights(self, body: dict[str, Any]) -> Answer:
        """Post `body` to every ready replica at once: the first failure's answer, else the first success's."""
        async with self._load_lock:
            replicas = [replica for replica in self.replicas if replica.ready]
            if not replicas:
                return _error_answer(503, "no inference replica is ready")
            results = await asyncio.gather(
                *(self.call(replica, "POST", "/v1/load_weights", json=body) for replica in replicas),
                return_exceptions=True,
            )
            failure: Answer | None = None
            for replica, result in zip(replicas, results, strict=True):
                if isinstance(result, BaseException):
                    failure = failure or _error_answer(503, f"inference replica {replica.index}: {result!r}")
                elif result.status != 200:
                    failure = failure or result
                else:
                    replica.policy_version = int(json.loads(result.content)["policy_version"])
            if failure is not None:
                return failure
            self.last_load = body
            first = results[0]
            assert isinstance(first, Answer)
            return first

    def policy_version(self) -> int | None:
        """The oldest version a ready replica serves (None: none is ready)."""
        versions = [replica.policy_version for replica in self.replicas if replica.ready]
        return min(versions) if versions else None


@dataclass
class Answer:
    """A replica's whole HTTP answer: status, body, and the headers passed on to the client."""

    status: int
    content: bytes
    headers: dict[str, str]

    def response(self) -> Response:
        return Response(self.content, status_code=self.status, headers=self.headers)


_PASSED_HEADERS = {"content-type", POLICY_VERSION_HEADER.lower()}
_FORWARDED_HEADERS = {"content-type", "traceparent", "tracestate", "baggage"}


def _error_answer(status: int, message: str) -> Answer:
    return Answer(status, json.dumps(error_payload(status, message)).encode(), {"content-type": "application/json"})


def _routing_ids(body: Any) -> tuple[list[list[int]], int]:
    """A completion request's token-id prompts (none for text or malformed prompts: those are routed by load, and
    the replica answers the malformed ones 400) and its sequences (prompts x n, for the load count)."""
    if not isinstance(body, dict):
        return [], 1
    prompt = body.get("prompt")
    n = body.get("n", 1)
    samples = n if isinstance(n, int) and 0 < n <= 1024 else 1
    if isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
        return [prompt], samples
    if not isinstance(prompt, list) or not prompt:
        return [], samples
    if all(isinstance(item, list) and all(isinstance(token, int) for token in item) for item in prompt):
        return prompt, samples * len(prompt)
    return [], samples * len(prompt)


def _served_ids(content: bytes, prompt_blocks: Sequence[list[int]]) -> list[list[int]]:
    """Each choice's `prefix_cache.block_keys` over its prompt and sampled ids, where the response has them
    (`return_token_ids`), continued from its prompt's (`prompt_blocks`, in the request's order: a choice's prompt is
    its index // n, the servers' convention)."""
    try:
        choices = json.loads(content).get("choices", [])
        per_prompt = max(1, len(choices) // max(1, len(prompt_blocks)))
        served = []
        for choice in choices:
            prompt, sampled = choice.get("prompt_token_ids"), choice.get("token_ids")
            if not isinstance(prompt, list) or not isinstance(sampled, list):
                continue
            position = int(choice.get("index", 0)) // per_prompt
            known = prompt_blocks[position] if position < len(prompt_blocks) else []
            usable = known if len(known) * ROUTING_BLOCK <= len(prompt) else ()
            served.append(block_keys([*prompt, *sampled], ROUTING_BLOCK, known=usable))
        return served
    except (ValueError, AttributeError, TypeError, KeyError):
        return []


def create_front(replicas: ReplicaSet, max_model_len: int) -> Starlette:
    """The HTTP front over `replicas` (routes: see the module's docstring)."""

    async def completions(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        prompts, sequences = _routing_ids(body)
        # Once a prompt: routed, recorded, and continued over the completion when served.
        prompt_blocks = [block_keys(prompt, ROUTING_BLOCK) for prompt in prompts]
        headers = {name: value for name, value in request.headers.items() if name.lower() in _FORWARDED_HEADERS}
        tried: set[int] = set()
        while True:  # a replica that fails under a request (it died) hands it to another: sampling is repeatable
            ready = [replica.ready and replica.index not in tried for replica in replicas.replicas]
            first = prompt_blocks[0] if prompt_blocks else []
            index = replicas.router.choose(first, ready, [replica.in_flight for replica in replicas.replicas])
            if index is None:
                return error_response(503, "no inference replica is ready; retry")
            tried.add(index)
            replica = replicas.replicas[index]
            replica.in_flight += sequences
            for blocks in prompt_blocks:  # the next prompt with this prefix follows it here, even before it is done
                replicas.router.record(blocks, index)
            try:
                answer = await replicas.call(replica, "POST", "/v1/completions", data=raw, headers=headers)
            except (aiohttp.ClientError, TimeoutError) as error:
                log.warning("inference replica %d failed under a request (%s)", index, type(error).__name__)
                continue
            finally:
                replica.in_flight -= sequences
            if answer.status == 200:
                for served in _served_ids(answer.content, prompt_blocks):
                    replicas.router.record(served, index)
            return answer.response()

    async def load_weights(request: Request) -> Response:
        try:  # checked here as one server checks it, so that no replica loads what another would refuse
            body = LoadWeightsRequest.model_validate_json(await request.body())
        except ValidationError as error:
            return error_response(400, validation_message(error))
        return (await replicas.load_weights(body.model_dump())).response()

    def version_headers(version: int | None) -> dict[str, str]:
        return {POLICY_VERSION_HEADER: str(version)} if version is not None else {}

    async def health(_: Request) -> Response:
        version = replicas.policy_version()
        states = [
            {
                "replica": r.index,
                "ready": r.ready,
                "policy_version": r.policy_version,
                "restarts": r.restarts,
                "in_flight": r.in_flight,
                "pid": r.process.pid if r.process is not None else None,
            }
            for r in replicas.replicas
        ]
        status = "ok" if version is not None else "unavailable"
        content = {"status": status, "policy_version": version, "replicas": states}
        return JSONResponse(content, status_code=200 if version is not None else 503, headers=version_headers(version))

    async def policy_version(_: Request) -> Response:
        version = replicas.policy_version()
        if version is None:
            return error_response(503, "no inference replica is ready")
        return JSONResponse({"policy_version": version}, headers=version_headers(version))

    async def metrics(_: Request) -> Response:
        texts = await asyncio.gather(
            *(_replica_metrics(replicas, replica) for replica in replicas.replicas), return_exceptions=True
        )
        labelled = [(str(r.index), t) for r, t in zip(replicas.replicas, texts, strict=True) if isinstance(t, str)]
        restarts = "".join(
            f'agentgym_inference_replica_restarts_total{{replica="{r.index}"}} {r.restarts}\n'
            for r in replicas.replicas
        )
        own = (
            "# HELP agentgym_inference_replica_restarts_total Restarts of each data-parallel replica\n"
            "# TYPE agentgym_inference_replica_restarts_total counter\n" + restarts
        )
        return Response(merge_metrics(labelled) + own, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def passthrough(request: Request) -> Response:
        for replica in replicas.replicas:
            if replica.ready:
                try:
                    answer = await replicas.call(replica, "GET", request.url.path, params=dict(request.query_params))
                except (aiohttp.ClientError, TimeoutError):
                    continue
                return answer.response()
        return error_response(503, "no inference replica is ready; retry")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/load_weights", load_weights, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/policy_version", policy_version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/{path:path}", passthrough, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    limit_body_size(app, max_model_len)
    return app


async def _replica_metrics(replicas: ReplicaSet, replica: Replica) -> str:
    if not replica.ready:
        raise RuntimeError("not ready")
    answer = await replicas.call(replica, "GET", "/metrics", timeout=10)
    if answer.status != 200:
        raise RuntimeError(f"metrics: {answer.status}")
    return answer.content.decode()


def merge_metrics(texts: Sequence[tuple[str, str]]) -> str:
    """Prometheus text of several replicas' metrics `(replica, text)`: each family's comment lines once, then every
    replica's samples of it, each labelled with its replica (`name{...,replica="0"} value`)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for replica, text in texts:
        comments: list[str] | None = None
        samples: list[str] = []
        for line in text.splitlines():
            if line.startswith("# HELP "):
                comments, samples = families.setdefault(line.split()[2], ([], []))
                if not comments:
                    comments.append(line)
            elif line.startswith("#"):
                if comments is not None and len(comments) < 2:
                    comments.append(line)
            elif line.strip():
                samples.append(_with_label(line, "replica", replica))
    out = [line for comments, samples in families.values() for line in (*comments, *samples)]
    return "\n".join(out) + ("\n" if out else "")


def _with_label(sample: str, name: str, value: str) -> str:
    """A Prometheus sample line with one more label."""
    escaped = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    closing = sample.rfind("} ")
    if "{" in sample.split(" ", 1)[0] and closing != -1:
        return f'{sample[:closing]},{name}="{escaped}"{sample[closing:]}'
    metric, _, rest = sample.partition(" ")
    return f'{metric}{{{name}="{escaped}"}} {rest}'


_REPLICA_OPTIONS = {
    "max_batch_size": "--max-batch-size",
    "batch_window_ms": "--batch-window-ms",
    "max_model_len": "--max-model-len",
    "device": "--device",
    "dtype": "--dtype",
    "num_threads": "--threads",
    "policy_version": "--policy-version",
    "prefix_cache_tokens": "--prefix-cache-tokens",
    "log_level": "--log-level",
}
"""`agentgym inference serve`'s options a replica is started with, by `server.run`'s keyword (host and port are the
front's; each replica gets a local port)."""


def replica_arguments(model: str, options: dict[str, Any]) -> list[str]:
    """The command-line options of one replica of `agentgym inference serve --model model` with `options`."""
    arguments = ["--model", model]
    for name, flag in _REPLICA_OPTIONS.items():
        if options.get(name) is not None:
            arguments += [flag, str(options[name])]
    return arguments


def replica_argv(arguments: Sequence[str], port: int) -> list[str]:
    """`agentgym inference serve arguments...` as one replica on local `port`."""
    return [sys.executable, "-m", "agentgym.cli", "inference", "serve", *arguments, "--host", "127.0.0.1",
            "--port", str(port), "--data-parallel", "1"]  # fmt: skip


async def serve_replicas(
    arguments: Sequence[str],
    replicas: int,
    cpus_per_replica: int,
    host: str,
    port: int,
    log_level: str,
) -> None:
    """Start `replicas` replicas of `agentgym inference serve arguments...` (each with `cpus_per_replica` cores) and
    serve their front on `host:port` until SIGINT/SIGTERM; then stop them."""
    environment = {**os.environ, CPUS_VARIABLE: str(cpus_per_replica)}
    environment.pop("AGENTGYM_INFERENCE_THREADS", None)  # sized from the replica's share instead
    replica_set = ReplicaSet(lambda replica_port: replica_argv(arguments, replica_port), replicas, environment)
    await replica_set.start()
    try:
        models = await replica_set.call(replica_set.replicas[0], "GET", "/v1/models")
        max_model_len = int(json.loads(models.content)["data"][0]["max_model_len"])
        app = create_front(replica_set, max_model_len)
        await serve_until_signalled(app, host, port, log_level)
    finally:
        await replica_set.stop()


def run(model: str, replicas: int, **options: Any) -> None:
    """`agentgym inference serve --data-parallel N`'s composition root: `replicas` engines of `model` with
    `server.run`'s `options`, each with its share of the usable cores, behind one front until interrupted."""
    arguments = replica_arguments(model, options)
    cpus = max(1, available_cpus() // replicas)
    host, port, level = options.get("host", "127.0.0.1"), options.get("port", 8000), options.get("log_level", "warning")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_replicas(arguments, replicas, cpus, host, port, level))


def data_parallel_refusal(model: str, replicas: int, device: str | None, prefix_cache_tokens: int | None) -> str | None:
    """Why `replicas` data-parallel engines of `model` cannot serve here, or None: they are CPU engines (one GPU
    runs one engine; several GPUs run several replicas), each with a core of its own (`agentgym.cpus.available_cpus`:
    affinity and cgroup quota), and together they must fit in the memory available."""
    if replicas <= 1:
        return None
    if pick_device(device).type != "cpu":
        return f"--data-parallel {replicas}: data parallelism is for CPU engines; on GPUs run one replica per GPU"
    cores = available_cpus()
    if replicas > cores:
        return f"--data-parallel {replicas}: each engine needs a core of its own, and this process may use {cores}"
    needed = replicas * replica_bytes(model, prefix_cache_tokens)
    available = available_memory()
    if available is not None and needed > available:
        gib = 1 << 30
        return (
            f"--data-parallel {replicas}: {replicas} engines of {model} need ~{needed / gib:.1f} GiB (weights twice"
            f" and a prefix cache each), more than the {available / gib:.1f} GiB available"
        )
    return None


def replica_bytes(model: str, prefix_cache_tokens: int | None) -> int:
    """What one CPU engine of `model` may hold: its weights twice (its bf16 packed copies, the LM head's) and its
    prefix cache's budget."""
    from agentgym.inference.models import resolve_model

    folder = Path(resolve_model(model))
    weights = sum(path.stat().st_size for pattern in ("*.safetensors", "*.bin") for path in folder.glob(pattern))
    if prefix_cache_tokens is None:
        return 2 * weights + DEFAULT_PREFIX_CACHE_BYTES
    config = json.loads((folder / "config.json").read_text())
    heads = int(config.get("num_attention_heads", 1))
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // max(1, heads))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return 2 * weights + prefix_cache_tokens * int(config.get("num_hidden_layers", 0)) * 2 * kv_heads * head_dim * 4
