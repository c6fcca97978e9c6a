"""Supervised fine-tuning: one optimiser step of token-mean cross-entropy on examples' masked-in tokens.

``L = -(1 / |T|) sum_{t in T} log pi(y_t | y_<t)`` over T, the tokens whose ``loss_mask`` is 1 (the
SFT warm-up on expert demonstrations, rejection sampling's successes).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from torch.nn.utils.rnn import pad_sequence

from agentgym.trainer.batch import SFTExample, example_batch
from agentgym.trainer.policy import Policy

__all__ = ["sft_step"]


def sft_step(examples: Sequence[SFTExample], policy: Policy, learning_rate: float) -> dict[str, float]:
    """One optimiser step at ``learning_rate``; the loss, grad norm and throughput."""
    if not examples:
        raise ValueError("sft_step needs at least one example")
    batch = example_batch(examples)
    total = float(batch.mask.sum())
    loss_sum, tokens = 0.0, 0
    with policy.learning_rate(learning_rate):
        started = time.perf_counter()
        mine = policy.my_rows(policy.pack(batch, range(batch.size)))
        for r, entry in enumerate(mine):
            last = r == len(mine) - 1
            if entry is None:  # this rank has fewer rows than another (see Policy.idle_backward)
                policy.idle_backward(last)
                continue
            row, idx = entry
            out = policy.forward(policy.model, row, with_entropy=False)
            width = max(batch.lengths[b] for b in idx)
            lp = pad_sequence(out.logprobs, batch_first=True)[:, :width]
            nll = -(lp * batch.mask[idx, :width].to(lp.device)).sum() / max(total, 1.0)
            policy.engine.backward(nll * policy.dp.world_size, last)  # a sum over the ranks, as in actor.update
            loss_sum += float(nll.detach())
            tokens += row.num_tokens
        grad_norm = policy.engine.step()
        elapsed = time.perf_counter() - started
    if policy.dp.enabled:
        parts = policy.dp.gather((loss_sum, tokens, elapsed))
        loss_sum, tokens = sum(p[0] for p in parts), sum(p[1] for p in parts)
        elapsed = max(p[2] for p in parts)
    return {
        "sft_loss": loss_sum,
        "grad_norm": grad_norm,
        "tokens": float(tokens),
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "sampled_tokens": total,
    }
