"""OpenAI-compatible HTTP front end of the HF engine: the subset of vLLM's API the platform uses.

Routes (OpenAPI docs at /docs):

- `POST /v1/completions`: token-id (or text) prompts in, sampled token ids + raw logprobs out, plus our
  `policy_version` extension (also the `X-Policy-Version` header).
- `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus).
- `POST /v1/load_weights {"uri", "version"}` swaps in new weights (in-flight requests finish on the old ones),
  `GET /v1/policy_version`.

Errors are `{"error": {"message", "type", "param", "code"}}` with 400 (bad request, unknown model, bad
weights: what vLLM and OpenAI answer, validation errors included; the OpenAPI document says 400, not
FastAPI's 422), 409 (stale weight version), 413 (request body too large), 503 (shutting down).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentgym.cpus import configure_torch_threads, inference_threads
from agentgym.inference.client import POLICY_VERSION_HEADER
from agentgym.inference.engine import (
    Engine,
    EngineClosedError,
    GenerationOutput,
    InvalidRequestError,
    SampleOutput,
    SamplingParams,
    StaleVersionError,
    WeightLoadError,
)
from agentgym.inference.weights import pick_device
from agentgym.input_bounds import BodySizeLimit, safe_text, valid_unicode
from agentgym.serving import serve_until_signalled

log = logging.getLogger(__name__)
tracer = trace.get_tracer("agentgym.inference")

# A text prompt longer than this many characters per token of the model's context cannot fit it, and is
# refused before tokenizing (a few microseconds a character on one core, on the event loop, and memory:
# 10 MB took 46 s and 4 GB). Natural text and code average 3-5 characters a token with the BPE
# vocabularies served here, whitespace-heavy text under 10; 16 is a generous bound. Token-id prompts
# (the platform's own clients send those) are checked exactly, against the context, by the engine.
MAX_PROMPT_CHARS_PER_TOKEN = 16
# Request bodies are capped at this many bytes per token of context (at least 1 MiB): room for a text
# prompt at the cap above in the worst JSON escaping (12 bytes a character), or ~30 full-length token-id
# prompts (up to 8 bytes an id). Past it: 413 before the body is read.
BODY_BYTES_PER_CONTEXT_TOKEN = 256
MIN_BODY_BYTES = 1 << 20


def limit_body_size(app: Any, max_model_len: int) -> None:
    """Answer 413 to request bodies over the cap for this context (see above), before they are read: the server's
    and the data-parallel front's one rule."""
    app.add_middleware(
        BodySizeLimit,
        max_bytes=max(MIN_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * max_model_len),
        payload=lambda message: error_payload(413, message),
    )


class CompletionRequest(BaseModel):
    """vLLM's /v1/completions request, restricted to what this engine implements."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, description="Served model name (GET /v1/models); default: it")
    prompt: list[int] | list[list[int]] | str | list[str] = Field(
        description="Token ids (one prompt or a list of prompts), or text"
    )
    max_tokens: int = Field(default=16, description="Tokens to sample at most per choice")
    temperature: float = Field(default=1.0, description="0 = greedy")
    top_p: float = 1.0
    n: int = Field(default=1, description="Samples per prompt")
    stop: str | list[str] | None = Field(default=None, description="Stop strings (cut from text, ids kept)")
    stop_token_ids: list[int] | None = Field(default=None, description="Extra token ids that end a sample")
    seed: int | None = Field(default=None, description="Per-request sampling seed")
    logprobs: int | None = Field(default=None, description="Return logprobs (and this many top alternatives)")
    return_token_ids: bool = Field(default=False, description="Return the sampled ids as `token_ids`")
    return_tokens_as_token_ids: bool = Field(default=False, description="logprobs tokens as 'token_id:N'")
    ignore_eos: bool = False
    # Accepted only at their neutral values, so a client never silently gets a policy it did not ask for.
    stream: bool = False
    echo: bool = False
    best_of: int | None = None
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None

    def check_text(self) -> None:
        """Raise InvalidRequestError naming the field when a string holds a lone surrogate ("\\ud800" is legal
        JSON, but such text can be neither tokenized nor written into a response)."""
        fields: list[tuple[str, object]] = [("model", self.model), ("suffix", self.suffix)]
        fields += [("prompt", self.prompt if isinstance(self.prompt, str) else None)]
        if isinstance(self.prompt, list):
            fields += [(f"prompt.{i}", p) for i, p in enumerate(self.prompt) if isinstance(p, str)]
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields += [(f"stop.{i}" if not isinstance(self.stop, str) else "stop", s) for i, s in enumerate(stops)]
        for name, value in fields:
            if isinstance(value, str):
                try:
                    valid_unicode(value)
                except ValueError as error:
                    raise InvalidRequestError(f"{name}: {error}") from None

    def unsupported(self) -> str | None:
        checks = {
            "stream": not self.stream,
            "echo": not self.echo,
            "best_of": self.best_of in (None, self.n),
            "top_k": self.top_k in (None, 0, -1),
            "min_p": self.min_p == 0.0,
            "presence_penalty": self.presence_penalty == 0.0,
            "frequency_penalty": self.frequency_penalty == 0.0,
            "repetition_penalty": self.repetition_penalty == 1.0,
            "logit_bias": not self.logit_bias,
            "suffix": self.suffix is None,
        }
        bad = [name for name, ok in checks.items() if not ok]
        return ", ".join(bad) if bad else None


class LoadWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    uri: str = Field(min_length=1, description="HF folder, safetensors/.pt file, or a file:// URI of one")
    version: int = Field(ge=0, description="Policy version the new weights are served as")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


_KINDS = {
    400: "BadRequestError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    503: "ServiceUnavailableError",
}


def error_payload(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    # The message may quote the request: never let it make the response unencodable (lone surrogates).
    error = {
        "message": safe_text(message, 2_000),
        "type": kind or _KINDS.get(status, "InternalServerError"),
        "param": None,
        "code": status,
    }
    return {"error": error}


def error_response(status: int, message: str, kind: str | None = None) -> JSONResponse:
    return JSONResponse(error_payload(status, message, kind), status_code=status)


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` for the error statuses a route can answer."""
    described = {
        400: "Invalid request (malformed JSON and invalid fields included)",
        409: "A stale weight version",
        413: "Request body too large",
        503: "Shutting down",
    }
    return {status: {"model": ErrorResponse, "description": described[status]} for status in statuses}


_INVALID_400 = {
    "description": "Invalid request",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}


def validation_message(error: RequestValidationError | ValidationError) -> str:
    """A 400's message naming each invalid field (a request's body, or a model validated by hand)."""
    parts = []
    for item in error.errors():
        location = ".".join(safe_text(p, 100) for p in item.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {safe_text(item.get('msg', 'invalid'))}")
    return "invalid request: " + "; ".join(parts)


def _prompts(request: CompletionRequest, engine: Engine) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = [str(p) for p in prompt]
    else:
        texts = None
    if texts is not None:
        if any(not t for t in texts):
            raise InvalidRequestError("the prompt is empty")
        cap = engine.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
        longest = max(len(t) for t in texts)
        if longest > cap:
            raise InvalidRequestError(
                f"the prompt is {longest} characters, more than fit the model's context of {engine.max_model_len} "
                f"tokens (at most {cap} characters are tokenized); send token ids instead"
            )
        return [list(engine.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [[int(p) for p in prompt if isinstance(p, int)]]
    prompts = [list(p) for p in prompt if isinstance(p, list)]
    if len(prompts) != len(prompt):
        raise InvalidRequestError("prompt must be token ids, a list of token-id lists, text, or a list of texts")
    return prompts


def _params(request: CompletionRequest) -> SamplingParams:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if request.logprobs is not None and request.logprobs < 0:
        raise InvalidRequestError("logprobs must be >= 0")
    return SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        n=request.n,
        stop=tuple(stop),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        seed=request.seed,
        ignore_eos=request.ignore_eos,
        top_logprobs=request.logprobs or 0,
    )


class _TokenText:
    """Per-token display strings for logprobs (cached: the same ids recur constantly)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int, as_id: bool) -> str:
        if as_id:
            return f"token_id:{token}"
        text = self.cache.get(token)
        if text is None:
            text = str(self.tokenizer.decode([token]))
            if len(self.cache) < 200_000:
                self.cache[token] = text
        return text


def _choice(
    index: int, sample: SampleOutput, prompt: list[int], request: CompletionRequest, token_text: _TokenText
) -> dict[str, Any]:
    logprobs: dict[str, Any] | None = None
    if request.logprobs is not None:
        as_id = request.return_tokens_as_token_ids
        tokens = [token_text(t, as_id) for t in sample.token_ids]
        offsets: list[int] = []
        position = 0
        for token in tokens:
            offsets.append(position)
            position += len(token)
        top: list[dict[str, float] | None] | None = None
        if sample.top_logprobs is not None:
            top = [{token_text(t, as_id): lp for t, lp in entry.items()} for entry in sample.top_logprobs]
        logprobs = {"text_offset": offsets, "token_logprobs": sample.logprobs, "tokens": tokens, "top_logprobs": top}
    return {
        "index": index,
        "text": sample.text,
        "token_ids": sample.token_ids if request.return_token_ids else None,
        "prompt_token_ids": prompt if request.return_token_ids else None,
        "logprobs": logprobs,
        "finish_reason": sample.finish_reason,
        "stop_reason": sample.stop_reason,
    }


def create_app(engine: Engine, *, manage_engine: bool = False) -> FastAPI:
    """The FastAPI app over `engine`; with `manage_engine`, the app closes the engine on shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(engine.close)

    app = FastAPI(
        title="AgentGym-RL inference",
        description="OpenAI-compatible completions (vLLM's subset) over the platform's HF engine.",
        lifespan=lifespan,
    )
    app.state.engine = engine
    metrics = engine.metrics
    token_text = _TokenText(engine.tokenizer)
    limit_body_size(app, engine.max_model_len)

    def openapi() -> dict[str, Any]:
        # Validation errors are answered 400 (as vLLM and OpenAI do): say so instead of FastAPI's 422.
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses.setdefault("400", _INVALID_400)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        if request.url.path == "/v1/completions":
            metrics.requests.labels("invalid").inc()
        return error_response(400, validation_message(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own errors (a body that is not even UTF-8, an unknown route or method) in OpenAI's shape.
        response = error_response(error.status_code, str(error.detail))
        response.headers.update(error.headers or {})
        return response

    @app.exception_handler(InvalidRequestError)
    async def _bad(_: Request, error: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(error))

    @app.exception_handler(EngineClosedError)
    async def _closed(_: Request, error: EngineClosedError) -> JSONResponse:
        return error_response(503, str(error))

    @app.post("/v1/completions", responses=_errors(400, 413, 503))
    async def completions(body: CompletionRequest, request: Request) -> JSONResponse:
        with tracer.start_as_current_span(
            "inference.completion", context=propagate.extract(dict(request.headers))
        ) as span:
            try:
                body.check_text()
            except InvalidRequestError:
                metrics.requests.labels("invalid").inc()
                raise
            unsupported = body.unsupported()
            if unsupported:
                metrics.requests.labels("invalid").inc()
                return error_response(400, f"not supported by this engine: {unsupported}")
            if body.model is not None and body.model != engine.served_model_name:
                metrics.requests.labels("invalid").inc()
                return error_response(
                    400, f"the model {body.model!r} is not served here; this server serves {engine.served_model_name!r}"
                )
            try:
                prompts = _prompts(body, engine)
                params = _params(body)
                for prompt in prompts:
                    engine.check(prompt, params)
            except InvalidRequestError:
                metrics.requests.labels("invalid").inc()
                raise
            try:
                outputs: list[GenerationOutput] = list(
                    await asyncio.gather(*(engine.generate(prompt, params) for prompt in prompts))
                )
            except EngineClosedError:
                metrics.requests.labels("unavailable").inc()
                raise
            except Exception:
                metrics.requests.labels("error").inc()
                raise
            choices = []
            for prompt_index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
                for sample in output.samples:
                    choice = _choice(prompt_index * params.n + sample.index, sample, prompt, body, token_text)
                    if len(outputs) > 1:
                        choice["policy_version"] = output.policy_version
                    choices.append(choice)
            prompt_tokens = sum(o.prompt_tokens for o in outputs)
            completion_tokens = sum(o.completion_tokens for o in outputs)
            version = min(o.policy_version for o in outputs)
            span.set_attribute("inference.prompts", len(prompts))
            span.set_attribute("inference.n", params.n)
            span.set_attribute("inference.prompt_tokens", prompt_tokens)
            span.set_attribute("inference.completion_tokens", completion_tokens)
            span.set_attribute("inference.policy_version", version)
            span.set_attribute("inference.queue_seconds", max(o.queue_seconds for o in outputs))
            metrics.requests.labels("ok").inc()
            content = {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": engine.served_model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": sum(o.cached_prompt_tokens for o in outputs)},
                },
                "policy_version": version,
            }
            return JSONResponse(content, headers={POLICY_VERSION_HEADER: str(version)})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "agentgym",
                    "root": str(engine.model_dir),
                    "max_model_len": engine.max_model_len,
                    "policy_version": engine.policy_version,
                }
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            {"status": "ok", "model": engine.served_model_name, "policy_version": engine.policy_version},
            headers={POLICY_VERSION_HEADER: str(engine.policy_version)},
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        """Prometheus metrics, in Prometheus' text format."""
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/policy_version")
    async def policy_version() -> JSONResponse:
        version = engine.policy_version
        return JSONResponse({"policy_version": version}, headers={POLICY_VERSION_HEADER: str(version)})

    @app.post("/v1/load_weights", responses=_errors(400, 409, 413))
    async def load_weights(body: LoadWeightsRequest) -> JSONResponse:
        started = time.perf_counter()
        with tracer.start_as_current_span("inference.load_weights") as span:
            span.set_attribute("inference.uri", body.uri)
            span.set_attribute("inference.policy_version", body.version)
            try:
                version = await engine.load_weights(body.uri, body.version)
            except WeightLoadError as error:
                return error_response(400, f"{error}; still serving policy version {engine.policy_version}")
            except StaleVersionError as error:
                return error_response(409, str(error))
            return JSONResponse(
                {
                    "policy_version": version,
                    "model": engine.served_model_name,
                    "load_seconds": round(time.perf_counter() - started, 3),
                },
                headers={POLICY_VERSION_HEADER: str(version)},
            )

    return app


async def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    max_batch_size: int = 32,
    batch_window_ms: float = 5.0,
    max_model_len: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    num_threads: int | None = None,
    policy_version: int = 0,
    prefix_cache_tokens: int | None = None,
    log_level: str = "warning",
) -> None:
    """Load `model` and serve it until SIGINT/SIGTERM, then stop the engine. `prefix_cache_tokens`: the prefix
    cache's budget (0 disables it; None: the engine's default)."""
    engine = await asyncio.to_thread(
        Engine.from_name,
        model,
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        max_model_len=max_model_len,
        device=device,
        dtype=dtype,
        num_threads=num_threads,
        policy_version=policy_version,
        prefix_cache_tokens=prefix_cache_tokens,
    )
    try:
        app = create_app(engine)
        await serve_until_signalled(app, host, port, log_level)
    finally:
        await asyncio.to_thread(engine.close)


def run(model: str, **kwargs: Any) -> None:
    """The inference service's composition root (`agentgym inference serve`): telemetry when it is configured,
    then `serve` until interrupted. On CPU, torch threads are sized to the cores this process may use, not the
    node's (`agentgym.cpus.inference_threads`) unless `num_threads` is given."""
    threads = kwargs.get("num_threads")
    if threads is None and pick_device(kwargs.get("device")).type == "cpu":
        threads = inference_threads()
    kwargs["num_threads"] = configure_torch_threads(threads)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("AGENTGYM_TELEMETRY_DIR"):
        from agentgym.telemetry import setup_telemetry

        setup_telemetry("inference")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(model, **kwargs))
