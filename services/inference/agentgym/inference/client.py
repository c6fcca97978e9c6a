"""Async client of the completions API, used by rollout workers; one code path for our server and vLLM.

    async with CompletionClient("http://inference:8000") as client:
        [completion] = await client.complete(prompt_ids, max_tokens=256, temperature=1.0, stop_token_ids=[2])
        completion.token_ids, completion.logprobs, completion.finish_reason, completion.policy_version

Requests ask for `return_token_ids` (the exact sampled ids) and `logprobs=0` (the sampled tokens' raw model
logprobs). Against vLLM (`engine="vllm"`) the response carries no policy version: completions report the
last version this client observed (`policy_version()` / `load_weights()`), and weight updates go through
`agentgym.inference.vllm.VLLMAdapter`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Protocol

import aiohttp

# Defined apart so that `vllm` (imported lazily from here) does not import this module back.
from agentgym.inference.errors import InferenceError

POLICY_VERSION_HEADER = "X-Policy-Version"


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    """Exactly the sampled ids (EOS / stop token included when that is what ended the sample)."""
    logprobs: list[float]
    """log p(token) under the unmodified model distribution (temperature 1, no top-p), one per token id."""
    finish_reason: str
    policy_version: int
    text: str = ""
    stop_reason: int | str | None = None
    model: str = ""
    cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache (``usage.prompt_tokens_details.cached_tokens``), if reported."""


class WeightUpdater(Protocol):
    """What the operator / local runner needs to roll weights to an inference replica."""

    async def load_weights(self, uri: str, version: int) -> int: ...

    async def policy_version(self) -> int: ...


def _error_message(body: Any, fallback: str) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    return fallback


def _cached_tokens(body: Any) -> int | None:
    usage = body.get("usage") if isinstance(body, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(value) if isinstance(value, int) else None


def _token_ids_from_logprobs(logprobs: dict[str, Any] | None) -> list[int] | None:
    """vLLM started with --return-tokens-as-token-ids names logprob tokens 'token_id:N'."""
    tokens = (logprobs or {}).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return None
    return [int(t.removeprefix("token_id:")) for t in tokens]


class CompletionClient:
    """aiohttp client of `/v1/completions` (+ weight-update routes of our server, or of vLLM via the adapter)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        engine: Literal["hf", "vllm"] = "hf",
        timeout: float = 600.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.engine = engine
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session = session
        self._owns_session = session is None
        self.known_version = 0
        self._vllm: Any = None

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._vllm is not None:
            await self._vllm.close()
        if self._session is not None and self._owns_session:
            await self._session.close()
        self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
            self._owns_session = True
        return self._session

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> tuple[Any, Any]:
        url = f"{self.base_url}{path}"
        try:
            async with self._http().request(method, url, json=payload) as response:
                text = await response.text()
                try:
                    body: Any = await response.json(content_type=None) if text else None
                except ValueError:
                    body = None
                if response.status >= 400:
                    message = _error_message(body, text.strip()[:500] or response.reason or "error")
                    raise InferenceError(
                        f"{method} {path} -> HTTP {response.status}: {message}", status=response.status
                    )
                return body, response.headers
        except InferenceError:
            raise
        except TimeoutError as error:
            raise InferenceError(f"{method} {path}: timed out", status=None) from error
        except aiohttp.ClientError as error:
            raise InferenceError(f"{method} {path}: {type(error).__name__}: {error}", status=None) from error

    def _adapter(self) -> Any:
        if self._vllm is None:
            from agentgym.inference.vllm import VLLMAdapter

            self._vllm = VLLMAdapter(self.base_url, session=self._http())
        return self._vllm

    async def models(self) -> list[str]:
        body, _ = await self._request("GET", "/v1/models")
        return [str(entry["id"]) for entry in (body or {}).get("data", [])]

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health")
        except InferenceError:
            return False
        return True

    async def complete(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        n: int = 1,
    ) -> list[Completion]:
        """Sample `n` continuations of `prompt_ids`; one `Completion` per sample, in order."""
        if self.model is None:
            served = await self.models()
            if not served:
                raise InferenceError("the server lists no model", status=None, transient=True)
            self.model = served[0]
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": [int(t) for t in prompt_ids],
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "n": n,
            "stop": stop or None,
            "stop_token_ids": stop_token_ids or None,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
        }
        body, headers = await self._request("POST", "/v1/completions", payload)
        version = self._version_of(body, headers)
        choices = sorted((body or {}).get("choices") or [], key=lambda c: int(c.get("index", 0)))
        if len(choices) != n:
            raise InferenceError(f"expected {n} choices, got {len(choices)}", status=None, transient=False)
        model = str((body or {}).get("model") or self.model)
        cached = _cached_tokens(body) if n == 1 else None  # usage is per response: per choice only for n = 1
        return [
            dataclasses.replace(self._completion(choice, version), model=model, cached_tokens=cached)
            for choice in choices
        ]

    def _version_of(self, body: Any, headers: Any) -> int:
        value = (body or {}).get("policy_version") if isinstance(body, dict) else None
        if value is None:
            value = headers.get(POLICY_VERSION_HEADER) if headers is not None else None
        if value is None:
            return self.known_version
        version = int(value)
        self.known_version = max(self.known_version, version)
        return version

    def _completion(self, choice: dict[str, Any], version: int) -> Completion:
        logprobs = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        token_ids = [int(t) for t in ids] if ids is not None else _token_ids_from_logprobs(logprobs)
        if token_ids is None:
            raise InferenceError(
                "the response has no token ids (the server ignored return_token_ids; start vLLM with "
                "--return-tokens-as-token-ids)",
                status=None,
                transient=False,
            )
        values = logprobs.get("token_logprobs")
        if not isinstance(values, list) or len(values) != len(token_ids) or any(v is None for v in values):
            raise InferenceError(
                f"logprobs do not align with token ids ({len(values) if isinstance(values, list) else 'none'} "
                f"vs {len(token_ids)})",
                status=None,
                transient=False,
            )
        return Completion(
            token_ids=token_ids,
            logprobs=[float(v) for v in values],
            finish_reason=str(choice.get("finish_reason") or "length"),
            policy_version=int(choice.get("policy_version", version)),
            text=str(choice.get("text") or ""),
            stop_reason=choice.get("stop_reason"),
        )

    async def policy_version(self) -> int:
        """The version being served (and remember it as `known_version`)."""
        if self.engine == "vllm":
            version = int(await self._adapter().policy_version())
        else:
            body, _ = await self._request("GET", "/v1/policy_version")
            version = int(body["policy_version"])
        self.known_version = version
        return version

    async def load_weights(self, uri: str, version: int) -> int:
        """Make the server serve the checkpoint at `uri` as `version`; returns the version served."""
        if self.engine == "vllm":
            served = int(await self._adapter().load_weights(uri, version))
        else:
            body, _ = await self._request("POST", "/v1/load_weights", {"uri": uri, "version": version})
            served = int(body["policy_version"])
        self.known_version = served
        return served
