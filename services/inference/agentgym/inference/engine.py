"""The platform's HF-transformers generation engine (CPU, or GPU when available) with dynamic batching.

One worker thread owns the model and runs a continuous-batching loop:

- Requests are queued (a request with `n` samples becomes `n` sequences). When nothing is running, the worker
  waits up to `batch_window_ms` for more arrivals (or until `max_batch_size` sequences are queued), then
  prefills them together: prompts left-padded to one length, one forward pass, KV cache kept.
- Every decode step feeds the last sampled token of every running sequence in one forward pass.
- Between decode steps, queued requests join the running batch (their prompts are prefilled together and
  their KV caches merged into the running one, left-padded to a common length) while there are free slots,
  and finished sequences leave it (their cache rows are dropped, and fully padded columns trimmed).
- A request's `n` samples share one prefill row (its KV is copied to `n` rows after the forward pass).
- The running batch's KV cache layers (`kv.GrowingLayer`) have spare rows and columns: a decode step writes
  its column in place instead of copying the whole cache (transformers' `DynamicLayer` concatenates),
  joining sequences are copied into free rows, and leaving ones are replaced by the last rows (so only
  those are copied; the batch's row order changes, which changes nothing else).

Automatic prefix caching (`prefix_cache.PrefixCache`, `prefix_cache_tokens` > 0): the KV of every prefilled
prompt and of every finished sequence (its prompt and sampled ids but the last) is kept in an LRU store
bounded by a token budget. A prompt that starts with cached ids (a multi-turn episode's next turn sends the
whole conversation so far) reuses that KV for the longest cached prefix and prefills only the rest:

- Rows with different cached lengths prefill together: each row's cached KV is left-padded to the longest
  cached length and its new tokens to the longest suffix, so a row's columns are
  `[pad, cached, pad, new]`; the 2D attention mask is 0 on every pad column and position ids count real
  tokens per row (the cached prefix keeps the positions it was computed at).
- The rows admitted together are split into prefill groups of similar suffix length when that costs less
  than padding every row to the longest suffix (a small dynamic program: one forward pass costs about
  `_PREFILL_OVERHEAD_TOKENS` tokens); the groups' KV caches then merge into the running batch.
- Requests admitted together that share a prompt prefix beyond their cache hits (episodes starting from the
  same system prompt) get that prefix prefilled once, stored, and then reused by each of them.
- Weight swaps clear the store; entries also carry the policy version and never serve another one.
- Cached KV changes no output beyond float rounding: the prefix's keys/values were computed by the same
  weights at the same positions; only the batch they were computed in differs.

A sequence stops on EOS (unless `ignore_eos`), on one of `stop_token_ids`, on a stop string, or after
`max_tokens`. Stop strings are found in text decoded incrementally from the sampled ids (a `DecodeStream`),
never by re-encoding text. The returned `token_ids` are exactly the sampled ids, including the EOS / stop
token or the token that completed a stop string (only `text` is cut before the stop string).

Sampling: `temperature` 0 is greedy; otherwise the logits are divided by the temperature, nucleus-filtered
with `top_p`, and sampled with a per-sequence `torch.Generator` (seeded from the request's `seed` and the
sample index, so a seeded request is reproducible when its batch composition is the same). The nucleus is
looked for among each row's most likely tokens (a top-k) before any whole vocabulary is sorted:
`benchmarks/sampler_bench.py`.

Logprobs: `logprobs[i]` is log p(token_i | context) under the model's unmodified distribution
(log_softmax of the raw logits: temperature 1, no top-p) — the policy likelihood the trainer recomputes
with a plain forward pass, and what vLLM reports with `--logprobs-mode raw_logprobs`. The distribution the
token was drawn from (temperature/top-p applied) is not what PPO's importance ratio compares against, so
it is not reported.

Weight updates (`load_weights`) load into a new model object off the worker thread; the worker stops
admitting new sequences, lets the running ones finish on the old weights, then swaps the model between
steps. Requests still queued at that moment run on the new weights. Every result carries the
`policy_version` of the weights that produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentgym.allocator import retain_freed_memory
from agentgym.inference.kv import GrowingLayer, compaction, spare_columns
from agentgym.inference.metrics import InferenceMetrics
from agentgym.inference.models import ModelError, load_tokenizer, resolve_model
from agentgym.inference.prefix_cache import BLOCK_SIZE, CachedPrefix, PrefixCache, block_keys, common_prefix

log = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
MAX_TOP_LOGPROBS = 20
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
"""Without `prefix_cache_tokens`, the prefix cache holds as many tokens as 1 GiB of KV: 262,144 tokens of the
tiny model (4 KiB each), 23,301 of SmolLM2-135M (45 KiB each)."""
_PREFILL_OVERHEAD_TOKENS = 64
"""The fixed cost of one prefill forward pass, in prompt tokens (about 10 ms on CPU for the tiny model)."""


class EngineError(RuntimeError):
    """Base class of the engine's errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as asked (the HTTP layer answers 400)."""


class EngineClosedError(EngineError):
    """The engine is shutting down (the HTTP layer answers 503)."""


class WeightLoadError(EngineError):
    """New weights could not be loaded; the old ones keep serving (the HTTP layer answers 400)."""


class StaleVersionError(EngineError):
    """A weight update older than the version being served (the HTTP layer answers 409)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0
    """Also return the `top_logprobs` most likely tokens (raw model logprobs) at each position."""


@dataclass
class SampleOutput:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    """The stop string or stop token id that ended the sample; None for EOS or length."""
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class GenerationOutput:
    samples: list[SampleOutput]
    prompt_tokens: int
    policy_version: int
    queue_seconds: float
    generation_seconds: float

    @property
    def completion_tokens(self) -> int:
        return sum(len(sample.token_ids) for sample in self.samples)


@dataclass
class EngineStats:
    """Counters read by tests and the benchmark (the Prometheus metrics carry the same figures)."""

    requests: int = 0
    sequences: int = 0
    prefill_batches: int = 0
    decode_steps: int = 0
    prefill_rows: int = 0
    decode_rows: int = 0
    generated_tokens: int = 0
    max_running: int = 0
    swaps: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of admitted requests (one per request, whatever its `n`)."""
    prefill_tokens: int = 0
    """Tokens run through prefill forward passes (padding excluded)."""
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (one count per request, like `prompt_tokens`)."""
    shared_prefills: int = 0
    """Prefixes shared by requests admitted together, prefilled once for all of them."""


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[GenerationOutput]
    loop: asyncio.AbstractEventLoop
    enqueued: float
    samples: list[SampleOutput | None] = field(default_factory=list)
    remaining: int = 0
    admitted: float = 0.0
    version: int = 0

    def cancelled(self) -> bool:
        return self.future.done()


class _Sequence:
    """One sample of a request while it runs."""

    __slots__ = (
        "decoder",
        "finish_reason",
        "generator",
        "index",
        "logprobs",
        "max_stop_len",
        "request",
        "stop_ids",
        "stop_reason",
        "text",
        "token_ids",
        "top",
    )

    def __init__(self, request: _Request, index: int, stop_ids: frozenset[int], device: torch.device) -> None:
        from tokenizers.decoders import DecodeStream

        self.request = request
        self.index = index
        self.stop_ids = stop_ids
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[dict[int, float]] | None = [] if request.params.top_logprobs > 0 else None
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.max_stop_len = max((len(s) for s in request.params.stop), default=0)
        self.generator: torch.Generator | None = None
        if request.params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(_sample_seed(request.params.seed, index))

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def output(self) -> SampleOutput:
        return SampleOutput(
            index=self.index,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            text=self.text,
            finish_reason=self.finish_reason or FINISH_LENGTH,
            stop_reason=self.stop_reason,
            top_logprobs=self.top,
        )


def _sample_seed(seed: int | None, index: int) -> int:
    """The generator seed of sample `index`: derived from the request seed, or random when it has none."""
    if seed is None:
        return random.SystemRandom().getrandbits(63)
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class _Swap:
    model: Any
    version: int
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Prefill:
    """One row of a prefill forward pass: a request's prompt (its `n` sequences share the row), or a prefix
    shared by several requests (no sequences: its KV only goes to the prefix cache)."""

    ids: list[int]
    sequences: list[_Sequence]
    request: _Request | None = None
    entry: CachedPrefix | None = None
    cached: int = 0
    """Leading ids whose KV comes from `entry`."""

    @property
    def suffix(self) -> int:
        return len(self.ids) - self.cached


@dataclass
class _Batch:
    """The running batch: one row per sequence, a left-padded KV cache, and what to feed next."""

    sequences: list[_Sequence]
    cache: Any
    mask: torch.Tensor  # [rows, cache length], 1 on real tokens
    lengths: torch.Tensor  # [rows], real tokens in the cache (= the next position id)
    next_tokens: torch.Tensor  # [rows], sampled but not yet fed


def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device, dtype: str | None = None) -> torch.dtype:
    """float32 on CPU (whatever is asked: CPU half precision is slow and imprecise), else as asked (bf16)."""
    if device.type == "cpu":
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16}.get(dtype or "bfloat16", torch.bfloat16)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_model(source: str | Path, device: torch.device, dtype: torch.dtype) -> Any:
    """An HF causal LM from a folder, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model: Any = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    return model.to(device).eval()


def _cache_argument(model: Any) -> str:
    """The forward keyword of the KV cache: `cache` in recent transformers, `past_key_values` before."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


class Engine:
    """Dynamic-batching generation over one HF causal LM; `await engine.generate(prompt_ids, params)`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        served_model_name: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        max_batch_size: int = 32,
        batch_window_ms: float = 5.0,
        max_model_len: int | None = None,
        policy_version: int = 0,
        metrics: InferenceMetrics | None = None,
        num_threads: int | None = None,
        prefix_cache_tokens: int | None = None,
        prefix_block_size: int = BLOCK_SIZE,
    ) -> None:
        """`num_threads` sets torch's (process-wide) CPU thread count; on a shared or small machine 1 is often
        faster than oversubscribed OpenMP threads. `prefix_cache_tokens` bounds the prefix cache (tokens of KV
        kept; 0 disables it; default: `DEFAULT_PREFIX_CACHE_BYTES` worth); `prefix_block_size` is its index's
        block size."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if batch_window_ms < 0:
            raise ValueError("batch_window_ms must be >= 0")
        if prefix_cache_tokens is not None and prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be >= 0")
        if prefix_block_size < 1:
            raise ValueError("prefix_block_size must be >= 1")
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name or str(model_dir)
        self.device = pick_device(device)
        self.dtype = pick_dtype(self.device, dtype)
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_ms / 1000.0
        self.metrics = metrics or InferenceMetrics()
        self.stats = EngineStats()
        self.tokenizer = load_tokenizer(self.model_dir)
        self._backend_tokenizer = self.tokenizer.backend_tokenizer
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if self.device.type == "cpu":
            retain_freed_memory()  # the [batch, vocab] logits of every decode step reuse freed buffers
        self._model = load_model(self.model_dir, self.device, self.dtype)
        self._cache_kw = _cache_argument(self._model)
        self.vocab_size = int(self._model.config.vocab_size)
        positions = int(getattr(self._model.config, "max_position_embeddings", 0) or 0) or 1 << 30
        self.max_model_len = min(max_model_len, positions) if max_model_len else positions
        self.eos_token_ids = _eos_ids(self._model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else min(self.eos_token_ids, default=0))
        self._version = policy_version
        self.metrics.policy_version.set(policy_version)
        self._growable = _growable_cache(self._model)
        if prefix_cache_tokens is None:
            prefix_cache_tokens = DEFAULT_PREFIX_CACHE_BYTES // _kv_bytes_per_token(self._model, self.dtype)
        self.prefix_cache_tokens = prefix_cache_tokens
        self._prefix = PrefixCache(prefix_cache_tokens, prefix_block_size)
        self.metrics.prefix_cache_capacity.set(prefix_cache_tokens if self._caching else 0)
        self._prefix_seen = (0, 0)  # (evicted, superseded) already counted in the metrics
        self._decode_batches = self.metrics.forward_batches.labels("decode")
        self._decode_sizes = self.metrics.batch_size.labels("decode")
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._waiting_sequences = 0
        self._swap: _Swap | None = None
        self._closing = False
        self._batch: _Batch | None = None
        self._load_lock = asyncio.Lock()
        self._thread = threading.Thread(target=self._run, name="agentgym-inference-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_name(cls, name: str, **kwargs: Any) -> Engine:
        """An engine for `builtin:tiny`, `builtin:smollm2-135m` or an HF folder; served under `name`."""
        try:
            folder = resolve_model(name)
        except ModelError as error:
            raise ValueError(str(error)) from None
        kwargs.setdefault("served_model_name", name)
        return cls(folder, **kwargs)

    # ------------------------------------------------------------------ public API

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def model(self) -> Any:
        """The model object serving now (replaced, never modified, by a weight swap)."""
        return self._model

    @property
    def model_config(self) -> Any:
        return self._model.config

    @property
    def prefix_cache(self) -> PrefixCache:
        """The prefix cache (owned by the worker thread: read its counters, do not modify it)."""
        return self._prefix

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise `InvalidRequestError` when the request cannot be served."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if params.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be >= 1")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        if not 1 <= params.n <= self.max_batch_size:
            raise InvalidRequestError(f"n must be between 1 and {self.max_batch_size} (the max batch size)")
        if not (params.temperature >= 0 and math.isfinite(params.temperature)):
            raise InvalidRequestError("temperature must be a finite number >= 0")
        if not 0 < params.top_p <= 1:
            raise InvalidRequestError("top_p must be in (0, 1]")
        if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(f"stop_token_ids out of the vocabulary: {bad_stop[:5]}")
        if any(not s for s in params.stop):
            raise InvalidRequestError("stop strings must not be empty")

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
        """Queue a request and wait for all its `n` samples."""
        prompt = [int(t) for t in prompt_ids]
        self.check(prompt, params)
        loop = asyncio.get_running_loop()
        request = _Request(
            prompt_ids=prompt,
            params=params,
            future=loop.create_future(),
            loop=loop,
            enqueued=time.perf_counter(),
            samples=[None] * params.n,
            remaining=params.n,
        )
        with self._cond:
            if self._closing:
                raise EngineClosedError("the inference engine is shutting down")
            self._waiting.append(request)
            self._waiting_sequences += params.n
            self.metrics.waiting.set(self._waiting_sequences)
            self._cond.notify_all()
        return await request.future

    async def load_weights(self, uri: str, version: int) -> int:
        """Load weights from an HF folder, a safetensors / torch state-dict file (`file://` URIs too) and serve
        them as `version` once the running batch has finished on the old weights. Returns the version."""
        started = time.perf_counter()
        async with self._load_lock:
            if version < self._version:
                self.metrics.weight_loads.labels("stale").inc()
                raise StaleVersionError(f"version {version} is older than the served version {self._version}")
            try:
                model = await asyncio.to_thread(self._load_candidate, uri)
            except WeightLoadError:
                self.metrics.weight_loads.labels("error").inc()
                raise
            swap = _Swap(model=model, version=version)
            with self._cond:
                if self._closing:
                    raise EngineClosedError("the inference engine is shutting down")
                self._swap = swap
                self._cond.notify_all()
            await asyncio.to_thread(swap.done.wait)
            if self._version != version:
                raise EngineClosedError("the inference engine shut down before the new weights were swapped in")
            self.metrics.weight_loads.labels("ok").inc()
            self.metrics.weight_load_time.observe(time.perf_counter() - started)
            log.info("serving policy version %d from %s", version, uri)
            return version

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker; queued and running requests fail with `EngineClosedError`."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ weight loading

    def _load_candidate(self, uri: str) -> Any:
        """A new model object holding the weights at `uri` (checked before it can be swapped in)."""
        path = Path(uri.removeprefix("file://")).expanduser()
        try:
            if path.is_dir():
                if not (path / "config.json").is_file():
                    raise WeightLoadError(f"{uri}: folder has no config.json")
                model = load_model(path, self.device, self.dtype)
            elif path.is_file():
                model = self._model_from_state_dict(path)
            else:
                raise WeightLoadError(f"{uri}: no such file or folder")
        except WeightLoadError:
            raise
        except Exception as error:
            raise WeightLoadError(f"{uri}: could not load weights: {type(error).__name__}: {error}") from error
        vocab = int(model.config.vocab_size)
        if vocab != self.vocab_size:
            raise WeightLoadError(f"{uri}: vocabulary size {vocab} differs from the served model's {self.vocab_size}")
        with torch.inference_mode():
            probe = torch.tensor([[self.pad_token_id]], device=self.device)
            logits = model(input_ids=probe).logits
        if not torch.isfinite(logits).all():
            raise WeightLoadError(f"{uri}: the new weights produce non-finite logits")
        return model

    def _model_from_state_dict(self, path: Path) -> Any:
        from transformers import AutoModelForCausalLM

        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        elif path.suffix in (".pt", ".pth", ".bin"):
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
            state = loaded.get("model", loaded) if isinstance(loaded, dict) else loaded
            if not isinstance(state, dict):
                raise WeightLoadError(f"{path}: not a state dict")
        else:
            raise WeightLoadError(f"{path}: expected a model folder, .safetensors, .pt, .pth or .bin file")
        model = AutoModelForCausalLM.from_config(self._model.config, dtype=self.dtype)
        tied = {"lm_head.weight"} if getattr(self._model.config, "tie_word_embeddings", False) else set()
        result = model.load_state_dict(state, strict=False)
        missing = set(result.missing_keys) - tied
        if missing or result.unexpected_keys:
            raise WeightLoadError(
                f"{path}: state dict does not match the served architecture "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]})"
            )
        if tied:
            model.tie_weights()
        return model.to(self.device).eval()

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                self._loop()
        except Exception as error:  # a bug: fail everything rather than hang clients
            log.exception("inference engine worker crashed")
            self._fail_all(EngineError(f"inference engine crashed: {type(error).__name__}: {error}"))
        else:
            self._fail_all(EngineClosedError("the inference engine is shutting down"))

    def _loop(self) -> None:
        while True:
            admitted: list[_Request] = []
            with self._cond:
                while not self._closing and self._batch is None and not self._waiting and self._swap is None:
                    self._cond.wait()
                if self._closing:
                    return
                if self._swap is not None and self._batch is None:
                    self._apply_swap()
                    continue
                if self._batch is None and self._swap is None:
                    self._collect_window()
                if self._swap is None:
                    admitted = self._take_admissible()
            if admitted:
                self._admit(admitted)
            if self._batch is not None:
                self._decode_step()

    def _collect_window(self) -> None:
        """Wait (lock held) up to the batch window for more requests when starting a fresh batch."""
        deadline = time.perf_counter() + self.batch_window_s
        while not self._closing and self._swap is None and self._waiting_sequences < self.max_batch_size:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            self._cond.wait(remaining)

    def _take_admissible(self) -> list[_Request]:
        """Pop queued requests (FIFO) whose sequences fit in the free slots (lock held)."""
        running = len(self._batch.sequences) if self._batch is not None else 0
        free = self.max_batch_size - running
        if running and not self._can_merge():
            return []
        taken: list[_Request] = []
        while self._waiting:
            head = self._waiting[0]
            if head.cancelled():
                self._waiting.popleft()
                self._waiting_sequences -= head.params.n
                continue
            if head.params.n > free:
                break
            self._waiting.popleft()
            self._waiting_sequences -= head.params.n
            free -= head.params.n
            taken.append(head)
        self.metrics.waiting.set(self._waiting_sequences)
        return taken

    def _can_merge(self) -> bool:
        return self._batch is None or self._growable

    @property
    def _caching(self) -> bool:
        return self._growable and self._prefix.enabled

    def _apply_swap(self) -> None:
        swap = self._swap
        assert swap is not None
        old = self._model
        self._model = swap.model
        self._cache_kw = _cache_argument(self._model)
        self._version = swap.version
        self.eos_token_ids = _eos_ids(self._model, self.tokenizer)
        self._growable = _growable_cache(self._model)
        self.metrics.prefix_cache_capacity.set(self._prefix.max_tokens if self._caching else 0)
        # KV computed by the old weights must never serve the new ones.
        dropped = self._prefix.clear()
        if dropped:
            self.metrics.prefix_cache_evictions.labels("weights").inc(dropped)
        self._sync_prefix_metrics()
        self._swap = None
        self.stats.swaps += 1
        self.metrics.policy_version.set(swap.version)
        swap.done.set()
        del old
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            self._closing = True
            requests = list(self._waiting)
            self._waiting.clear()
            self._waiting_sequences = 0
            if self._batch is not None:
                requests.extend({id(s.request): s.request for s in self._batch.sequences}.values())
                self._batch = None
            if self._swap is not None:
                self._swap.done.set()
                self._swap = None
        for request in requests:
            self._resolve(request, error)

    def _resolve(self, request: _Request, result: GenerationOutput | Exception) -> None:
        def settle() -> None:
            if request.future.done():
                return
            if isinstance(result, Exception):
                request.future.set_exception(result)
            else:
                request.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            request.loop.call_soon_threadsafe(settle)

    # ------------------------------------------------------------------ prefill / decode

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        out = self._model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits

    def _admit(self, requests: list[_Request]) -> None:
        """Prefill the new requests' prompts (past cached prefixes) and merge them into the running batch."""
        now = time.perf_counter()
        rows: list[_Prefill] = []
        for request in requests:
            request.admitted = now
            request.version = self._version
            self.metrics.queue_wait.observe(now - request.enqueued)
            stop_ids = frozenset(request.params.stop_token_ids) | (
                frozenset() if request.params.ignore_eos else self.eos_token_ids
            )
            sequences = [_Sequence(request, i, stop_ids, self.device) for i in range(request.params.n)]
            rows.append(_Prefill(request.prompt_ids, sequences, request))
        prompt_tokens = sum(len(row.ids) for row in rows)
        self.stats.requests += len(requests)
        self.stats.sequences += sum(len(row.sequences) for row in rows)
        self.stats.prompt_tokens += prompt_tokens
        self.metrics.prompt_tokens.inc(prompt_tokens)
        if self._caching:
            self._look_up(rows)
            if self._share_prefixes(rows):
                self._look_up(rows)
            self._count_hits(rows)
        groups = _prefill_groups(rows) if self._growable else [rows]
        batches = [batch for batch in map(self._prefill, groups) if batch is not None]
        if self._batch is not None:
            batches.insert(0, self._batch)
        self._batch = self._merge(batches)
        self._retire_finished()
        self._sync_prefix_metrics()

    def _look_up(self, rows: list[_Prefill]) -> None:
        for row in rows:
            # At least the last prompt token is prefilled: its logits sample the first token.
            row.entry, row.cached = self._prefix.lookup(row.ids, len(row.ids) - 1, self._version)

    def _count_hits(self, rows: list[_Prefill]) -> None:
        hits = [row.cached for row in rows if row.cached]
        self.stats.prefix_lookups += len(rows)
        self.stats.prefix_hits += len(hits)
        self.stats.prefix_hit_tokens += sum(hits)
        self.metrics.prefix_cache_lookups.inc(len(rows))
        self.metrics.prefix_cache_hits.inc(len(hits))
        self.metrics.prefix_cache_hit_tokens.inc(sum(hits))
        if self.stats.prompt_tokens:
            self.metrics.prefix_cache_hit_ratio.set(self.stats.prefix_hit_tokens / self.stats.prompt_tokens)

    def _share_prefixes(self, rows: list[_Prefill]) -> bool:
        """Prefill once (and store) each prompt prefix that several of `rows` share beyond their cache hits, at
        block granularity, when that saves more than a forward pass costs; True when it did (look up again)."""
        if len(rows) < 2:
            return False
        size = self._prefix.block_size
        chains = [block_keys(row.ids, size, len(row.ids) - 1) for row in rows]
        counts: dict[int, int] = {}
        for chain in chains:
            for key in chain:
                counts[key] = counts.get(key, 0) + 1
        shared: dict[int, tuple[int, int]] = {}  # last block key of a shared prefix -> (a row with it, blocks)
        saved = 0
        for index, (row, chain) in enumerate(zip(rows, chains, strict=True)):
            depth = 0
            while depth < len(chain) and counts[chain[depth]] > 1:
                depth += 1
            if depth * size >= row.cached + size:
                shared.setdefault(chain[depth - 1], (index, depth))
                saved += depth * size - row.cached
        # A shared prefix that starts a longer shared prefix is served by the longer one's entry.
        inner = {key for index, depth in shared.values() for key in chains[index][: depth - 1]}
        jobs: list[_Prefill] = []
        for key, (index, depth) in shared.items():
            if key in inner:
                continue
            ids = rows[index].ids
            # Past the last shared block, up to where the rows sharing it part (or the shortest one ends).
            length = len(ids) - 1
            for other, chain in zip(rows, chains, strict=True):
                if len(chain) >= depth and chain[depth - 1] == key:
                    length = common_prefix(ids, other.ids, depth * size, min(length, len(other.ids) - 1))
            jobs.append(_Prefill(ids[:length], [], None, rows[index].entry, rows[index].cached))
        cost = sum(job.suffix for job in jobs) + _PREFILL_OVERHEAD_TOKENS
        if saved - cost < _PREFILL_OVERHEAD_TOKENS:
            return False
        for group in _prefill_groups(jobs):
            self._prefill(group)
        self.stats.shared_prefills += len(jobs)
        return True

    def _prefill(self, group: list[_Prefill]) -> _Batch | None:
        """One forward pass over the rows' uncached ids. Stores each row's KV in the prefix cache; returns the
        rows' sequences as a batch (None when the rows have none)."""
        rows = len(group)
        width = max(row.suffix for row in group)
        cached = max(row.cached for row in group)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((rows, cached + width), dtype=torch.long)
        for r, row in enumerate(group):
            input_ids[r, width - row.suffix :] = torch.tensor(row.ids[row.cached :], dtype=torch.long)
            mask[r, cached - row.cached : cached] = 1
            mask[r, cached + width - row.suffix :] = 1
        input_ids = input_ids.to(self.device)
        mask = mask.to(self.device)
        # Position ids count each row's real tokens: its cached prefix keeps positions 0..cached-1.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, cached:]
        cache = self._new_cache(group, cached, width)
        logits = self._forward(input_ids, mask, positions, cache)
        computed = sum(row.suffix for row in group)
        self.stats.prefill_batches += 1
        self.stats.prefill_rows += rows
        self.stats.prefill_tokens += computed
        self.metrics.forward_batches.labels("prefill").inc()
        self.metrics.batch_size.labels("prefill").observe(rows)
        self.metrics.prefill_tokens.inc(computed)
        if self._caching:
            for r, row in enumerate(group):
                self._store(row.ids, cache, mask, r)
        sequences = [seq for row in group for seq in row.sequences]
        if not sequences:
            return None
        lengths = mask.sum(-1)
        counts = [len(row.sequences) for row in group]
        if any(count != 1 for count in counts):  # a request's n samples shared its row: one row each now
            index = torch.repeat_interleave(
                torch.arange(rows, device=mask.device), torch.tensor(counts, device=mask.device)
            )
            _select_rows(cache, index)
            mask, lengths, logits = mask.index_select(0, index), lengths.index_select(0, index), logits[index]
        next_tokens = self._sample(sequences, logits)
        return _Batch(sequences=sequences, cache=cache, mask=mask, lengths=lengths, next_tokens=next_tokens)

    def _new_cache(self, group: list[_Prefill], cached: int, width: int) -> Any:
        """A cache for a prefill of `width` new columns after `cached` columns of the rows' cached prefixes
        (each right-aligned, zeros before it)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self._model.config)
        if not self._growable:
            return cache
        entries = [row.entry for row in group if row.entry is not None]
        for i in range(len(cache.layers)):
            if not cached or not entries:
                cache.layers[i] = GrowingLayer()
                continue
            like_keys, like_values = entries[0].keys[i], entries[0].values[i]
            capacity = cached + width + spare_columns(cached + width)
            keys = like_keys.new_zeros((len(group), like_keys.shape[0], capacity, like_keys.shape[2]))
            values = like_values.new_zeros((len(group), like_values.shape[0], capacity, like_values.shape[2]))
            for r, row in enumerate(group):
                if row.entry is not None and row.cached:
                    keys[r, :, cached - row.cached : cached].copy_(row.entry.keys[i][:, : row.cached])
                    values[r, :, cached - row.cached : cached].copy_(row.entry.values[i][:, : row.cached])
            cache.layers[i] = GrowingLayer.from_buffers(keys, values, cached)
        return cache

    def _store(self, ids: list[int], cache: Any, mask: torch.Tensor, row: int) -> None:
        """Put the KV of `ids` (row `row` of `cache`, at the columns where `mask` is 1) in the prefix cache."""

        def kv() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            columns = mask[row].nonzero().squeeze(1)
            assert columns.numel() == len(ids)
            pairs = [layer.row(row, columns) for layer in cache.layers]
            return [k for k, _ in pairs], [v for _, v in pairs]

        self._prefix.insert(ids, self._version, kv)

    def _store_sequence(self, batch: _Batch, row: int, seq: _Sequence) -> None:
        """Cache a leaving sequence's KV: its prompt and sampled ids but the last (never fed to the model)."""
        request = seq.request
        ids = request.prompt_ids + seq.token_ids[:-1]
        if request.version == self._version and int(batch.lengths[row]) == len(ids):
            self._store(ids, batch.cache, batch.mask, row)

    def _sync_prefix_metrics(self) -> None:
        evicted, superseded = self._prefix.evicted, self._prefix.superseded
        seen_evicted, seen_superseded = self._prefix_seen
        if evicted > seen_evicted:
            self.metrics.prefix_cache_evictions.labels("capacity").inc(evicted - seen_evicted)
        if superseded > seen_superseded:
            self.metrics.prefix_cache_evictions.labels("superseded").inc(superseded - seen_superseded)
        self._prefix_seen = (evicted, superseded)
        self.metrics.prefix_cache_tokens.set(self._prefix.tokens)
        self.metrics.prefix_cache_entries.set(len(self._prefix))

    def _merge(self, batches: list[_Batch]) -> _Batch:
        """One batch from several: the others' rows are copied into the first's free rows, each cache
        left-padded (masked) to the longest one."""
        if len(batches) == 1:
            return batches[0]
        width = max(batch.mask.shape[1] for batch in batches)
        cache = batches[0].cache
        for i, layer in enumerate(cache.layers):
            for batch in batches[1:]:
                layer.append_rows(batch.cache.layers[i], max_rows=self.max_batch_size)
        return _Batch(
            sequences=[seq for batch in batches for seq in batch.sequences],
            cache=cache,
            mask=torch.cat([F.pad(batch.mask, (width - batch.mask.shape[1], 0)) for batch in batches]),
            lengths=torch.cat([batch.lengths for batch in batches]),
            next_tokens=torch.cat([batch.next_tokens for batch in batches]),
        )

    def _decode_step(self) -> None:
        batch = self._batch
        assert batch is not None
        rows = len(batch.sequences)
        self.stats.max_running = max(self.stats.max_running, rows)
        self.metrics.running.set(rows)
        ones = torch.ones((rows, 1), dtype=batch.mask.dtype, device=batch.mask.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        logits = self._forward(batch.next_tokens[:, None], batch.mask, batch.lengths[:, None], batch.cache)
        batch.lengths = batch.lengths + 1
        self.stats.decode_steps += 1
        self.stats.decode_rows += rows
        self._decode_batches.inc()
        self._decode_sizes.observe(rows)
        batch.next_tokens = self._sample(batch.sequences, logits)
        self._retire_finished()

    def _sample(self, sequences: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Pick each sequence's next token, record it with its raw logprob, and check the stop conditions."""
        logprobs = torch.log_softmax(logits, dim=-1)
        sampled_rows = [row for row, s in enumerate(sequences) if s.params.temperature > 0]
        if len(sampled_rows) == len(sequences):  # no greedy row: no argmax, no row gather / scatter
            chosen = sample_tokens(
                logits,
                [s.params.temperature for s in sequences],
                [s.params.top_p for s in sequences],
                [s.generator for s in sequences],
            )
        else:
            chosen = torch.argmax(logits, dim=-1)
            if sampled_rows:
                index = torch.tensor(sampled_rows, device=logits.device)
                chosen[index] = sample_tokens(
                    logits.index_select(0, index),
                    [sequences[row].params.temperature for row in sampled_rows],
                    [sequences[row].params.top_p for row in sampled_rows],
                    [sequences[row].generator for row in sampled_rows],
                )
        chosen_lp = logprobs.gather(1, chosen[:, None])[:, 0]
        tokens = chosen.tolist()
        token_lps = chosen_lp.tolist()
        k = max((s.params.top_logprobs for s in sequences), default=0)
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if k:
            top = torch.topk(logprobs, k, dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for row, seq in enumerate(sequences):
            if seq.finish_reason is not None:
                continue
            token = int(tokens[row])
            seq.token_ids.append(token)
            seq.logprobs.append(float(token_lps[row]))
            if seq.top is not None:
                n_top = seq.params.top_logprobs
                entry = dict(zip(top_ids[row][:n_top], top_values[row][:n_top], strict=True))
                entry[token] = float(token_lps[row])
                seq.top.append(entry)
            self._advance_text(seq, token)
        self.stats.generated_tokens += len(sequences)
        self.metrics.generated_tokens.inc(len(sequences))
        return chosen

    def _advance_text(self, seq: _Sequence, token: int) -> None:
        chunk = seq.decoder.step(self._backend_tokenizer, token)
        if chunk:
            searched_from = max(0, len(seq.text) - seq.max_stop_len + 1)
            seq.text += chunk
            if seq.params.stop:
                hits = [(seq.text.find(s, searched_from), s) for s in seq.params.stop]
                found = [(pos, s) for pos, s in hits if pos >= 0]
                if found:
                    pos, stop = min(found)
                    seq.text = seq.text[:pos]
                    seq.finish_reason = FINISH_STOP
                    seq.stop_reason = stop
                    return
        if token in seq.stop_ids:
            seq.finish_reason = FINISH_STOP
            # vLLM's convention: the id for a requested stop token, None for the model's EOS.
            seq.stop_reason = token if token in seq.params.stop_token_ids else None
            return
        if len(seq.token_ids) >= seq.params.max_tokens:
            seq.finish_reason = FINISH_LENGTH

    def _retire_finished(self) -> None:
        """Hand finished (or cancelled) sequences back, cache their KV, and drop their rows from the batch."""
        batch = self._batch
        assert batch is not None
        keep: list[int] = []
        completed: list[_Request] = []
        for row, seq in enumerate(batch.sequences):
            cancelled = seq.request.cancelled()
            if seq.finish_reason is None and not cancelled:
                keep.append(row)
                continue
            if self._caching:
                self._store_sequence(batch, row, seq)
            if cancelled:
                continue
            request = seq.request
            request.samples[seq.index] = seq.output()
            request.remaining -= 1
            if request.remaining == 0:
                completed.append(request)
        if len(keep) == len(batch.sequences):
            return
        self._sync_prefix_metrics()
        for request in completed:
            self._complete(request)
        if not keep:
            self._batch = None
            self.metrics.running.set(0)
            return
        # The last remaining rows move into the leavers' places: only they are copied.
        order, gaps, moved = compaction(keep, len(batch.sequences))
        index = torch.tensor(order, device=batch.mask.device)
        mask = batch.mask.index_select(0, index)
        # Columns that are padding in every remaining row are dead weight: trim them.
        first_real = int(torch.argmax((mask.sum(0) > 0).to(torch.int8)).item())
        for layer in batch.cache.layers:
            if isinstance(layer, GrowingLayer):
                layer.move_rows(gaps, moved, len(order))
                layer.drop_leading(first_real)
            else:
                layer.keys = layer.keys.index_select(0, index)[:, :, first_real:, :]
                layer.values = layer.values.index_select(0, index)[:, :, first_real:, :]
        batch.mask = mask[:, first_real:]
        batch.sequences = [batch.sequences[row] for row in order]
        batch.lengths = batch.lengths.index_select(0, index)
        batch.next_tokens = batch.next_tokens.index_select(0, index)

    def _complete(self, request: _Request) -> None:
        elapsed = time.perf_counter() - request.admitted
        self.metrics.generation_time.observe(elapsed)
        samples = [s for s in request.samples if s is not None]
        output = GenerationOutput(
            samples=samples,
            prompt_tokens=len(request.prompt_ids),
            policy_version=request.version,
            queue_seconds=request.admitted - request.enqueued,
            generation_seconds=elapsed,
        )
        self._resolve(request, output)


def _growable_cache(model: Any) -> bool:
    """Whether the model's KV cache is plain full-attention `DynamicLayer`s: the running batch then uses
    `GrowingLayer`s, merges newly admitted requests, and the prefix cache can serve it."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _kv_bytes_per_token(model: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in the KV cache (all layers)."""
    config = model.config.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    element = torch.empty((), dtype=dtype).element_size()
    return max(1, 2 * int(config.num_hidden_layers) * kv_heads * head_dim * element)


def _select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep `rows` of every cache layer (in that order, repeats allowed)."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.select(rows)
        else:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


def _prefill_groups(rows: list[_Prefill], overhead: int = _PREFILL_OVERHEAD_TOKENS) -> list[list[_Prefill]]:
    """Split prefill rows into forward passes: rows sorted by uncached length, cut where that minimises the
    estimated cost, `overhead` per pass + rows x longest uncached length (padding is computed too)."""
    order = sorted(rows, key=lambda row: row.suffix, reverse=True)
    count = len(order)
    best = [0.0] + [math.inf] * count
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        for start in range(end):
            cost = best[start] + overhead + (end - start) * order[start].suffix
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups: list[list[_Prefill]] = []
    end = count
    while end:
        groups.append(order[cut[end] : end])
        end = cut[end]
    groups.reverse()
    return groups


def sample_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), restricted to the row's top-p nucleus.

    Inverse-CDF sampling with one uniform draw from each row's own generator: the distribution of
    `torch.multinomial`, at a fraction of the cost of one multinomial call per row. Rows with top-p 1
    walk the CDF in vocabulary order; the others walk their nucleus, most likely token first.
    """
    scaled = logits
    if any(t != 1.0 for t in temperatures):  # x / 1 == x: skip a full-vocabulary pass in the common case
        temps = torch.tensor(temperatures, device=logits.device, dtype=logits.dtype).unsqueeze(1)
        scaled = logits / temps
    uniforms = torch.stack([torch.rand((), generator=g, device=logits.device) for g in generators])
    top_p = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
    truncated = top_p < 1
    if not bool(truncated.any()):
        return _inverse_cdf(torch.softmax(scaled, dim=-1), uniforms)
    if bool(truncated.all()):
        return _sample_nucleus(scaled, top_p, uniforms)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    whole, rows = torch.nonzero(~truncated).flatten(), torch.nonzero(truncated).flatten()
    tokens[whole] = _inverse_cdf(torch.softmax(scaled[whole], dim=-1), uniforms[whole])
    tokens[rows] = _sample_nucleus(scaled[rows], top_p[rows], uniforms[rows])
    return tokens


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the column where the running sum of ``probs`` first exceeds ``uniform`` x the row's total."""
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


NUCLEUS_WIDTHS = (64, 1024)
"""Candidates a row's nucleus is looked for among (`torch.topk`), in turn, before its whole vocabulary is sorted."""


def _sample_nucleus(
    scaled: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor, widths: Sequence[int] = NUCLEUS_WIDTHS
) -> torch.Tensor:
    """One token per row from its top-p nucleus, looked for among the first of ``widths`` candidates, the rows whose
    nucleus is wider among the next, and so on; past the last, the whole vocabulary is sorted. A policy's nucleus
    is a few tokens, and a top-k costs a fraction of a full sort at every decode step."""
    vocabulary = scaled.shape[-1]
    width = min(widths[0], vocabulary) if widths else vocabulary
    probs, ids, inside = _nucleus(scaled, top_p, width)
    tokens = ids.gather(1, _inverse_cdf(probs, uniforms).unsqueeze(1)).squeeze(1)
    if bool(inside.all()):
        return tokens
    rows = torch.nonzero(~inside).flatten()
    # Every token past the candidates is at most as likely as the last one (all candidates are kept in these rows):
    # a wider set of candidates that cannot reach top_p even so is not worth a top-k.
    held, smallest = probs[rows].sum(dim=-1), probs[rows, -1]
    wider = [w for w in widths[1:] if bool((held + (w - width) * smallest >= top_p[rows]).any())]
    tokens[rows] = _sample_nucleus(scaled[rows], top_p[rows], uniforms[rows], wider)
    return tokens


def _nucleus(scaled: torch.Tensor, top_p: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Among each row's ``width`` most likely tokens: its top-p nucleus and whether the nucleus lies inside them.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``. Returns the
    candidates' probabilities (most likely first, 0 past the nucleus), their token ids, and per row whether the
    candidates hold ``top_p`` of the mass: then the nucleus is inside them, exactly.
    """
    if width >= scaled.shape[-1]:
        top_logits, ids = torch.sort(scaled, dim=-1, descending=True)
    else:
        top_logits, ids = scaled.topk(width, dim=-1)
    probs = torch.exp(top_logits - torch.logsumexp(scaled, dim=-1, keepdim=True))
    through = probs.cumsum(dim=-1)
    keep = through - probs < top_p.unsqueeze(1)  # the mass of the strictly more likely tokens is short of top_p
    keep[:, 0] = True
    inside = (through[:, -1] >= top_p) | (width >= scaled.shape[-1])
    return probs * keep, ids, inside
