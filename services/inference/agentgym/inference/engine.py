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

Logprobs: `logprobs[i]` is log p(token_i | context) under the model's unmodified distribution
(log_softmax of the raw logits: temperature 1, no top-p) — the policy likelihood the trainer recomputes
with a plain forward pass, and what vLLM reports with `--logprobs-mode raw_logprobs`. The distribution the
token was drawn from (temperature/top-p applied) is not what PPO's importance ratio compares against, so
it is not reported.

Weight updates (`load_weights`) load into a new model object off the worker thread; the worker stops
admitting new sequences, lets the running ones finish on the old weights, then swaps the model between
steps. Requests still queued at that moment run on the new weights. Every result carries the
`policy_version` of the weights that produced it.

Forward passes of Llama-shaped models (Llama, SmolLM2, Qwen2) run through `decoder.LeanDecoder`, the same
function as transformers' forward in far fewer Python steps (about half a small model's decode step was
framework overhead); other models use transformers' forward. `dtype="bfloat16"` on a CPU with bf16 units (AVX512-BF16
or AMX) runs the lean pass's matmuls in bf16 over float32 parameters, norms and logits, as the trainer's bf16
autocast does; on other CPUs, and for `float32`, everything is float32.

Modules: `decoder` (the lean forward pass), `batching` (requests, sequences, the running batch and its
bookkeeping), `sampling` (sampling parameters, the token sampler), `weights` (loading models and new weights),
`kv` (the growing KV cache layers), `prefix_cache`, `errors`. This one is the `Engine` facade and its
worker-thread loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agentgym.allocator import retain_freed_memory
from agentgym.cpus import available_cpus
from agentgym.inference.batching import (
    _PREFILL_OVERHEAD_TOKENS,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    SampleOutput,
    _Batch,
    _Prefill,
    _prefill_groups,
    _Request,
    _select_rows,
    _Sequence,
    _Swap,
    keep_rows,
    merge_batches,
    new_cache,
    prefill_inputs,
    sample_next,
    shared_prefix_jobs,
    shared_prefixes,
)
from agentgym.inference.decoder import ForwardHelper, LeanDecoder, SharedPrefixes
from agentgym.inference.errors import (
    EngineClosedError,
    EngineError,
    InvalidRequestError,
    StaleVersionError,
    WeightLoadError,
)
from agentgym.inference.metrics import EngineStats, InferenceMetrics
from agentgym.inference.models import ModelError, load_tokenizer, resolve_model
from agentgym.inference.prefix_cache import BLOCK_SIZE, PrefixCache
from agentgym.inference.sampling import (
    SamplingParams,
    SliceWeights,
    _nucleus,
    check_request,
    sample_tokens,
    walks_the_cdf,
)
from agentgym.inference.weights import (
    cache_argument,
    cpu_matmul_dtype,
    eos_ids,
    growable_cache,
    kv_bytes_per_token,
    load_candidate,
    load_model,
    pick_device,
    pick_dtype,
)

log = logging.getLogger(__name__)

LEAN_DECODER_VARIABLE = "AGENTGYM_LEAN_DECODER"
"""Set to 0 to run every forward pass through transformers' own forward (the lean one is on by default)."""


def lean_decoder(
    model: Any, growable: bool, matmul_dtype: torch.dtype | None = None, forward_helper: ForwardHelper | None = None
) -> LeanDecoder | None:
    """The lean forward pass for `model` (`decoder.LeanDecoder`, its matmuls in `matmul_dtype` when given, its large
    operations shared with `forward_helper`) when its shape has one and its KV cache is the engine's growing
    layers; None to use transformers' forward."""
    if not growable or os.environ.get(LEAN_DECODER_VARIABLE, "1") == "0":
        return None
    return LeanDecoder.for_model(model, matmul_dtype, forward_helper)


CASCADE_ATTENTION_VARIABLE = "AGENTGYM_CASCADE_ATTENTION"
"""Set to 0 to have every decode step attend each row's whole cache, shared prefixes included (read once for the
rows that share them by default: `batching.shared_prefixes`, `decoder.cascade_attention`)."""


def wants_forward_helper(device: torch.device) -> bool:
    """Whether an engine shares its forward pass's large operations (the LM head, projections, attention) with a
    `decoder.ForwardHelper` thread: on CPU with one intra-op thread and a core beside it (2 cores: the engine's
    default of the usable cores but one). With more intra-op threads each operation is already a parallel one, and
    a helper would add a second team of them."""
    return device.type == "cpu" and torch.get_num_threads() == 1 and available_cpus() >= 2


DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
"""Without `prefix_cache_tokens`, the prefix cache holds as many tokens as 1 GiB of KV: 262,144 tokens of the
tiny model (4 KiB each), 23,301 of SmolLM2-135M (45 KiB each)."""

# The engine's public names (and the internals its tests reach), wherever they are defined now.
__all__ = [
    "DEFAULT_PREFIX_CACHE_BYTES",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "_PREFILL_OVERHEAD_TOKENS",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "EngineStats",
    "GenerationOutput",
    "InvalidRequestError",
    "SampleOutput",
    "SamplingParams",
    "StaleVersionError",
    "WeightLoadError",
    "_Prefill",
    "_nucleus",
    "_prefill_groups",
    "sample_tokens",
]


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
        self.matmul_dtype = cpu_matmul_dtype(self.device, dtype)
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_ms / 1000.0
        self.metrics = metrics or InferenceMetrics()
        self.stats = EngineStats()
        self.tokenizer = load_tokenizer(self.model_dir)
        self._backend_tokenizer = self.tokenizer.backend_tokenizer
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.metrics.torch_threads.set(torch.get_num_threads())
        if self.device.type == "cpu":
            retain_freed_memory()  # the [batch, vocab] logits of every decode step reuse freed buffers
        self._model = load_model(self.model_dir, self.device, self.dtype)
        self._cache_kw = cache_argument(self._model)
        self.vocab_size = int(self._model.config.vocab_size)
        positions = int(getattr(self._model.config, "max_position_embeddings", 0) or 0) or 1 << 30
        self.max_model_len = min(max_model_len, positions) if max_model_len else positions
        self.eos_token_ids = eos_ids(self._model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else min(self.eos_token_ids, default=0))
        self._version = policy_version
        self.metrics.policy_version.set(policy_version)
        self._growable = growable_cache(self._model)
        self._forward_helper = ForwardHelper() if wants_forward_helper(self.device) else None
        self._lean = lean_decoder(self._model, self._growable, self.matmul_dtype, self._forward_helper)
        if self._forward_helper is not None and self._lean is None:
            # Nothing to share (transformers' forward): no idle thread. A weight swap keeps the architecture, so it
            # would have nothing to share either.
            self._forward_helper.close()
            self._forward_helper = None
        if self._lean is None and self.matmul_dtype is not None:
            log.warning("bf16 matmuls need the lean forward pass (a Llama-shaped model): computing in float32")
            self.matmul_dtype = None
        if dtype == "bfloat16" and self.device.type == "cpu":
            log.info(
                "bfloat16 on CPU: %s",
                "bf16 matmuls over float32 parameters, norms and logits"
                if self.matmul_dtype is not None
                else "float32 (bf16 runs only on a CPU with bf16 units, AVX512-BF16 or AMX, with a Llama-shaped model)",
            )
        if prefix_cache_tokens is None:
            kv_dtype = self._lean.kv_dtype if self._lean is not None else self.dtype
            prefix_cache_tokens = DEFAULT_PREFIX_CACHE_BYTES // kv_bytes_per_token(self._model, kv_dtype)
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
        self._admitting: list[_Request] = []
        """Requests taken from the queue and being prefilled: in neither the queue nor the batch until merged."""
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
        """The model object serving now (replaced, never modified, by a weight swap). With packed bf16 matrices
        (`decoder._pack`) its projections are on the meta device: the lean forward holds the only copy."""
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
        check_request(prompt_ids, params, self.vocab_size, self.max_model_len, self.max_batch_size)

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
        if self._forward_helper is not None:
            self._forward_helper.close()

    # ------------------------------------------------------------------ weight loading

    def _load_candidate(self, uri: str) -> Any:
        """A new model object holding the weights at `uri` (checked before it can be swapped in)."""
        return load_candidate(uri, self._model.config, self.vocab_size, self.pad_token_id, self.device, self.dtype)

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
                self._admitting = admitted
                self._admit(admitted)
                self._admitting = []
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

    @property
    def _cascade(self) -> bool:
        """Whether decode steps read shared prefixes once (the lean forward on CPU: torch's CPU flash kernel)."""
        return (
            self._lean is not None
            and self.device.type == "cpu"
            and os.environ.get(CASCADE_ATTENTION_VARIABLE, "1") != "0"
        )

    def _apply_swap(self) -> None:
        swap = self._swap
        assert swap is not None
        old = self._model
        self._model = swap.model
        self._cache_kw = cache_argument(self._model)
        self._version = swap.version
        self.eos_token_ids = eos_ids(self._model, self.tokenizer)
        self._growable = growable_cache(self._model)
        self._lean = lean_decoder(self._model, self._growable, self.matmul_dtype, self._forward_helper)
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
            requests.extend(self._admitting)  # a crash while prefilling them: they are in neither
            self._admitting = []
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
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        shared: SharedPrefixes | None = None,
        slice_weights: bool = False,
    ) -> tuple[torch.Tensor, SliceWeights | None]:
        """The logits at each row's last position; with `slice_weights`, also their sampling weights where the
        lean forward computes them with a sliced head (`LeanDecoder.forward_sampling`)."""
        if self._lean is not None:
            return self._lean.forward_sampling(input_ids, mask, positions, cache, shared, slice_weights)
        out = self._model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits, None

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
        for row in rows:
            if row.request is not None:
                row.request.cached_tokens = row.cached
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
        jobs = shared_prefix_jobs(rows, self._prefix.block_size)
        if jobs is None:
            return False
        for group in _prefill_groups(jobs):
            self._prefill(group)
        self.stats.shared_prefills += len(jobs)
        return True

    def _prefill(self, group: list[_Prefill]) -> _Batch | None:
        """One forward pass over the rows' uncached ids. Stores each row's KV in the prefix cache; returns the
        rows' sequences as a batch (None when the rows have none)."""
        rows = len(group)
        input_ids, mask, positions, cached, width = prefill_inputs(group, self.pad_token_id, self.device)
        cache = self._new_cache(group, cached, width)
        logits, _ = self._forward(input_ids, mask, positions, cache)
        computed = sum(row.suffix for row in group)
        self.stats.prefill_batches += 1
        self.stats.prefill_rows += rows
        self.stats.prefill_tokens += computed
        self.metrics.forward_batches.labels("prefill").inc()
        self.metrics.batch_size.labels("prefill").observe(rows)
        self.metrics.prefill_tokens.inc(computed)
        if self._caching:
            for r, row in enumerate(group):
                # Room for what the row's sequences may sample: storing the finished context then writes only that.
                room = row.request.params.max_tokens - 1 if row.request is not None else 0
                self._store(row.ids, cache, mask, r, room)
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
        return new_cache(self._model.config, self._growable, group, cached, width)

    def _store(self, ids: list[int], cache: Any, mask: torch.Tensor, row: int, room: int = 0) -> None:
        """Put the KV of `ids` (row `row` of `cache`, at the columns where `mask` is 1) in the prefix cache, with
        `room` for more tokens (`PrefixCache.insert`)."""

        def kv(start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            columns = mask[row].nonzero().squeeze(1)
            assert columns.numel() == len(ids)
            wanted: torch.Tensor | slice = columns[start:]
            count = len(ids) - start
            if count and int(columns[-1]) - int(columns[start]) == count - 1:  # consecutive: views, no gather
                wanted = slice(int(columns[start]), int(columns[-1]) + 1)
            pairs = [layer.row(row, wanted) for layer in cache.layers]
            return [k for k, _ in pairs], [v for _, v in pairs]

        self._prefix.insert(ids, self._version, kv, room)

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
        return merge_batches(batches, self.max_batch_size)

    def _decode_step(self) -> None:
        batch = self._batch
        assert batch is not None
        rows = len(batch.sequences)
        self.stats.max_running = max(self.stats.max_running, rows)
        self.metrics.running.set(rows)
        if not batch.shared_current:  # the rows changed: find what they share again
            batch.shared = shared_prefixes(batch.sequences, batch.mask) if self._cascade else None
            batch.shared_current = True
        ones = torch.ones((rows, 1), dtype=batch.mask.dtype, device=batch.mask.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        # Every row sampling at temperature 1 without a nucleus (a rollout's requests): the weights come with the
        # logits, slice by slice, where the head is sliced (`sampling.SliceWeights`).
        params = [s.params for s in batch.sequences]
        slice_weights = walks_the_cdf([p.temperature for p in params], [p.top_p for p in params])
        logits, weights = self._forward(
            batch.next_tokens[:, None], batch.mask, batch.lengths[:, None], batch.cache, batch.shared, slice_weights
        )
        batch.lengths = batch.lengths + 1
        self.stats.decode_steps += 1
        self.stats.decode_rows += rows
        self._decode_batches.inc()
        self._decode_sizes.observe(rows)
        batch.next_tokens = self._sample(batch.sequences, logits, weights)
        self._retire_finished()

    def _sample(
        self, sequences: list[_Sequence], logits: torch.Tensor, slices: SliceWeights | None = None
    ) -> torch.Tensor:
        chosen = sample_next(sequences, logits, self._backend_tokenizer, slices)
        self.stats.generated_tokens += len(sequences)
        self.metrics.generated_tokens.inc(len(sequences))
        return chosen

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
        keep_rows(batch, keep)

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
            cached_prompt_tokens=request.cached_tokens,
        )
        self._resolve(request, output)
