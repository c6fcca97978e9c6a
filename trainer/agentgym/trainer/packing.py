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

Only the positions that score a response token go through the LM head (``hidden[p]`` scores token
``p + 1``): prompt positions never need logits, which saves the ``[N, vocab]`` logits of the
prompt. The head runs in chunks; with ``checkpoint_chunks`` each chunk's logits are recomputed in
the backward pass instead of being stored (bounded memory for long rows and large vocabularies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from agentgym.trainer.losses import entropy_from_logits

__all__ = [
    "PackedRow",
    "Segment",
    "SequenceOutputs",
    "forward_packed",
    "pack_lengths",
    "pack_sequences",
    "response_logprobs_unpacked",
]


@dataclass(frozen=True)
class Segment:
    """One sequence inside a packed row."""

    index: int  # the sequence's index in the caller's list
    offset: int  # first token of the sequence in the row
    length: int  # tokens of the sequence (prompt + response)
    response_start: int  # first response token, relative to the sequence (= prompt length)

    @property
    def response_length(self) -> int:
        return self.length - self.response_start


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

    def segment_ids(self) -> Tensor:
        """``[N]``: which segment each token belongs to."""
        ids = torch.empty(self.num_tokens, dtype=torch.long)
        for k, segment in enumerate(self.segments):
            ids[segment.offset : segment.offset + segment.length] = k
        return ids

    def attention_mask(self, kind: str, dtype: torch.dtype = torch.float32, device: Any = None) -> Tensor | None:
        """The block-diagonal causal mask ``[1, 1, N, N]`` for attention implementation ``kind``.

        None for the flash / flex kernels: transformers derives the packed layout from the
        restarting position ids (varlen flash attention; a sparse BlockMask for flex attention).
        """
        if kind.startswith("flash_attention") or kind == "flex_attention":
            return None
        seg = self.segment_ids().to(device)
        n = self.num_tokens
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        allowed = causal & (seg[:, None] == seg[None, :])
        allowed = allowed.view(1, 1, n, n)
        if kind == "sdpa":
            return allowed
        zero = torch.zeros((), dtype=dtype, device=device)
        minimum = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)
        return torch.where(allowed, zero, minimum)

    def _scored(self, k: int) -> Tensor:
        """Response-relative indices of the scored tokens of segment ``k``."""
        n = self.segments[k].response_length
        if self.score_masks is None:
            return torch.arange(n, dtype=torch.long)
        return torch.nonzero(self.score_masks[k][:n], as_tuple=False).flatten()

    def score_positions(self) -> Tensor:
        """Row positions whose hidden state scores a response token, in segment order."""
        parts = [s.offset + s.response_start - 1 + self._scored(k) for k, s in enumerate(self.segments)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def score_labels(self) -> Tensor:
        """The response tokens scored at :meth:`score_positions`."""
        parts = [self.input_ids[s.offset + s.response_start + self._scored(k)] for k, s in enumerate(self.segments)]
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
) -> list[PackedRow]:
    """Pack token sequences into rows; ``response_starts[i]`` is the prompt length of sequence ``i`` (>= 1).

    ``score_masks[i]`` (optional) marks the response tokens of sequence ``i`` that need scores.
    """
    if len(sequences) != len(response_starts):
        raise ValueError("one response start per sequence")
    if score_masks is not None and len(score_masks) != len(sequences):
        raise ValueError("one score mask per sequence")
    for i, (seq, start) in enumerate(zip(sequences, response_starts, strict=True)):
        if not 1 <= start <= len(seq):
            raise ValueError(f"sequence {i}: response start {start} outside [1, {len(seq)}] (a prompt is needed)")
    rows = []
    for indices in pack_lengths([len(s) for s in sequences], max_tokens):
        ids: list[int] = []
        positions: list[int] = []
        segments = []
        for i in indices:
            seq = list(sequences[i])
            segments.append(Segment(i, len(ids), len(seq), int(response_starts[i])))
            ids.extend(seq)
            positions.extend(range(len(seq)))
        masks = None if score_masks is None else [torch.as_tensor(score_masks[i]).bool() for i in indices]
        rows.append(
            PackedRow(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), segments, masks)
        )
    return rows


@dataclass
class SequenceOutputs:
    """Per-sequence outputs of a packed forward, each ``[response_length]``, aligned with the response ids."""

    logprobs: list[Tensor]
    entropy: list[Tensor] | None = None
    values: list[Tensor] | None = None


def _head_chunk(
    hidden: Tensor, labels: Tensor, head: Callable[[Tensor], Tensor], with_entropy: bool, entropy_grad: bool
) -> tuple[Tensor, Tensor]:
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


def row_hidden_states(decoder: nn.Module, row: PackedRow, attn_kind: str, dtype: torch.dtype, device: Any) -> Tensor:
    """The decoder's last hidden states ``[N, H]`` for one packed row."""
    input_ids = row.input_ids.to(device).unsqueeze(0)
    position_ids = row.position_ids.to(device).unsqueeze(0)
    mask = row.attention_mask(attn_kind, dtype=dtype, device=device)
    out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
    hidden: Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0]


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
    logp_all = torch.cat(logps)
    ent_all = torch.cat(ents)
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
