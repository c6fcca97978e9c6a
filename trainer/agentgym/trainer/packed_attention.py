"""``sdpa_packed``: attention over a packed row that computes only the blocks a token may see.

A packed row (``agentgym.trainer.packing``) holds several sequences, and with shared prompts one
prompt followed by all its responses. With plain ``sdpa`` that layout is a dense boolean
``[N, N]`` mask, and the kernel scores every query against every key of the row: for a BabyAI GRPO
row (one ~380-token prompt and 8 responses of ~200 tokens) about three quarters of those scores
are masked out, and attention was 40 % of the update's time on CPU.

Here the row is cut into spans that tile it in order, and each span attends only to what it may:

- a *causal span* ``[start, end)``: a sequence, or a shared prompt together with its first response
  (which follows it in the row), attends causally to itself (``is_causal``, no mask);
- a *prefixed span*: a later response of a shared prompt attends to the whole prompt and causally
  to itself (a ``[r, p + r]`` mask); the prefix may be several ranges of the row (a prompt whose
  start is the row's common prefix and whose rest sits further on).

Per layer that is one small ``scaled_dot_product_attention`` per span; the outputs are concatenated
in row order. The result is what the dense mask gives (tested), at ``O(sum r * (p + r))`` instead
of ``O(N^2)``.

The layout reaches the attention function as the ``packed_spans`` keyword of the decoder's forward
(transformers hands extra keywords down to the attention interface). Without it (a plain forward,
``generate``) the function is exactly ``sdpa``: it is registered with sdpa's mask builder too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PACKED_ATTENTION", "AttentionSpan", "packed_sdpa_attention", "register_packed_attention"]

PACKED_ATTENTION = "sdpa_packed"


@dataclass(frozen=True)
class AttentionSpan:
    """Row positions ``[start, end)`` that attend causally to themselves, after all of ``prefixes`` (if any)."""

    start: int
    end: int
    prefixes: tuple[tuple[int, int], ...] = ()  # [first, last) ranges before the span, seen whole, in order

    @property
    def prefix_length(self) -> int:
        return sum(last - first for first, last in self.prefixes)

    def mask(self, device: torch.device) -> Tensor:
        """``[r, p + r]`` boolean mask of a prefixed span: the whole prefix, then causal over the span."""
        r = self.end - self.start
        p = self.prefix_length
        causal = torch.ones(r, r, dtype=torch.bool, device=device).tril()
        return torch.cat([torch.ones(r, p, dtype=torch.bool, device=device), causal], dim=1)


def packed_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_spans: list[AttentionSpan] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention of ``query [B, H, N, D]`` over ``key``/``value [B, H_kv, N, D]`` span by span.

    Returns ``[B, N, H, D]`` as transformers' attention functions do. Without ``packed_spans`` it
    is transformers' sdpa with the mask it was given.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[2] != key.shape[2] or (packed_spans and packed_spans[-1].end != query.shape[2]):
        raise ValueError("packed_spans must tile the row, and the row is attended without a cache")
    gqa = query.shape[1] != key.shape[1]
    dropout_p = dropout if module.training else 0.0
    outputs = []
    for span in packed_spans:
        q = query[:, :, span.start : span.end]
        k = key[:, :, span.start : span.end]
        v = value[:, :, span.start : span.end]
        if not span.prefixes:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        else:
            k = torch.cat([key[:, :, first:last] for first, last in span.prefixes] + [k], dim=2)
            v = torch.cat([value[:, :, first:last] for first, last in span.prefixes] + [v], dim=2)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=span.mask(query.device), dropout_p=dropout_p, scale=scaling, enable_gqa=gqa
            )
        outputs.append(out)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def register_packed_attention() -> None:
    """Make ``attn_implementation="sdpa_packed"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
