"""A lean forward pass for Llama-shaped decoders (Llama, SmolLM2, Qwen2): the same weights, far fewer Python steps.

A decode step of a small model on CPU is mostly framework overhead, not arithmetic: transformers' forward runs
each layer through a dozen decorated module calls, builds a 4-D mask through its mask interface, and keeps q, k,
v (and gate, up) as separate matmuls. For the quickstart's 4-layer model that overhead was about half of every
decode step (`benchmarks/rollout_engines_bench.py`). `LeanDecoder` computes the same function directly:

    h = embed(ids)
    for each layer:  x = rms_norm(h);  q, k, v = split(x W_qkv + b_qkv);  q, k = rope(q, k)
                     K, V = cache.update(k, v)                       (the batch's `GrowingLayer`)
                     h = h + softmax(q K^T / sqrt(d) + mask) V W_o
                     x = rms_norm(h);  g, u = split(x W_gate_up);   h = h + (silu(g) * u) W_down
    logits = rms_norm(h)[:, -1] W_lm

with q/k/v and gate/up fused into one matmul each. The fused matrices are the model's own storage: each
projection's weight becomes a view into them, so nothing is duplicated and a weight swap (a new model object)
gets a new `LeanDecoder`. Query rows attend to the key columns their 2-D mask allows that are not in their
future (left-padded rows, prefix-cache hits: keys of earlier turns precede the new tokens), and always to their
own column, so a padding query is finite rather than NaN.

bf16 matmuls (``matmul_dtype=torch.bfloat16``, for a CPU with bf16 units): the projection and LM-head weights are
kept in bf16 and every matmul (attention's too) runs in bf16, while the residual stream, the RMS norms, RoPE and the
logits stay float32: what transformers' forward computes under the trainer's bf16 autocast (the same logits on the
tests' models), so sampled logprobs match the trainer's at least as well as float32 ones do. On the 2-core Xeon
(AMX) a batched SmolLM2 decode step took half the time and prefill 1.5-3x less (`benchmarks/cpu_bf16_bench.py`).
Where oneDNN multiplies bf16 natively, the bf16 matrices are also packed once into its blocked layout
(`_pack`): `F.linear` on a plain bf16 matrix re-lays it out at every call, which at a decode step's few rows
cost as much as the multiplication (a SmolLM2 projection 167 -> 79 us for one row, the LM head 8.9 -> 5.6 ms for
32 rows; bit-identical results). The packed matrices are then the only copy: the model's projections (and an
untied LM head) are left on the meta device, so its own forward fails loudly rather than running on stale storage.
Attention is computed in float32, over a float32 KV cache holding the same bf16-rounded keys and values, where a
decode step's attention (one query a row) is faster so than in torch's bf16 kernel, timed once per shape
(`attention_in_float32`): on a 2-core AVX512-BF16 EPYC (no AMX) that kernel made a bf16 SmolLM2 decode step slower
than a float32 one (156 against 110 ms for 16 rows over 400 keys), 65-68 ms with the bf16 cache upcast at every
step, and the quickstart's rollout step no faster than float32's until the cache itself was float32.

The float32 LM head is multiplied in whichever of two layouts is faster here, timed rather than assumed
(`head_logits`): the plain matrix through `F.linear` (MKL), or a packed copy through oneDNN, made once per weight
load (`_pack_float32`; the same logits summed in another order). On the 2-core AMD EPYC, MKL multiplies the tiny
model's 49,152-row head at 4.5 ms for one row, 10-12 ms for 2-8 rows and 19.9 ms for 32, oneDNN's packed copy at
3.5, 3.1-5.9 and 13.2 ms (SmolLM2's head at 32 rows: 39.5 against 30.5 ms); the layers' small matrices gained
nothing from packing and stay plain. Each row count is timed once per process on its first use (both layouts,
alternately) and the faster one kept; with a helper (below) the head is multiplied by its shared packed slices,
untimed. The packed copy costs the head's size once more in memory (tiny model 50 MB,
SmolLM2 113 MB; a tied head's plain matrix is the embedding and stays either way).

With one intra-op thread on a machine of two or more cores (the engine's default on 2 cores: the usable cores but
one), a `ForwardHelper` thread shares the forward pass's large operations with the engine's thread: the packed head
in `HEAD_CHUNKS` slices of the vocabulary, each projection of enough rows or weights in two halves of its output
columns (`shared_linear`), attention over enough keys in chunks of the batch or, for one row, by key/value head
(`shared_attention`), and the MLP by halves of its intermediate units, gate/up and down in one hand-off
(`shared_mlp`, tensor parallelism's split); packed bf16 matrices, which have no views to halve, by chunks of their
input's rows instead (`_by_rows`: a prefill's projections and MLPs, and a larger model's batched decode MLP; the
quickstart turn's prefill of 1,952 rows 23.0 -> 8.6 ms an MLP). Each thread takes the next part until none is left,
with no barrier: a helper descheduled by a busy neighbour delays an operation by one part at most, where an OpenMP
team of two would wait for its whole half. Every part is computed by the same kernel as the whole (the same values,
up to the kernels' blocking; equal on the tests' shapes; the MLP's two partial outputs are summed, the same up to
rounding). On the EPYC: the tiny model's head at 32 rows 15.1 -> 9.3 ms; 32 rows of attention over 800 keys 2.2 ->
1.3 ms (SmolLM2's 5.4 -> 2.9); a 256 x 576 x 3072 projection (SmolLM2's gate/up in a prefill) 9.7 -> 5.6 ms. Small
operations stay on one thread (`SHARED_PRODUCT_MACS`, `SHARED_PRODUCT_WEIGHTS`, `SHARED_ATTENTION_MACS`,
`SHARED_MLP_MACS`, `SHARED_PACKED_MACS`): the helper's wake-up (~0.05-0.1 ms) would cost more than the half it would
take. With another process keeping a core busy the two threads share the core left, and sharing cost ~6 % on the
tiny model's rollout step (`benchmarks/rollout_engines_bench.py --contention`).
The head's shared slices are not timed against one thread's whole matrix (`head_logits`): they win by 15-60 %
with the core free and lose 7-10 % beside a busy one, and a timing taken during a neighbour's burst kept the loser
for the process's life (re-timing every 500 products measured within the noise under contention and lost half the
gain without it).

A decode step given the prefixes its rows share (`SharedPrefixes`, found by `batching.shared_prefixes`) reads each
of them once for all the rows sharing it (`cascade_attention`): each row attends the prefix and its own columns
apart and the two results are merged by their log-normalizers, the attention over the whole row up to rounding.

Models of another shape (sliding windows, q/k norms, MoE, tensor-parallel splits) keep transformers' forward:
`LeanDecoder.for_model` returns None for them. `tests/inference/test_decoder.py` checks the logits against
transformers' on prefill, prefix hits and padded decode batches.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from agentgym.inference.sampling import CDF_BLOCK, SliceWeights, fill_slice_weights

__all__ = ["ForwardHelper", "LeanDecoder", "head_logits", "shared_attention", "shared_linear", "shared_mlp"]

_Result = TypeVar("_Result")

_SUPPORTED = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


def _fuse(linears: list[nn.Linear], dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum(out), in] matrix (and bias) holding these projections, in `dtype` (default: theirs); each Linear's
    weight becomes a view of it."""
    dtype = dtype or linears[0].weight.dtype
    if len(linears) == 1 and linears[0].weight.dtype == dtype:  # nothing to fuse or convert: no copy
        return linears[0].weight, linears[0].bias
    weight = torch.cat([linear.weight.detach() for linear in linears], dim=0).to(dtype).contiguous()
    has_bias = [linear.bias is not None for linear in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("mixed biases")
    bias = torch.cat([linear.bias.detach() for linear in linears]).to(dtype).contiguous() if all(has_bias) else None
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


PACKED_ROWS = 32
"""The batch size oneDNN lays packed matrices out for (any number of rows works; this one is a full decode batch)."""


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's blocked layout when it is bf16 and oneDNN multiplies bf16 natively here; else itself."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not _onednn_bf16():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS)


def _onednn_bf16() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _fuse_and_pack(linears: list[nn.Linear], dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_fuse`, then `_pack` the fused matrix; once packed, the packed copy is the only one: the projections'
    weights move to the meta device and the plain matrix is freed."""
    weight, bias = _fuse(linears, dtype)
    packed = _pack(weight)
    if packed is not weight:
        for linear in linears:
            linear.weight = nn.Parameter(linear.weight.detach().to("meta"), requires_grad=False)
    return packed, bias


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T + b` for a plain or a packed (`_pack`) `weight`."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


HEAD_CHUNKS = 4
"""Vocabulary slices of a packed head shared with a `ForwardHelper`: enough that the two threads even out, few
enough that each slice is one efficient product (2, 4 and 8 were within 10 % of each other; 4 the best)."""


def _pack_float32(weight: torch.Tensor, chunks: int = 1) -> list[torch.Tensor] | None:
    """Packed (oneDNN) copies of `chunks` row slices of a float32 CPU matrix, for `head_logits` to time against the
    plain one; None where there is no such layout (GPU, other dtypes, no oneDNN)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return [
            torch.ops.mkldnn._reorder_linear_weight(part.contiguous(), PACKED_ROWS) for part in weight.chunk(chunks)
        ]
    except RuntimeError:  # a build whose oneDNN cannot pack float32: the plain matrix serves alone
        return None


class ForwardHelper:
    """A second thread for a forward pass's large operations: each is cut into independent parts (vocabulary slices
    of the head, output-column slices of a projection, batch rows or key/value heads of attention) and this thread
    and the calling one each take the next part until none is left (see the module's docstring). One caller at a
    time (the engine's worker)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation = 0
        self._job: tuple[Sequence[Callable[[], Any]], list[Any]] | None = None
        self._next = 0
        self._finished = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="forward-helper", daemon=True)
        self._thread.start()

    def run(self, parts: Sequence[Callable[[], _Result]]) -> list[_Result]:
        """Each part's result, in order; a part's error is raised here (the helper then serves the next call)."""
        results: list[Any] = [None] * len(parts)
        with self._cond:
            self._generation += 1
            generation = self._generation
            self._job, self._next, self._finished, self._error = (parts, results), 0, 0, None
            self._cond.notify_all()
        try:
            self._work(generation, parts, results)
            with self._cond:
                while self._finished < len(parts) and self._error is None:
                    self._cond.wait()
                if self._error is not None:
                    raise self._error
        finally:
            with self._cond:
                self._job = None
        return results  # every slot is filled once all are finished

    def product(self, x: torch.Tensor, chunks: list[torch.Tensor]) -> torch.Tensor:
        """`x W^T` for the head whose packed row slices are `chunks`: `[rows, vocab]`."""
        return torch.cat(self.run([partial(_linear, x, chunk) for chunk in chunks]), dim=1)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5.0)

    def _take(self, generation: int, count: int) -> int | None:
        with self._cond:
            if generation != self._generation or self._next >= count:
                return None
            self._next += 1
            return self._next - 1

    def _work(self, generation: int, parts: Sequence[Callable[[], Any]], results: list[Any]) -> None:
        while (index := self._take(generation, len(parts))) is not None:
            results[index] = parts[index]()
            with self._cond:
                if generation == self._generation:
                    self._finished += 1
                    if self._finished == len(parts):  # only the caller waits for this, and only for the last
                        self._cond.notify_all()

    def _serve(self) -> None:
        # This thread's own OpenMP setting: unset, oneDNN would run its products on a team of every core.
        torch.set_num_threads(torch.get_num_threads())
        seen = 0
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._closed and (self._job is None or self._generation == seen):
                        self._cond.wait()
                    if self._closed:
                        return
                    seen = self._generation
                    parts, results = self._job  # type: ignore[misc]  # not None: checked above
                try:
                    self._work(seen, parts, results)
                except BaseException as error:  # handed to the caller, which raises it
                    with self._cond:
                        if seen == self._generation:
                            self._error = error
                            self._cond.notify_all()


SHARED_PRODUCT_MACS = 8_000_000
"""A projection is shared with a `ForwardHelper` (two output-column halves) from this many multiply-adds (rows x in
x out): on the EPYC a 4 x 576 x 3072 product went 0.47 -> 0.35 ms, while below ~7 M the thread's wake-up costs
more than the half it takes (32 x 256 x 768: 0.18 -> 0.23 ms)."""

SHARED_PRODUCT_WEIGHTS = 1 << 20
"""... or from this many weights (4 MiB of float32), whatever the rows: reading such a matrix bounds a product of a
few rows, and two cores read it faster than one. Measured when SmolLM2's gate/up (576 x 3072) still came here, before
`shared_mlp`: out of cache, two rows 0.90 -> 0.59 ms; the engine decoding 4 streams of SmolLM2 52.1 -> 55.1 tokens/s,
one stream 22.3 either way. The MLP has its own rule now (`SHARED_MLP_MACS`), so this one reaches q/k/v and o: none
of SmolLM2's (0.55 M and 0.33 M weights; sharing its q/k/v at one row measured no gain), a 0.5 B Qwen2's q/k/v
(896 x 1,152)."""

SHARED_ATTENTION_MACS = 2_000_000
"""Attention is shared from this many multiply-adds (batch x heads x queries x keys x head_dim): 32 rows of the tiny
model over 300 keys (2.5 M) went 0.66 -> 0.50 ms, over 800 keys 2.2 -> 1.3; 4 SmolLM2 rows over 600 keys (1.4 M) did
not gain."""


ATTENTION_PART_MACS = 40_000_000
"""Shared attention is cut into one chunk of the batch per this many multiply-adds (at least two, at most
`ATTENTION_PARTS`): a prefill's into more chunks than threads, so that a helper descheduled by a busy neighbour
holds up one small chunk rather than half of it (as `PACKED_ROWS_PER_PART` for packed products)."""

ATTENTION_PARTS = 8


def _chunks(size: int, count: int) -> list[slice]:
    """`count` consecutive slices of `range(size)`, their lengths differing by one at most."""
    bounds = [size * part // count for part in range(count + 1)]
    return [slice(start, end) for start, end in itertools.pairwise(bounds)]


def shared_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, helper: ForwardHelper | None
) -> torch.Tensor:
    """`_linear`, shared between the caller and `helper` when the product is large enough: a plain matrix by two
    halves of its output columns (`SHARED_PRODUCT_MACS`, `SHARED_PRODUCT_WEIGHTS`), a packed one (which has no row
    slices) by chunks of `x`'s rows (`SHARED_PACKED_MACS`)."""
    if helper is None:
        return _linear(x, weight, bias)
    if weight.is_mkldnn:
        if x.numel() * int(weight.shape[0]) < SHARED_PACKED_MACS:
            return _linear(x, weight, bias)
        return _by_rows(x, partial(_linear, weight=weight, bias=bias), helper)
    weights = weight.numel()
    if weights < SHARED_PRODUCT_WEIGHTS and x.numel() // int(weight.shape[1]) * weights < SHARED_PRODUCT_MACS:
        return _linear(x, weight, bias)
    halves = weight.chunk(2)
    biases = bias.chunk(2) if bias is not None else (None,) * len(halves)
    parts = [partial(_linear, x, half, part_bias) for half, part_bias in zip(halves, biases, strict=True)]
    return torch.cat(helper.run(parts), dim=-1)


SHARED_PACKED_MACS = 32_000_000
"""A product of packed (bf16) matrices, a projection or the MLP (gate/up and down together), is shared from this
many multiply-adds by chunks of its rows (`_by_rows`): a packed product of a decode step's few rows is fast enough
that the hand-off costs more than the part it hands off. On the EPYC, the tiny model's MLP (256 x 1,024) by two
chunks at 32 rows (25 M) 0.33 -> 0.35 ms, 64 rows 0.59 -> 0.53, 256 rows 2.3 -> 1.6, a quickstart turn's prefill
(1,952 rows, 7 chunks) 23.0 -> 8.6; SmolLM2's (576 x 1,536) at 16 rows (42 M) 0.48 -> 0.41, 32 rows 0.88 -> 0.62,
1,952 rows 58.9 -> 26.2; the tiny model's q/k/v (256 x 512) at 32 rows (4 M) 0.07 -> 0.15."""

PACKED_ROWS_PER_PART = 256
"""Rows of each chunk a shared packed product is cut into (at least 2 chunks, at most `PACKED_PARTS`): more chunks
than threads, so that a helper descheduled by a busy neighbour holds up at most one chunk, while the caller takes
the rest; a chunk of this many rows is still one efficient product (the tiny model's MLP at 1,952 rows in 2, 4 and
8 chunks: 11.7, 8.9 and 8.6 ms)."""

PACKED_PARTS = 8


def _by_rows(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], helper: ForwardHelper) -> torch.Tensor:
    """`product(x)` for a row-wise `product` ([rows, in] -> [rows, out]), its rows cut into chunks that the caller
    and `helper` take in turn: each row is computed by the same kernel on the same matrices as in one product."""
    rows = x.reshape(-1, x.shape[-1])
    parts = max(2, min(PACKED_PARTS, int(rows.shape[0]) // PACKED_ROWS_PER_PART))
    outputs = helper.run([partial(product, chunk) for chunk in rows.chunk(parts)])
    return torch.cat(outputs).reshape(*x.shape[:-1], -1)


SHARED_MLP_MACS = 1_000_000
"""The MLP (gate/up and down together) is shared from this many multiply-adds (rows x 3 x hidden x intermediate).
On the EPYC, 30 MLPs of the tiny model's shape, gate/up and down each shared or not by `shared_linear`'s rule ->
`shared_mlp`: 2 rows 11.3 -> 10.3 ms, 8 rows 17.4 -> 13.6, but 1 row (0.8 M) 7.6 -> 8.3 (the wake-up costs more
than the half); SmolLM2's at 1 row (2.7 M) 18.5 -> 16.5, 8 rows 36.7 -> 27.0, 32 rows 55.7 -> 51.8."""


def _mlp_half(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return _linear(F.silu(_linear(x, gate)) * _linear(x, up), down)


def _fused_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = _linear(x, gate_up).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, down)


def shared_mlp(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, helper: ForwardHelper | None
) -> torch.Tensor:
    """The MLP `silu(x G^T) * (x U^T) D^T` for `gate_up` = [G; U] (fused rows) and `down` = D, with no biases.

    Shared with `helper` when large enough, in one hand-off for the whole MLP. Plain matrices (`SHARED_MLP_MACS`)
    by halves of the intermediate units, as tensor parallelism splits it across devices: with G_j, U_j the j-th
    half of the rows of G, U and D_j the same half of D's columns,

        silu(x G^T) * (x U^T) D^T = sum_j silu(x G_j^T) * (x U_j^T) D_j^T

    so each thread computes one half from x to its partial output (the halves are views: nothing is copied; the
    two partial sums are added in a different order than one product adds them: the same values up to float
    rounding). Packed ones (bf16, `SHARED_PACKED_MACS`), which have no views, by chunks of x's rows (`_by_rows`)."""
    width = int(down.shape[1])
    macs = x.numel() // int(gate_up.shape[1]) * 3 * int(down.numel())
    if helper is not None and gate_up.is_mkldnn and macs >= SHARED_PACKED_MACS:
        return _by_rows(x, partial(_fused_mlp, gate_up=gate_up, down=down), helper)
    if helper is None or gate_up.is_mkldnn or down.is_mkldnn or width < 2 or macs < SHARED_MLP_MACS:
        return _fused_mlp(x, gate_up, down)
    half = width // 2
    parts = [
        partial(_mlp_half, x, gate_up[:width][units], gate_up[width:][units], down[:, units])
        for units in (slice(0, half), slice(half, width))
    ]
    first, second = helper.run(parts)
    return first + second


def shared_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    helper: ForwardHelper | None,
) -> torch.Tensor:
    """Scaled dot-product attention of `q` `[batch, heads, new, d]` over `keys`/`values` `[batch, kv_heads, columns,
    d]` where `allowed` `[batch, 1, new, columns]`; split between the caller and `helper` when large enough
    (`SHARED_ATTENTION_MACS`): by chunks of the batch (two, or one per `ATTENTION_PART_MACS` up to
    `ATTENTION_PARTS`: a prefill's), or a single row by groups of key/value heads (each with its query heads).
    Every query row's result is computed by the same kernel either way."""
    batch, heads, new, head_dim = (int(size) for size in q.shape)
    kv_heads, columns = int(keys.shape[1]), int(keys.shape[2])
    attend = partial(F.scaled_dot_product_attention, scale=scale, enable_gqa=kv_heads != heads)
    macs = batch * heads * new * columns * head_dim
    if helper is None or macs < SHARED_ATTENTION_MACS or batch * kv_heads < 2:
        return attend(q, keys, values, attn_mask=allowed)
    if batch >= 2:
        count = min(batch, max(2, min(ATTENTION_PARTS, macs // ATTENTION_PART_MACS)))
        parts = [
            partial(attend, q[rows], keys[rows], values[rows], attn_mask=allowed[rows])
            for rows in _chunks(batch, count)
        ]
        return torch.cat(helper.run(parts), dim=0)
    group = heads // kv_heads
    parts = [
        partial(
            attend, q[:, kv * group : (kv + 1) * group], keys[:, kv : kv + 1], values[:, kv : kv + 1], attn_mask=allowed
        )
        for kv in range(kv_heads)
    ]
    return torch.cat(helper.run(parts), dim=1)


@dataclass(eq=False)
class PrefixSegment:
    """A prompt prefix several rows of a decode batch share (the same ids at the same positions, so the same keys
    and values): read once, from the columns `[start, end)` of row `row`, for the queries of every row in `rows`."""

    rows: list[int]
    """The rows whose queries attend it."""
    row: int
    start: int
    end: int


class SharedPrefixes:
    """How a decode batch's attention reads shared prefixes once (`cascade_attention`): each row attends its
    segment (in another row when shared) and its own columns from `window` on, those before `own_start[row]`
    masked (they are its segment's, or padding).

    Valid while the batch keeps its rows (decode steps append columns only; rows that leave are dropped by
    `kept`). Each layer's segments are copied once, on first use, into one `[segments, kv_heads, longest,
    head_dim]` key and value tensor (padding masked), so that one product attends all of them."""

    def __init__(self, segments: list[PrefixSegment], own_start: torch.Tensor, window: int, mask: torch.Tensor):
        """`mask`: the batch's `[rows, columns]` cache mask (1 on real tokens) these were found in."""
        device = mask.device
        longest = max(part.end - part.start for part in segments)
        padding = torch.zeros((len(segments), longest), dtype=torch.bool, device=device)
        for index, part in enumerate(segments):
            width = part.end - part.start
            padding[index, width:] = True
            padding[index, :width] = ~mask[part.row, part.start : part.end].bool()
        self._index(segments, own_start, window, padding)
        self.copied = False
        """Whether every layer's segments are copied (set by the forward pass that used them)."""
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _index(
        self, segments: list[PrefixSegment], own_start: torch.Tensor, window: int, padding: torch.Tensor
    ) -> None:
        device = own_start.device
        self.segments = segments
        self.own_start = own_start
        """`[rows]` long: the first column each row reads itself."""
        self.window = window
        """The first column read for every row: the smallest `own_start`."""
        self._padding = padding
        self.padding: torch.Tensor | None = padding[:, None, None, :] if bool(padding.any()) else None
        """`[segments, 1, 1, longest]`: columns of a segment's copy that are not its keys (gaps, its end)."""
        # Each segment's queries: its rows' queries, padded to the largest segment's count with its first row's.
        self.members = max(len(part.rows) for part in segments)
        slots = [part.rows + [part.rows[0]] * (self.members - len(part.rows)) for part in segments]
        self.query_rows = torch.tensor(slots, device=device).reshape(-1)
        real = [index * self.members + slot for index, part in enumerate(segments) for slot in range(len(part.rows))]
        self.real_slots = torch.tensor(real, device=device)
        self.slot_rows = torch.tensor([row for part in segments for row in part.rows], device=device)

    def kept(self, order: list[int], dropped_columns: int) -> SharedPrefixes | None:
        """These prefixes for the batch after its rows were compacted to `order` (the old index of each remaining
        row) and its first `dropped_columns` columns dropped: segments keep their copies and lose the rows that
        left, those left with none are dropped. None when there is nothing left to share, or the copies are not
        all made (the rows holding a segment may have left: find them again)."""
        if not self.copied:
            return None
        new_row = {old: new for new, old in enumerate(order)}
        segments: list[PrefixSegment] = []
        kept: list[int] = []
        for index, part in enumerate(self.segments):
            rows = [new_row[row] for row in part.rows if row in new_row]
            if rows:
                segments.append(PrefixSegment(rows, -1, part.start, part.end))  # copied: its columns are not read
                kept.append(index)
        if not segments:
            return None
        own_start = self.own_start.index_select(0, torch.tensor(order, device=self.own_start.device)) - dropped_columns
        shared = SharedPrefixes.__new__(SharedPrefixes)
        kept_index = torch.tensor(kept, device=own_start.device)
        shared._index(segments, own_start, int(own_start.min()), self._padding.index_select(0, kept_index))
        shared.copied = True
        shared._copies = {
            layer: (keys.index_select(0, kept_index), values.index_select(0, kept_index))
            if len(kept) < len(self.segments)
            else (keys, values)
            for layer, (keys, values) in self._copies.items()
        }
        return shared

    def segment_kv(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s segments as `[segments, kv_heads, longest, head_dim]` keys and values (zeros past a
        segment's end), copied from the batch cache's `keys`/`values` on first use."""
        copy = self._copies.get(layer)
        if copy is None:
            shape = (len(self.segments), int(keys.shape[1]), int(self._padding.shape[1]), int(keys.shape[3]))
            segment_keys, segment_values = keys.new_zeros(shape), values.new_zeros(shape)
            for index, part in enumerate(self.segments):
                width = part.end - part.start
                segment_keys[index, :, :width] = keys[part.row, :, part.start : part.end]
                segment_values[index, :, :width] = values[part.row, :, part.start : part.end]
            copy = self._copies[layer] = (segment_keys, segment_values)
        return copy

    def window_mask(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The own part's additive mask `[rows, 1, 1, columns - window]` for a decode step whose key columns are
        `mask` `[rows, columns]` (1 on real tokens; the last column is the step's own token)."""
        columns = torch.arange(self.window, mask.shape[1], device=mask.device)
        allowed = mask[:, self.window :].bool() & (columns[None, :] >= self.own_start[:, None])
        allowed[:, -1] = True
        return _additive(allowed, dtype)[:, None, None, :]

    def segment_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        return None if self.padding is None else _additive(~self.padding, dtype)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one the flash kernel takes: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _flash(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q K^T scale + mask) V and its log-normalizer per query, `[batch, heads, new, d]` and `[batch,
    heads, new]`, for equal query and key/value heads (torch's CPU flash kernel, the one scaled_dot_product_attention
    runs here; its log-normalizer is what lets two parts of the keys be attended apart and merged)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, attn_mask=mask, scale=scale)
    return out, lse


def cascade_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    shared: SharedPrefixes,
    layer: int,
    window_mask: torch.Tensor,
    segment_mask: torch.Tensor | None,
    scale: float,
    helper: ForwardHelper | None,
) -> torch.Tensor:
    """A decode step's attention (`q` `[batch, heads, 1, d]` over layer `layer`'s `keys`/`values` `[batch,
    kv_heads, columns, d]`) with each shared prefix read once for all the rows that share it.

    Attention over the union of two disjoint sets of keys A and B is the merge of the attention over each, weighted
    by their normalizers: with o_X = softmax(s_X) V_X and l_X = log sum exp(s_X),

        o = o_A exp(l_A - l) + o_B exp(l_B - l),   l = log(exp(l_A) + exp(l_B)),

    so a row attends its segment (one product for the queries of every row sharing it: the segment's keys are read
    once, not once a row) and its own columns (`window_mask`: from `shared.window` on, the segment's columns
    masked) apart, and the two are merged. The same value as attending the whole row, up to float rounding, when
    the rows of a segment hold the same keys and values there. Queries of the heads that share a key/value head
    are attended together (`[.., kv_heads, heads / kv_heads, d]`): the flash kernel wants equal heads, and no key
    is copied. With a `helper`, two halves of the batch's own columns and two halves of the segments are shared
    out as parts."""
    batch, heads, _, head_dim = (int(size) for size in q.shape)
    kv_heads = int(keys.shape[1])
    group = heads // kv_heads
    grouped = q.reshape(batch, kv_heads, group, head_dim)  # one query a row: heads of a kv head as its queries
    own_keys, own_values = keys[:, :, shared.window :], values[:, :, shared.window :]
    segment_keys, segment_values = shared.segment_kv(layer, keys, values)
    count, members = len(shared.segments), shared.members
    queries = grouped.index_select(0, shared.query_rows).reshape(count, members, kv_heads, group, head_dim)
    queries = queries.permute(0, 2, 1, 3, 4).reshape(count, kv_heads, members * group, head_dim)

    def own(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        return _flash(grouped[rows], own_keys[rows], own_values[rows], window_mask[rows], scale)

    def segments(parts: slice) -> tuple[torch.Tensor, torch.Tensor]:
        mask = None if segment_mask is None else segment_mask[parts]
        return _flash(queries[parts], segment_keys[parts], segment_values[parts], mask, scale)

    def halves(size: int) -> list[slice]:
        middle = (size + 1) // 2
        return [slice(0, middle), slice(middle, size)] if helper is not None and size > 1 else [slice(0, size)]

    own_halves, segment_halves = halves(batch), halves(count)
    jobs = [partial(own, rows) for rows in own_halves] + [partial(segments, parts) for parts in segment_halves]
    results = helper.run(jobs) if helper is not None else [job() for job in jobs]
    own_results, segment_results = results[: len(own_halves)], results[len(own_halves) :]
    out = torch.cat([o for o, _ in own_results]) if len(own_results) > 1 else own_results[0][0]
    lse = torch.cat([n for _, n in own_results]) if len(own_results) > 1 else own_results[0][1]
    part_out = torch.cat([o for o, _ in segment_results]) if len(segment_results) > 1 else segment_results[0][0]
    part_lse = torch.cat([n for _, n in segment_results]) if len(segment_results) > 1 else segment_results[0][1]
    # Back to one entry a row: [segments, kv, members x group, ..] -> [segments x members, kv, group, ..].
    part_out = part_out.reshape(count, kv_heads, members, group, head_dim).transpose(1, 2)
    part_out = part_out.reshape(count * members, kv_heads, group, head_dim).index_select(0, shared.real_slots)
    part_lse = part_lse.reshape(count, kv_heads, members, group).transpose(1, 2)
    part_lse = part_lse.reshape(count * members, kv_heads, group).index_select(0, shared.real_slots)
    rows = shared.slot_rows
    own_out, own_lse = out.index_select(0, rows), lse.index_select(0, rows)
    total = torch.logaddexp(own_lse, part_lse)
    # In float32 (the normalizers are), then in the attention's dtype as one product of the whole rows would be.
    merged = (
        own_out.float() * torch.exp(own_lse - total)[..., None]
        + part_out.float() * torch.exp(part_lse - total)[..., None]
    )
    return out.index_copy(0, rows, merged.to(out.dtype)).reshape(batch, heads, 1, head_dim)


DECODE_ATTENTION_TIMING_SHAPE = (8, 256)
"""Rows and key columns of the decode attention timed by `attention_in_float32` (a typical decode batch)."""

_ATTENTION_FLOAT32_BY_SHAPE: dict[tuple[int, int, int, torch.dtype], bool] = {}
"""(heads, kv_heads, head_dim, dtype) -> whether a decode step's attention was faster in float32 here."""


def attention_in_float32(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether a decoder with `dtype` matmuls attends in float32, over a float32 KV cache holding its `dtype`-rounded
    keys and values, rather than in `dtype`: so where a decode step's attention (one query per row) runs faster in
    float32 than torch's `dtype` kernel, timed once per shape in this process (`DECODE_ATTENTION_TIMING_SHAPE`,
    medians of `HEAD_TIMING_RUNS` alternating runs each; the query's upcast counted).

    Both compute softmax(q K^T / sqrt(d) + mask) V over the same bf16-rounded inputs with float32 scores (the
    float32 one exactly; its output is rounded to `dtype` as the other's is, before the output projection). They
    differ in speed and memory: the float32 cache takes twice the bytes a token (the engine's prefix cache holds
    half the tokens in the same bytes), and a prefill attends in float32 too (on the EPYC below as fast as in
    bf16: 11.1 against 11.3 ms a layer for the quickstart's prefills). On a 2-core AMD EPYC with AVX512-BF16 (no
    AMX), torch's bf16 kernel for one query per row took 7.2 ms for 16 SmolLM2 rows over 432 keys where the same
    inputs in float32 took 1.3 ms even with the cache upcast first (0.30 against 0.06 ms for one row), while from 4
    queries a row the two were level (by hand, one thread). Upcasting the bf16 cache at every step, as the engine
    first did, cost the quickstart's 32 rows over 250-700 keys 2.4 ms a layer against float32's 1.0 ms; a float32
    cache costs nothing more (`benchmarks/cpu_bf16_bench.py --inference` prints this comparison)."""
    key = (heads, kv_heads, head_dim, dtype)
    choice = _ATTENTION_FLOAT32_BY_SHAPE.get(key)
    if choice is None:
        rows, columns = DECODE_ATTENTION_TIMING_SHAPE
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(rows, heads, 1, head_dim, generator=generator).to(dtype)
        keys, values = (torch.randn(rows, kv_heads, columns, head_dim, generator=generator).to(dtype) for _ in "kv")
        cached = {False: (keys, values), True: (keys.float(), values.float())}
        allowed = torch.ones(rows, 1, 1, columns, dtype=torch.bool)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        with torch.inference_mode():
            for _ in range(HEAD_TIMING_RUNS):
                for in_float32 in (False, True):
                    start = time.perf_counter()
                    query = q.float() if in_float32 else q
                    shared_attention(query, *cached[in_float32], allowed, head_dim**-0.5, None).to(dtype)
                    seconds[in_float32].append(time.perf_counter() - start)
        choice = statistics.median(seconds[True]) < statistics.median(seconds[False])
        _ATTENTION_FLOAT32_BY_SHAPE[key] = choice
    return choice


HEAD_TIMING_RUNS = 3
"""Runs of each layout when a row count's head product is timed; the medians are compared."""

_HEAD_PACKED_BY_SHAPE: dict[tuple[int, int, int, torch.dtype], bool] = {}
"""(vocab, hidden, rows, dtype) -> whether the packed copy beat the plain matrix when timed here (a head multiplied
on one thread)."""


def head_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: list[torch.Tensor] | None = None,
    helper: ForwardHelper | None = None,
) -> torch.Tensor:
    """`x W^T` for the LM head's `[rows, hidden]` states: by its `packed` vocabulary slices shared with `helper`
    when there are both; else with the plain `weight`, or with its `packed` copy (`_pack_float32`) where that was
    faster for this many rows when timed here.

    Shared slices are not timed against the whole matrix: on the 2-core EPYC they multiply the tiny model's head
    1.15-1.6x faster than one thread (1 to 32 rows) and 0.90-0.93x as fast while another process keeps a core
    busy, so a timing taken during a neighbour's burst, which once per process used to decide it, could keep the
    slower layout for a server's life: one in seven in-process rollout steps ran 25 % slower so (3.75 against
    3.0 s), without the slices' sampling weights (`head_in_slices`)."""
    if packed is None or x.dim() != 2:
        return _linear(x, weight)
    if helper is not None and len(packed) > 1:
        return helper.product(x, packed)
    shape = (int(weight.shape[0]), int(weight.shape[1]), int(x.shape[0]), weight.dtype)
    use_packed = _HEAD_PACKED_BY_SHAPE.get(shape)
    if use_packed is None:
        use_packed, logits = _time_head_layouts(x, weight, packed)
        _HEAD_PACKED_BY_SHAPE[shape] = use_packed
        return logits
    return _packed_product(x, packed) if use_packed else _linear(x, weight)


def head_in_slices(x: torch.Tensor, packed: list[torch.Tensor]) -> bool:
    """Whether `head_logits` multiplies these rows by `packed` vocabulary slices shared with a helper and the
    slices are equal whole numbers of `CDF_BLOCK` columns: then `sliced_head` can give the sampling weights with
    the logits."""
    widths = {int(part.shape[0]) for part in packed}
    return x.dim() == 2 and len(packed) > 1 and len(widths) == 1 and widths.pop() % CDF_BLOCK == 0


def sliced_head(
    x: torch.Tensor, packed: list[torch.Tensor], helper: ForwardHelper
) -> tuple[torch.Tensor, SliceWeights]:
    """The LM head's float32 logits `[rows, vocab]` by its `packed` vocabulary slices shared with `helper`, and
    their sampling weights: the thread that multiplies a slice writes its logits into the whole and then, while
    they are in its cache, their weights and block sums (`sampling.fill_slice_weights`). One pass over each
    slice's logits in place of the head's concatenation, the float32 copy and `choose_tokens`' passes over the
    whole vocabulary on one thread: the tiny model's head and sampling at 32 rows 5.7-6.2 -> 4.3-4.8 ms."""
    rows, width = int(x.shape[0]), int(packed[0].shape[0])
    logits = torch.empty((rows, width * len(packed)), dtype=torch.float32, device=x.device)
    weights = torch.empty_like(logits)
    block_sums = logits.new_empty((rows, logits.shape[1] // CDF_BLOCK))
    peaks = logits.new_empty((rows, len(packed)))
    blocks = width // CDF_BLOCK

    def part(index: int) -> None:
        columns = slice(index * width, (index + 1) * width)
        logits[:, columns].copy_(_linear(x, packed[index]))
        sums = block_sums[:, index * blocks : (index + 1) * blocks]
        peaks[:, index] = fill_slice_weights(logits[:, columns], weights[:, columns], sums)

    helper.run([partial(part, index) for index in range(len(packed))])
    return logits, SliceWeights(weights, peaks, block_sums, width)


def _packed_product(x: torch.Tensor, packed: list[torch.Tensor]) -> torch.Tensor:
    """`x W^T` by the packed slices of W on this thread."""
    return torch.cat([_linear(x, part) for part in packed], dim=1) if len(packed) > 1 else _linear(x, packed[0])


def _time_head_layouts(x: torch.Tensor, weight: torch.Tensor, packed: list[torch.Tensor]) -> tuple[bool, torch.Tensor]:
    """Whether the packed copy multiplies `x` faster than the plain `weight` (medians of `HEAD_TIMING_RUNS`
    alternating runs each), and the logits of the last run."""
    seconds: dict[bool, list[float]] = {False: [], True: []}
    logits = x.new_empty(0)
    for _ in range(HEAD_TIMING_RUNS):
        for use_packed in (False, True):
            start = time.perf_counter()
            logits = _packed_product(x, packed) if use_packed else _linear(x, weight)
            seconds[use_packed].append(time.perf_counter() - start)
    return statistics.median(seconds[True]) < statistics.median(seconds[False]), logits


class _Layer:
    __slots__ = ("down", "gate_up", "norm1", "norm2", "o", "o_bias", "qkv", "qkv_bias")

    def __init__(self, layer: Any, dtype: torch.dtype | None) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv, self.qkv_bias = _fuse_and_pack([attention.q_proj, attention.k_proj, attention.v_proj], dtype)
        self.o, self.o_bias = _fuse_and_pack([attention.o_proj], dtype)
        self.gate_up, _ = _fuse_and_pack([mlp.gate_proj, mlp.up_proj], dtype)
        self.down, _ = _fuse_and_pack([mlp.down_proj], dtype)
        self.norm1, self.norm2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight


class LeanDecoder:
    """`model`'s forward pass for the engine: last-position logits of a batch, KV appended to its cache."""

    def __init__(
        self, model: Any, matmul_dtype: torch.dtype | None = None, helper: ForwardHelper | None = None
    ) -> None:
        """`matmul_dtype`: the matmuls' dtype when not the weights' (bf16: see the module's docstring); the
        model's projection weights are converted to it in place (the engine runs only this forward on them).
        `helper`: a thread to share the large products and attention with (`ForwardHelper`)."""
        config = model.config
        self.matmul_dtype = matmul_dtype
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.scaling = self.head_dim**-0.5
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb  # the model's own RoPE (scaling variants included)
        self.norm = inner.norm.weight
        # A head tied to the embedding gets its own low-precision copy: the embedding lookup stays float32.
        head = model.lm_head.weight.detach()
        low_head = head if matmul_dtype is None else head.to(matmul_dtype)
        self.lm_head = low_head if matmul_dtype is None else _pack(low_head)
        self.helper = helper
        chunks = HEAD_CHUNKS if helper is not None else 1
        self.lm_head_packed = _pack_float32(self.lm_head, chunks) if not self.lm_head.is_mkldnn else None
        if self.lm_head.is_mkldnn and helper is not None:  # packed bf16: slices to share, timed against the whole
            self.lm_head_packed = [_pack(part.contiguous()) for part in low_head.chunk(HEAD_CHUNKS)]
        del low_head
        if self.lm_head.is_mkldnn and head.data_ptr() != self.embed.data_ptr():
            model.lm_head.weight = nn.Parameter(head.to("meta"), requires_grad=False)  # untied: the packed one only
        self.layers = [_Layer(layer, matmul_dtype) for layer in inner.layers]
        self.q_width = self.heads * self.head_dim
        self.kv_width = self.kv_heads * self.head_dim
        self.attention_in_float32 = matmul_dtype is not None and attention_in_float32(
            self.heads, self.kv_heads, self.head_dim, matmul_dtype
        )
        self.kv_dtype = torch.float32 if self.attention_in_float32 else (matmul_dtype or self.embed.dtype)
        """The KV cache's dtype: the matmuls' (bf16 halves a token's bytes) unless attention is in float32."""

    @classmethod
    def for_model(
        cls, model: Any, matmul_dtype: torch.dtype | None = None, helper: ForwardHelper | None = None
    ) -> LeanDecoder | None:
        """A lean forward for `model` when it has the plain Llama shape this computes exactly; else None."""
        config = model.config
        if type(model).__name__ not in _SUPPORTED:
            return None
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
            return None
        if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
            return None
        if getattr(config, "use_sliding_window", False) or getattr(config, "sliding_window", None):
            return None
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
            return None
        for layer in inner.layers:
            attention = layer.self_attn
            if any(hasattr(attention, name) for name in ("q_norm", "k_norm")):
                return None
            if getattr(attention, "scaling", None) not in (None, int(attention.head_dim) ** -0.5):
                return None
        try:
            return cls(model, matmul_dtype, helper)
        except (AttributeError, ValueError):
            return None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        shared: SharedPrefixes | None = None,
    ) -> torch.Tensor:
        """Logits `[batch, vocab]` (float32) at each row's last input position. `mask` `[batch, past + new]` marks
        real key columns; `positions` `[batch, new]` are the new tokens' positions; `cache.layers[i].update` takes
        the new keys/values `[batch, kv_heads, new, head_dim]` and returns all of them. `shared`: for a decode step
        (one new token a row), the prefixes rows share, read once (`cascade_attention`)."""
        return self.forward_sampling(input_ids, mask, positions, cache, shared, slice_weights=False)[0]

    @torch.inference_mode()
    def forward_sampling(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        shared: SharedPrefixes | None = None,
        slice_weights: bool = True,
    ) -> tuple[torch.Tensor, SliceWeights | None]:
        """`forward`'s logits and, where asked for and the LM head is multiplied in vocabulary slices shared with
        the helper here (`sliced_head`), their sampling weights, computed slice by slice by the thread that
        computed the slice (`sampling.SliceWeights`); else None."""
        batch, new = input_ids.shape
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [batch, 1, new, head_dim]
        if shared is not None and new != 1:
            raise ValueError("shared prefixes are for decode steps (one new token a row)")
        allowed = self._allowed(mask, new) if shared is None else None
        window_mask = segment_mask = None
        if shared is not None:
            window_mask = shared.window_mask(mask, self.kv_dtype)
            segment_mask = shared.segment_mask(self.kv_dtype)
        size = (int(hidden.shape[-1]),)
        low, helper = self.matmul_dtype, self.helper
        for index, layer in enumerate(self.layers):
            x = F.rms_norm(hidden, size, layer.norm1, self.eps)
            qkv = shared_linear(x if low is None else x.to(low), layer.qkv, layer.qkv_bias, helper)
            q, k, v = qkv.split((self.q_width, self.kv_width, self.kv_width), dim=-1)
            q = q.view(batch, new, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(batch, new, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(batch, new, self.kv_heads, self.head_dim).transpose(1, 2)
            if low is None:
                q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            else:  # RoPE in float32, then q and k rounded to the matmul dtype, as under autocast
                q, k = _rope(q.float(), cos, sin).to(low), _rope(k.float(), cos, sin).to(low)
                if self.attention_in_float32:  # the same rounded values, attended and cached in float32
                    q, k, v = q.float(), k.float(), v.float()
            keys, values = cache.layers[index].update(k, v)
            if shared is None:
                assert allowed is not None
                attended = shared_attention(q, keys, values, allowed, self.scaling, helper)
            else:
                assert window_mask is not None
                attended = cascade_attention(
                    q, keys, values, shared, index, window_mask, segment_mask, self.scaling, helper
                )
            attended = attended.transpose(1, 2).reshape(batch, new, self.q_width)
            if low is not None:  # the output projection's input in the matmul dtype (a no-op unless in float32)
                attended = attended.to(low)
            hidden = hidden + shared_linear(attended, layer.o, layer.o_bias, helper).to(hidden.dtype)
            x = F.rms_norm(hidden, size, layer.norm2, self.eps)
            hidden = hidden + shared_mlp(x if low is None else x.to(low), layer.gate_up, layer.down, helper).to(
                hidden.dtype
            )
        if shared is not None:
            shared.copied = True  # every layer's segments: rows may leave now without losing them
        last = F.rms_norm(hidden[:, -1], size, self.norm, self.eps)
        last = last if low is None else last.to(low)
        helper, packed = self.helper, self.lm_head_packed
        if slice_weights and helper and packed and head_in_slices(last, packed):
            return sliced_head(last, packed, helper)
        return head_logits(last, self.lm_head, self.lm_head_packed, self.helper).float(), None

    @staticmethod
    def _allowed(mask: torch.Tensor, new: int) -> torch.Tensor:
        """`[batch, 1, new, columns]` booleans: key column j is visible to new token i when the row's mask has it
        and j <= past + i (the new tokens are the last `new` columns), or j is the token's own column."""
        columns = mask.shape[1]
        keys = mask.bool()[:, None, None, :]
        if new == 1:
            own = torch.zeros(columns, dtype=torch.bool, device=mask.device)
            own[-1] = True
            return keys | own
        past = columns - new
        query = torch.arange(new, device=mask.device)[:, None] + past
        key = torch.arange(columns, device=mask.device)[None, :]
        causal = key <= query
        return (keys & causal) | (key == query)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves convention (transformers' `rotate_half`)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-second, first), dim=-1) * sin
