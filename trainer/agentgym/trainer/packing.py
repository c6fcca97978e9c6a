"""Sequence packing: several trajectories (prompt + response) in one row, no padding.

A multi-turn trajectory is one token sequence ``prompt | response``; the trainer needs, for every
response token, the log-probability (and entropy, and for PPO the critic's value) of that token
given everything before it. Sequences of very different lengths are packed first-fit-decreasing
into rows of at most ``max_tokens`` tokens (a sequence longer than that gets a row of its own).
Each row is forwarded alone (batch size 1): no padding at all.

Inside a row every sequence restarts its position ids at 0 and attends only to itself: the
attention mask is block-diagonal and causal within each block. How that reaches the model
depends on the attention implementation:

``sdpa``
    a boolean ``[1, 1, N, N]`` mask (True = may attend), passed as ``attention_mask``;
``eager`` (and anything else that adds the mask to the scores)
    the same mask as an additive float mask (0 / dtype minimum);
``flash_attention_2`` / ``flash_attention_3``
    no mask: the restarting ``position_ids`` tell the varlen kernel where sequences start;
``flex_attention``
    no mask either: transformers builds a block-sparse ``BlockMask`` from the packed position ids.

With sdpa/eager the dense mask spans the whole row, so attention costs ``O(row^2)`` however short
the sequences are: keep ``micro_batch_tokens`` moderate there (a few thousand); with the flash
kernels attention costs ``O(sum len_i^2)`` and long rows are free.

transformers passes a 4-D mask through unchanged (``masking_utils``), so the packed forward
computes exactly what separate forwards of the sequences compute (tested).

Shared prompts (``share_prompts=True``): the samples of a GRPO/RLOO group start from one prompt,
and the prompt is often most of each sequence (a BabyAI prompt is ~380 tokens; a one-turn reply
~30). Sequences with identical prompts are then packed as one block ``prompt | response_1 |
response_2 | ...``: the prompt is forwarded once, each response continues the prompt's position ids
and attends to the prompt and to itself only, so every response token gets exactly the log-prob a
separate forward gives it (tested) and the backward pass sums the prompt's gradient over the
responses. Prompts of different groups in one row usually start alike too (an environment's
system prompt and instructions, 256 of BabyAI's ~380 prompt tokens): their longest common prefix
(at least ``MIN_SHARED_PREFIX`` tokens, never a whole prompt) is forwarded once at the start of the
row, and each prompt continues from it with its own tokens and position ids, seeing that prefix
first. Needs a dense mask (sdpa / eager); the flash and flex kernels only see restarting position
ids, so ``attention_mask`` refuses a shared row for them.

Only the positions that score a response token go through the LM head (``hidden[p]`` scores token
``p + 1``): prompt positions never need logits, which saves the ``[N, vocab]`` logits of the
prompt. A plain linear head and the log-probs of the labels are one op
(`agentgym.trainer.losses.linear_token_logprobs`: fewer passes over the logits) unless the entropy
needs a gradient. The head runs in chunks; with ``checkpoint_chunks`` each chunk's logits are recomputed in
the backward pass instead of being stored (bounded memory for long rows and large vocabularies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from agentgym.trainer.losses import entropy_from_logits, linear_token_logprobs
from agentgym.trainer.packed_attention import PACKED_ATTENTION, AttentionSpan

__all__ = [
    "PackedRow",
    "Segment",
    "SequenceOutputs",
    "forward_packed",
    "pack_lengths",
    "pack_sequences",
    "response_logprobs_unpacked",
]

MIN_SHARED_PREFIX = 16
"""Fewest tokens the prompts of a row must share for the row to forward their common prefix once."""


@dataclass(frozen=True)
class Segment:
    """One sequence inside a packed row."""

    index: int  # the sequence's index in the caller's list
    offset: int  # first token of the sequence's prompt in the row (past its part in the row's common prefix)
    length: int  # tokens of the sequence (prompt + response)
    response_start: int  # first response token, relative to the sequence (= prompt length)
    response_offset: int = -1  # first response token in the row; -1: right after the prompt (not shared)
    prefix_start: int = 0  # the prompt's first prefix_length tokens sit in the row at [prefix_start, ...)
    prefix_length: int = 0  # 0: the whole prompt is at offset

    @property
    def response_length(self) -> int:
        return self.length - self.response_start

    @property
    def prompt_end(self) -> int:
        """Row position just past the prompt's tokens at ``offset``."""
        return self.offset + self.response_start - self.prefix_length

    @property
    def response_at(self) -> int:
        """Row position of the first response token."""
        return self.prompt_end if self.response_offset < 0 else self.response_offset

    @property
    def shares_prompt(self) -> bool:
        """A later response of a shared prompt: not right after the prompt."""
        return self.response_at != self.prompt_end

    @property
    def prompt_ranges(self) -> tuple[tuple[int, int], ...]:
        """The row ranges holding the prompt, in order (adjacent ones merged)."""
        own = (self.offset, self.prompt_end)
        if not self.prefix_length:
            return (own,)
        prefix = (self.prefix_start, self.prefix_start + self.prefix_length)
        return ((prefix[0], own[1]),) if prefix[1] == own[0] else (prefix, own)


@dataclass
class PackedRow:
    """Token ids and position ids of one row, and where its sequences are.

    ``score_masks`` (optional, one bool tensor ``[response_length]`` per segment) restricts which
    response tokens are scored: the LM head (and the critic's value head) runs only there, and
    outputs are 0 elsewhere. Without it every response token is scored.
    """

    input_ids: Tensor  # [N] long
    position_ids: Tensor  # [N] long, restarting at 0 for each sequence
    segments: list[Segment] = field(default_factory=list)
    score_masks: list[Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def attention_mask(self, kind: str, dtype: torch.dtype = torch.float32, device: Any = None) -> Tensor | None:
        """The causal mask ``[1, 1, N, N]`` for attention implementation ``kind``.

        A token attends to the tokens before it of its own sequence: its prompt (shared or not) and
        its own response. None for the flash / flex kernels: transformers derives the packed layout
        from the restarting position ids (varlen flash attention; a sparse BlockMask for flex
        attention), which cannot express a shared prompt.
        """
        if kind.startswith("flash_attention") or kind == "flex_attention":
            if any(segment.shares_prompt or segment.prefix_length for segment in self.segments):
                raise ValueError(f"a row with shared prompts needs a dense attention mask (sdpa or eager), not {kind}")
            return None
        n = self.num_tokens
        allowed = torch.zeros(n, n, dtype=torch.bool, device=device)  # built where it is used: no [N, N] copy
        for span in self.attention_spans():
            width = span.end - span.start
            causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            allowed[span.start : span.end, span.start : span.end] = causal
            for first, last in span.prefixes:
                allowed[span.start : span.end, first:last] = True
        allowed = allowed.view(1, 1, n, n)
        if kind == "sdpa":
            return allowed
        zero = torch.zeros((), dtype=dtype, device=device)
        minimum = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)
        return torch.where(allowed, zero, minimum)

    def attention_spans(self) -> list[AttentionSpan]:
        """The row cut into spans for ``sdpa_packed`` (see ``agentgym.trainer.packed_attention``), in row order.

        A sequence with its prompt right before its response (unshared, or the first response of a
        shared prompt) is one causal span from its prompt's start, after the row's common prefix if
        its prompt starts there and the prefix is not right before it; a later response of a shared
        prompt is a span after that prompt's ranges.
        """
        spans = []
        for segment in self.segments:
            ranges = segment.prompt_ranges
            end = segment.response_at + segment.response_length
            if segment.shares_prompt:
                if segment.response_length:
                    spans.append(AttentionSpan(segment.response_at, end, ranges))
            else:  # the prompt's last range runs into the response: one causal span from its start
                spans.append(AttentionSpan(ranges[-1][0], end, ranges[:-1]))
        end = 0
        for span in spans:
            if span.start != end:
                raise ValueError(f"segments do not tile the row: a span starts at {span.start}, not {end}")
            end = span.end
        if end != self.num_tokens:
            raise ValueError(f"segments cover {end} of the row's {self.num_tokens} tokens")
        return spans

    def _scored(self, k: int) -> Tensor:
        """Response-relative indices of the scored tokens of segment ``k``."""
        n = self.segments[k].response_length
        if self.score_masks is None:
            return torch.arange(n, dtype=torch.long)
        return torch.nonzero(self.score_masks[k][:n], as_tuple=False).flatten()

    def score_positions(self) -> Tensor:
        """Row positions whose hidden state scores a response token, in segment order.

        Response token ``r`` is scored by the token before it: response token ``r - 1``, or for
        ``r = 0`` the prompt's last token (which, shared, is not right before the response).
        """
        parts = []
        for k, s in enumerate(self.segments):
            scored = self._scored(k)
            before = s.response_at + scored - 1
            parts.append(torch.where(scored == 0, s.prompt_end - 1, before))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def score_labels(self) -> Tensor:
        """The response tokens scored at :meth:`score_positions`."""
        parts = [self.input_ids[s.response_at + self._scored(k)] for k, s in enumerate(self.segments)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def split_scores(self, values: Tensor) -> list[Tensor]:
        """Per-segment ``[response_length]`` tensors from values at :meth:`score_positions` (0 where unscored)."""
        if self.score_masks is None:
            return list(torch.split(values, [s.response_length for s in self.segments]))
        out = []
        start = 0
        for k, segment in enumerate(self.segments):
            index = self._scored(k).to(values.device)
            chunk = values[start : start + index.numel()]
            start += index.numel()
            full = torch.zeros(segment.response_length, dtype=values.dtype, device=values.device)
            out.append(full.index_copy(0, index, chunk))
        return out


def pack_lengths(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of total length ``<= max_tokens`` (first-fit decreasing).

    Deterministic: ties keep input order; rows are returned in creation order and each row lists
    its indices in the order they were placed. A length above ``max_tokens`` gets its own row.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max(0, max_tokens - n))
    return rows


def pack_sequences(
    sequences: Sequence[Sequence[int]],
    response_starts: Sequence[int],
    max_tokens: int,
    score_masks: Sequence[Tensor] | None = None,
    share_prompts: bool = False,
    share_prefixes: bool = True,
) -> list[PackedRow]:
    """Pack token sequences into rows; ``response_starts[i]`` is the prompt length of sequence ``i`` (>= 1).

    ``score_masks[i]`` (optional) marks the response tokens of sequence ``i`` that need scores.
    ``share_prompts``: sequences with identical prompts share one copy of it (see the module notes);
    a block of one prompt and its responses holds at most ``max_tokens`` tokens (at least one response).
    ``share_prefixes`` (with ``share_prompts``): the different prompts of a row share one copy of
    their common prefix too.
    """
    if len(sequences) != len(response_starts):
        raise ValueError("one response start per sequence")
    if score_masks is not None and len(score_masks) != len(sequences):
        raise ValueError("one score mask per sequence")
    for i, (seq, start) in enumerate(zip(sequences, response_starts, strict=True)):
        if not 1 <= start <= len(seq):
            raise ValueError(f"sequence {i}: response start {start} outside [1, {len(seq)}] (a prompt is needed)")
    # Blocks: the sequences that share one copy of a prompt (one sequence each without sharing), in
    # first-appearance order; a block that would outgrow a row is closed and the prompt starts another.
    blocks: list[list[int]] = []
    block_lengths: list[int] = []
    open_block: dict[tuple[int, ...], int] = {}  # prompt -> the block its next response may join
    for i, seq in enumerate(sequences):
        prompt = tuple(seq[: response_starts[i]]) if share_prompts else (i,)
        response_length = len(seq) - response_starts[i]
        b = open_block.get(prompt)
        if b is None or block_lengths[b] + response_length > max_tokens:
            open_block[prompt] = b = len(blocks)
            blocks.append([])
            block_lengths.append(response_starts[i])
        blocks[b].append(i)
        block_lengths[b] += response_length

    rows = []
    for row_blocks in pack_lengths(block_lengths, max_tokens):
        prompts = [sequences[blocks[b][0]][: response_starts[blocks[b][0]]] for b in row_blocks]
        shared = _shared_prefix_length(prompts) if share_prompts and share_prefixes else 0
        ids: list[int] = list(prompts[0][:shared])
        positions: list[int] = list(range(shared))
        segments = []
        for b in row_blocks:
            block = blocks[b]
            prompt_length = response_starts[block[0]]
            prompt_offset = len(ids)
            ids.extend(sequences[block[0]][shared:prompt_length])
            positions.extend(range(shared, prompt_length))
            for n, i in enumerate(block):
                seq = list(sequences[i])
                response_offset = len(ids) if n > 0 else -1
                segments.append(Segment(i, prompt_offset, len(seq), prompt_length, response_offset, 0, shared))
                ids.extend(seq[prompt_length:])
                positions.extend(range(prompt_length, len(seq)))
        masks = None if score_masks is None else [torch.as_tensor(score_masks[s.index]).bool() for s in segments]
        rows.append(
            PackedRow(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), segments, masks)
        )
    return rows


def _shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens all ``prompts`` (two or more) start with, short of the shortest prompt; 0 below ``MIN_SHARED_PREFIX``.

    Every prompt keeps at least its last token of its own: it scores the first response token.
    """
    if len(prompts) < 2:
        return 0
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    length = 0
    while length < limit and all(p[length] == first[length] for p in prompts[1:]):
        length += 1
    return length if length >= MIN_SHARED_PREFIX else 0


@dataclass
class SequenceOutputs:
    """Per-sequence outputs of a packed forward, each ``[response_length]``, aligned with the response ids."""

    logprobs: list[Tensor]
    entropy: list[Tensor] | None = None
    values: list[Tensor] | None = None


def _fusable_head(head: Callable[[Tensor], Tensor]) -> bool:
    """A plain bias-free linear head whose weight is all here (not a ZeRO-3 partition, which only its
    module's forward gathers): `linear_token_logprobs` can take its weight directly."""
    return isinstance(head, nn.Linear) and head.bias is None and not hasattr(head.weight, "ds_id")


def _head_chunk(
    hidden: Tensor, labels: Tensor, head: Callable[[Tensor], Tensor], with_entropy: bool, entropy_grad: bool
) -> tuple[Tensor, Tensor]:
    if _fusable_head(head) and not (with_entropy and entropy_grad):
        assert isinstance(head, nn.Linear)
        return linear_token_logprobs(hidden, head.weight, labels, with_entropy)
    logits = head(hidden).float()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if with_entropy and entropy_grad:
        entropy = entropy_from_logits(logits)
    elif with_entropy:  # a metric only: reuse the log-softmax, no graph
        with torch.no_grad():
            logp_detached = logp_all.detach()
            entropy = -(logp_detached.exp() * logp_detached).sum(dim=-1)
    else:
        entropy = torch.zeros_like(logp.detach())
    return logp, entropy


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        raise TypeError(f"{type(model).__name__} is not a causal LM with get_decoder()/get_output_embeddings()")
    decoder, head = get_decoder(), get_head()
    if decoder is None or head is None:
        raise TypeError(f"{type(model).__name__} has no decoder or no output embeddings")
    return decoder, head


def attention_kind(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    kind = getattr(config, "_attn_implementation", None) or "eager"
    return str(kind)


CPU_SHAPE_BUCKET = 64
"""On CPU, packed rows and the LM head's scored tokens are padded to a multiple of this many tokens.

oneDNN builds (JIT-compiles) a matmul kernel for every new shape it meets and caches it; packed rows have a new
length nearly every time. Rounded up to a multiple of 64 a row reuses the kernels of earlier rows: the tiny model's
forward + backward of a 1,000-2,000-token row 1.08-1.19x faster, a BabyAI GRPO update step 1.07-1.12x
(`benchmarks/update_kernels_bench.py`, three runs). The padding is a causal span of its own at the row's end (no
real token sees it) and its outputs are dropped. Not done on GPUs: their matmul libraries build nothing per shape."""


def _bucket_padding(tokens: int, device: Any) -> int:
    """Tokens to add so that ``tokens`` is a multiple of `CPU_SHAPE_BUCKET` (on CPU; 0 elsewhere)."""
    if torch.device(device).type != "cpu":
        return 0
    return -tokens % CPU_SHAPE_BUCKET


def row_hidden_states(decoder: nn.Module, row: PackedRow, attn_kind: str, dtype: torch.dtype, device: Any) -> Tensor:
    """The decoder's last hidden states ``[N, H]`` for one packed row."""
    input_ids = row.input_ids.to(device).unsqueeze(0)
    position_ids = row.position_ids.to(device).unsqueeze(0)
    tokens = input_ids.shape[1]
    if attn_kind == PACKED_ATTENTION:
        spans = row.attention_spans()
        padding = _bucket_padding(tokens, device)
        if padding:  # a span of its own after the row: it sees only itself, and nothing sees it
            input_ids = torch.cat([input_ids, input_ids.new_zeros(1, padding)], dim=1)
            position_ids = torch.cat([position_ids, torch.arange(padding, device=device).unsqueeze(0)], dim=1)
            spans = [*spans, AttentionSpan(tokens, tokens + padding)]
        out = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, packed_spans=spans)
    else:
        mask = row.attention_mask(attn_kind, dtype=dtype, device=device)
        out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
    hidden: Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0, :tokens]


def forward_packed(
    model: nn.Module,
    row: PackedRow,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = 4096,
    checkpoint_chunks: bool = False,
    autocast_dtype: torch.dtype | None = None,
) -> SequenceOutputs:
    """Log-probs (and entropies) of every response token of every sequence of ``row`` under ``model``.

    ``entropy_grad=False`` computes the entropies without a graph (a metric only: no logits kept for them).
    """
    decoder, head = _decoder_and_head(model)
    device = next(model.parameters()).device
    param_dtype = next(model.parameters()).dtype
    mask_dtype = autocast_dtype or param_dtype
    with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        hidden = row_hidden_states(decoder, row, attention_kind(model), mask_dtype, device)
        selected = hidden.index_select(0, row.score_positions().to(device))
        labels = row.score_labels().to(device)
        scored = selected.shape[0]
        padding = _bucket_padding(scored, device)
        if padding:  # rows of zeros scoring token 0: their outputs are dropped below, so they get no gradient
            selected = torch.cat([selected, selected.new_zeros(padding, selected.shape[1])])
            labels = torch.cat([labels, labels.new_zeros(padding)])
        logps, ents = [], []
        for start in range(0, max(1, selected.shape[0]), chunk_tokens):
            h = selected[start : start + chunk_tokens]
            y = labels[start : start + chunk_tokens]
            if checkpoint_chunks and torch.is_grad_enabled():
                lp, en = torch.utils.checkpoint.checkpoint(
                    _head_chunk, h, y, head, with_entropy, entropy_grad, use_reentrant=False, preserve_rng_state=False
                )
            else:
                lp, en = _head_chunk(h, y, head, with_entropy, entropy_grad)
            logps.append(lp)
            ents.append(en)
    logp_all = torch.cat(logps)[:scored]
    ent_all = torch.cat(ents)[:scored]
    return SequenceOutputs(
        logprobs=row.split_scores(logp_all),
        entropy=row.split_scores(ent_all) if with_entropy else None,
    )


def response_logprobs_unpacked(model: nn.Module, sequence: Sequence[int], response_start: int) -> Tensor:
    """Reference path: one plain forward of one sequence (no packing); ``[response_length]`` log-probs."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(sequence)], dtype=torch.long, device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    labels = ids[0, response_start:]
    logp = torch.log_softmax(logits[response_start - 1 : -1], dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
