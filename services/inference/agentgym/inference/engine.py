"""The platform's HF-transformers generation engine (CPU, or GPU when available) with dynamic batching.

One worker thread owns the model and runs a continuous-batching loop:

- Requests are queued (a request with `n` samples becomes `n` sequences). When nothing is running, the worker
  waits up to `batch_window_ms` for more arrivals (or until `max_batch_size` sequences are queued), then
  prefills them together: prompts left-padded to one length, one forward pass, KV cache kept.
- Every decode step feeds the last sampled token of every running sequence in one forward pass.
- Between decode steps, queued requests join the running batch (their prompts are prefilled together and
  their KV caches merged into the running one, left-padded to a common length) while there are free slots,
  and finished sequences leave it (their cache rows are dropped, and fully padded columns trimmed).

A sequence stops on EOS (unless `ignore_eos`), on one of `stop_token_ids`, on a stop string, or after
`max_tokens`. Stop strings are found in text decoded incrementally from the sampled ids (a `DecodeStream`),
never by re-encoding text. The returned `token_ids` are exactly the sampled ids, including the EOS / stop
token or the token that completed a stop string (only `text` is cut before the stop string).

Sampling: `temperature` 0 is greedy; otherwise the logits are divided by the temperature, nucleus-filtered
with `top_p`, and sampled with a per-sequence `torch.Generator` (seeded from the request's `seed` and the
sample index, so a seeded request is reproducible when its batch composition is the same).

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

from agentgym.inference.metrics import InferenceMetrics
from agentgym.inference.models import ModelError, load_tokenizer, resolve_model

log = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
MAX_TOP_LOGPROBS = 20


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
    ) -> None:
        """`num_threads` sets torch's (process-wide) CPU thread count; on a shared or small machine 1 is often
        faster than oversubscribed OpenMP threads."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if batch_window_ms < 0:
            raise ValueError("batch_window_ms must be >= 0")
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
        from transformers.cache_utils import DynamicLayer

        batch = self._batch
        return batch is None or all(type(layer) is DynamicLayer for layer in batch.cache.layers)

    def _apply_swap(self) -> None:
        swap = self._swap
        assert swap is not None
        old = self._model
        self._model = swap.model
        self._cache_kw = _cache_argument(self._model)
        self._version = swap.version
        self.eos_token_ids = _eos_ids(self._model, self.tokenizer)
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
        """Prefill the new requests' sequences together and merge them into the running batch."""
        from transformers import DynamicCache

        now = time.perf_counter()
        sequences: list[_Sequence] = []
        for request in requests:
            request.admitted = now
            request.version = self._version
            self.metrics.queue_wait.observe(now - request.enqueued)
            stop_ids = frozenset(request.params.stop_token_ids) | (
                frozenset() if request.params.ignore_eos else self.eos_token_ids
            )
            sequences.extend(_Sequence(request, i, stop_ids, self.device) for i in range(request.params.n))
        prompts = [s.request.prompt_ids for s in sequences]
        width = max(len(p) for p in prompts)
        rows = len(prompts)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        input_ids = input_ids.to(self.device)
        mask = mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self._model.config)
        logits = self._forward(input_ids, mask, positions, cache)
        self.stats.requests += len(requests)
        self.stats.sequences += rows
        self.stats.prefill_batches += 1
        self.stats.prefill_rows += rows
        self.metrics.forward_batches.labels("prefill").inc()
        self.metrics.batch_size.labels("prefill").observe(rows)
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_ids) for r in requests))
        lengths = mask.sum(-1)
        next_tokens = self._sample(sequences, logits)
        new = _Batch(sequences=sequences, cache=cache, mask=mask, lengths=lengths, next_tokens=next_tokens)
        self._batch = new if self._batch is None else self._merge(self._batch, new)
        self._retire_finished()

    def _merge(self, old: _Batch, new: _Batch) -> _Batch:
        """One batch from two: the shorter cache is left-padded (masked) to the longer one's length."""
        old_len, new_len = old.mask.shape[1], new.mask.shape[1]
        width = max(old_len, new_len)
        for batch, length in ((old, old_len), (new, new_len)):
            pad = width - length
            if pad:
                for layer in batch.cache.layers:
                    layer.keys = F.pad(layer.keys, (0, 0, pad, 0))
                    layer.values = F.pad(layer.values, (0, 0, pad, 0))
                batch.mask = F.pad(batch.mask, (pad, 0))
        for old_layer, new_layer in zip(old.cache.layers, new.cache.layers, strict=True):
            old_layer.keys = torch.cat([old_layer.keys, new_layer.keys], dim=0)
            old_layer.values = torch.cat([old_layer.values, new_layer.values], dim=0)
        return _Batch(
            sequences=old.sequences + new.sequences,
            cache=old.cache,
            mask=torch.cat([old.mask, new.mask], dim=0),
            lengths=torch.cat([old.lengths, new.lengths], dim=0),
            next_tokens=torch.cat([old.next_tokens, new.next_tokens], dim=0),
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
        self.metrics.forward_batches.labels("decode").inc()
        self.metrics.batch_size.labels("decode").observe(rows)
        batch.next_tokens = self._sample(batch.sequences, logits)
        self._retire_finished()

    def _sample(self, sequences: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Pick each sequence's next token, record it with its raw logprob, and check the stop conditions."""
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = torch.argmax(logits, dim=-1)
        sampled_rows = [row for row, s in enumerate(sequences) if s.params.temperature > 0]
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
        """Hand finished (or cancelled) sequences back and drop their rows from the batch."""
        batch = self._batch
        assert batch is not None
        keep: list[int] = []
        for row, seq in enumerate(batch.sequences):
            if seq.request.cancelled():
                continue
            if seq.finish_reason is None:
                keep.append(row)
                continue
            request = seq.request
            request.samples[seq.index] = seq.output()
            request.remaining -= 1
            if request.remaining == 0:
                self._complete(request)
        if len(keep) == len(batch.sequences):
            return
        if not keep:
            self._batch = None
            self.metrics.running.set(0)
            return
        index = torch.tensor(keep, device=batch.mask.device)
        mask = batch.mask.index_select(0, index)
        # Columns that are padding in every remaining row are dead weight: trim them.
        first_real = int(torch.argmax((mask.sum(0) > 0).to(torch.int8)).item())
        for layer in batch.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first_real:, :]
            layer.values = layer.values.index_select(0, index)[:, :, first_real:, :]
        batch.mask = mask[:, first_real:]
        batch.sequences = [batch.sequences[row] for row in keep]
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


def sample_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), restricted to the row's top-p nucleus.

    Inverse-CDF sampling with one uniform draw from each row's own generator: the distribution of
    `torch.multinomial`, at a fraction of the cost of one multinomial call per row.
    """
    temps = torch.tensor(temperatures, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    scaled = logits / temps
    top_p = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
    if bool((top_p < 1).any()):
        scaled = _nucleus(scaled, top_p)
    cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
    uniforms = torch.stack([torch.rand((), generator=g, device=logits.device) for g in generators])
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)


def _nucleus(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` (per row); -inf the rest."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the strictly more likely tokens
    drop_sorted = before >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))
