"""Sequence packing: the packed forward computes what separate forwards compute."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from agentgym.trainer import packing
from agentgym.trainer.packed_attention import PACKED_ATTENTION, AttentionSpan, register_packed_attention
from agentgym.trainer.packing import (
    MIN_SHARED_PREFIX,
    PackedRow,
    forward_packed,
    pack_lengths,
    pack_sequences,
    response_logprobs_unpacked,
)


def _load(folder: Path, attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    register_packed_attention()
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation=attn
    )
    return model.eval()


def test_pack_lengths_first_fit_decreasing() -> None:
    rows = pack_lengths([30, 50, 17, 64, 90, 5], 100)
    # decreasing: 90 -> row0 (10 left), 64 -> row1 (36), 50 -> row2 (50), 30 -> row1 (6), 17 -> row2 (33), 5 -> row0
    assert rows == [[4, 5], [3, 0], [1, 2]]
    assert sorted(i for row in rows for i in row) == list(range(6))
    # longer than a row: its own row
    assert pack_lengths([150, 10], 100) == [[0], [1]]
    with pytest.raises(ValueError):
        pack_lengths([1], 0)


def test_row_layout_positions_and_mask() -> None:
    [row] = pack_sequences([[5, 6, 7], [8, 9]], [1, 1], 10)
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1]
    mask = row.attention_mask("sdpa")
    assert mask is not None
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)
    additive = row.attention_mask("eager")
    assert additive is not None and additive.dtype == torch.float32
    assert torch.equal(additive[0, 0] == 0, expected)
    assert row.attention_mask("flash_attention_2") is None
    # response starts at 1: positions 0,1 score tokens 6,7 of sequence 0; position 3 scores 9
    assert row.score_positions().tolist() == [0, 1, 3]
    assert row.score_labels().tolist() == [6, 7, 9]
    with pytest.raises(ValueError):
        pack_sequences([[1, 2]], [0], 10)  # no prompt token


@pytest.mark.parametrize("attn", [PACKED_ATTENTION, "sdpa", "eager"])
def test_packed_logprobs_equal_unpacked(tiny_model: Path, attn: str) -> None:
    model = _load(tiny_model, attn)
    rng = random.Random(3)
    sequences = [[rng.randrange(100, 40000) for _ in range(n)] for n in (30, 50, 17, 64, 9)]
    starts = [10, 5, 16, 1, 4]
    rows = pack_sequences(sequences, starts, 100)
    assert any(len(r.segments) > 1 for r in rows)  # packing really happens
    seen = set()
    with torch.no_grad():
        for row in rows:
            out = forward_packed(model, row, with_entropy=True, chunk_tokens=7)
            assert out.entropy is not None
            for segment, logp, entropy in zip(row.segments, out.logprobs, out.entropy, strict=True):
                reference = response_logprobs_unpacked(model, sequences[segment.index], starts[segment.index])
                assert logp.shape == reference.shape == (len(sequences[segment.index]) - starts[segment.index],)
                torch.testing.assert_close(logp, reference, atol=1e-5, rtol=1e-5)
                assert bool((entropy > 0).all())
                seen.add(segment.index)
    assert seen == set(range(len(sequences)))


def test_without_block_mask_later_sequences_differ(tiny_model: Path) -> None:
    """The check above can fail: a plain causal mask over the row lets sequence 2 see sequence 1."""
    model = _load(tiny_model, "sdpa")
    rng = random.Random(5)
    sequences = [[rng.randrange(100, 40000) for _ in range(20)] for _ in range(2)]
    [row] = pack_sequences(sequences, [5, 5], 100)

    def plain_causal(kind: str, dtype: torch.dtype = torch.float32, device: object = None) -> torch.Tensor:
        n = row.num_tokens
        return torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n)

    leaky = PackedRow(row.input_ids, row.position_ids, row.segments)
    leaky.attention_mask = plain_causal  # type: ignore[method-assign]
    with torch.no_grad():
        good = forward_packed(model, row).logprobs[1]
        bad = forward_packed(model, leaky).logprobs[1]
        reference = response_logprobs_unpacked(model, sequences[row.segments[1].index], 5)
    torch.testing.assert_close(good, reference, atol=1e-5, rtol=1e-5)
    assert (bad - reference).abs().max() > 1e-3


def test_packed_gradients_match_unpacked(tiny_model: Path) -> None:
    model = _load(tiny_model, "sdpa")
    rng = random.Random(7)
    sequences = [[rng.randrange(100, 40000) for _ in range(n)] for n in (12, 18)]
    starts = [4, 6]
    [row] = pack_sequences(sequences, starts, 64)
    packed = forward_packed(model, row, checkpoint_chunks=True, chunk_tokens=5)
    sum(lp.sum() for lp in packed.logprobs).backward()  # type: ignore[union-attr]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = sum(response_logprobs_unpacked(model, s, st).sum() for s, st in zip(sequences, starts, strict=True))
    total.backward()  # type: ignore[union-attr]
    for name, param in model.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4)


def test_score_masks_restrict_the_head(tiny_model: Path) -> None:
    model = _load(tiny_model, "sdpa")
    rng = random.Random(9)
    sequences = [[rng.randrange(100, 40000) for _ in range(n)] for n in (16, 11)]
    starts = [6, 3]
    masks = [
        torch.tensor([1, 1, 0, 0, 1, 1, 1, 0, 0, 1], dtype=torch.bool),
        torch.tensor([0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.bool),
    ]
    [row] = pack_sequences(sequences, starts, 64, score_masks=masks)
    assert row.score_positions().numel() == 6 + 4
    with torch.no_grad():
        out = forward_packed(model, row, with_entropy=True)
    for k, segment in enumerate(row.segments):
        reference = response_logprobs_unpacked(model, sequences[segment.index], starts[segment.index])
        mask = masks[segment.index]
        torch.testing.assert_close(out.logprobs[k][mask], reference[mask], atol=1e-5, rtol=1e-5)
        assert bool((out.logprobs[k][~mask] == 0).all())
        assert out.entropy is not None and bool((out.entropy[k][~mask] == 0).all())


def test_shared_prompt_layout_positions_and_mask() -> None:
    # Sequences 0 and 1 start with the prompt [1, 2, 3]; sequence 2 has a prompt of its own.
    [row] = pack_sequences([[1, 2, 3, 10, 11], [1, 2, 3, 12], [4, 5, 6]], [3, 3, 2], 20, share_prompts=True)
    assert row.input_ids.tolist() == [1, 2, 3, 10, 11, 12, 4, 5, 6]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2]  # response 1 continues its prompt
    assert [s.shares_prompt for s in row.segments] == [False, True, False]
    mask = row.attention_mask("sdpa")
    assert mask is not None
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 1, 0, 0, 0],  # token 12: the shared prompt and itself, not response 0
            [0, 0, 0, 0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)
    # Token 12 is scored by the prompt's last token (position 2), token 6 by token 5.
    assert row.score_positions().tolist() == [2, 3, 2, 7]
    assert row.score_labels().tolist() == [10, 11, 12, 6]
    # sdpa_packed: the prompt with its first response is one causal span; token 12 sees the prompt, then itself.
    spans = row.attention_spans()
    assert spans == [AttentionSpan(0, 5), AttentionSpan(5, 6, ((0, 3),)), AttentionSpan(6, 9)]
    assert torch.equal(_dense_mask_of(spans, row.num_tokens), expected)
    with pytest.raises(ValueError, match="dense attention mask"):
        row.attention_mask("flash_attention_2")
    # Without sharing, the same sequences keep a prompt each.
    rows = pack_sequences([[1, 2, 3, 10, 11], [1, 2, 3, 12], [4, 5, 6]], [3, 3, 2], 20)
    assert sum(r.num_tokens for r in rows) == 12 and rows[0].attention_mask("flash_attention_2") is None


def test_prompts_of_a_row_share_their_common_prefix() -> None:
    system = list(range(1000, 1000 + MIN_SHARED_PREFIX + 2))  # 18 tokens every prompt starts with
    a, b = [*system, 1, 2], [*system, 3]
    sequences = [[*a, 10, 11], [*a, 12], [*b, 13, 14]]
    [row] = pack_sequences(sequences, [20, 20, 19], 100, share_prompts=True)
    # [system | 1 2 | 10 11 | 12 | 3 | 13 14]: the system prefix once, then each prompt's own tokens
    assert row.input_ids.tolist() == [*system, 1, 2, 10, 11, 12, 3, 13, 14]
    assert row.position_ids.tolist() == [*range(18), 18, 19, 20, 21, 20, 18, 19, 20]
    n = row.num_tokens
    assert n == 26
    # token 13 (row 24) is scored by b's last token (row 23); token 12 (row 22) by a's last (row 19)
    assert row.score_positions().tolist() == [19, 20, 19, 23, 24]
    assert row.score_labels().tolist() == [10, 11, 12, 13, 14]
    spans = row.attention_spans()
    assert spans == [
        AttentionSpan(0, 22),  # system, a's own tokens and a's first response: one causal span
        AttentionSpan(22, 23, ((0, 20),)),  # a's second response sees all of a's prompt
        AttentionSpan(23, 26, ((0, 18),)),  # b's own token and response, after the system prefix
    ]
    mask = row.attention_mask("sdpa")
    assert mask is not None and torch.equal(mask[0, 0], _dense_mask_of(spans, n))
    assert not mask[0, 0, 23, 18:23].any()  # b's own token does not see a's tokens
    with pytest.raises(ValueError, match="dense attention mask"):
        row.attention_mask("flash_attention_2")


def test_a_common_prefix_below_the_minimum_or_a_whole_prompt_is_not_shared() -> None:
    short = list(range(1000, 1000 + MIN_SHARED_PREFIX - 1))
    [row] = pack_sequences([[*short, 1, 10], [*short, 2, 20]], [16, 16], 100, share_prompts=True)
    assert row.num_tokens == 2 * 17 and all(s.prefix_length == 0 for s in row.segments)
    # one prompt is the start of the other: it keeps its last token (that scores its response)
    long = list(range(2000, 2048))
    [row] = pack_sequences([[*long[:20], 7], [*long, 8]], [20, 48], 200, share_prompts=True)
    # the longer block first: [long[:19] | long[19:48] | 8 | long[19] | 7]
    assert row.input_ids.tolist() == [*long, 8, long[19], 7]
    assert [s.prefix_length for s in row.segments] == [19, 19]
    assert row.score_labels().tolist() == [8, 7]
    assert row.score_positions().tolist() == [47, 49]


def test_shared_prompt_blocks_respect_the_row_size() -> None:
    prompt = list(range(100, 110))
    sequences = [prompt + [k] * 6 for k in range(5)]  # 10 + 5 x 6 = 40 tokens shared
    rows = pack_sequences(sequences, [10] * 5, 24, share_prompts=True)
    # A block holds the prompt and as many responses as fit in 24 tokens: 10 + 2 x 6 each, then 10 + 6.
    assert sorted(r.num_tokens for r in rows) == [16, 22, 22]
    assert sorted(s.index for r in rows for s in r.segments) == list(range(5))
    assert all(r.input_ids[:10].tolist() == prompt for r in rows)


def _assert_same_as_separate_forwards(
    model: torch.nn.Module,
    rows: list[PackedRow],
    sequences: list[list[int]],
    starts: list[int],
    masks: list[torch.Tensor],
    chunk_tokens: int,
) -> None:
    """The packed rows' scored log-probs, and the gradient of their sum, equal one plain forward per sequence."""
    total = torch.zeros(())
    for row in rows:
        out = forward_packed(model, row, with_entropy=True, chunk_tokens=chunk_tokens)
        for segment, logp in zip(row.segments, out.logprobs, strict=True):
            i = segment.index
            with torch.no_grad():
                reference = response_logprobs_unpacked(model, sequences[i], starts[i])
            torch.testing.assert_close(logp[masks[i]], reference[masks[i]], atol=1e-5, rtol=1e-5)
            total = total + logp.sum()
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    separate = sum(
        response_logprobs_unpacked(model, s, st)[m].sum() for s, st, m in zip(sequences, starts, masks, strict=True)
    )
    separate.backward()  # type: ignore[union-attr]
    for name, param in model.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("attn", [PACKED_ATTENTION, "sdpa", "eager"])
def test_shared_prompt_logprobs_and_gradients_equal_unpacked(tiny_model: Path, attn: str) -> None:
    model = _load(tiny_model, attn)
    rng = random.Random(11)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (14, 9)]
    responses = [[rng.randrange(100, 40000) for _ in range(n)] for n in (6, 1, 11, 7, 3)]
    owners = [0, 0, 0, 1, 1]  # three samples of prompt 0, two of prompt 1
    sequences = [prompts[o] + r for o, r in zip(owners, responses, strict=True)]
    starts = [len(prompts[o]) for o in owners]
    masks = [torch.tensor([k % 3 != 1 for k in range(len(r))]) for r in responses]
    rows = pack_sequences(sequences, starts, 64, score_masks=masks, share_prompts=True)
    assert sum(r.num_tokens for r in rows) == 14 + 9 + sum(len(r) for r in responses)
    _assert_same_as_separate_forwards(model, rows, sequences, starts, masks, chunk_tokens=4)


@pytest.mark.parametrize("attn", [PACKED_ATTENTION, "sdpa", "eager"])
def test_common_prefix_logprobs_and_gradients_equal_unpacked(tiny_model: Path, attn: str) -> None:
    model = _load(tiny_model, attn)
    rng = random.Random(12)
    system = [rng.randrange(100, 40000) for _ in range(MIN_SHARED_PREFIX + 5)]
    prompts = [system + [rng.randrange(100, 40000) for _ in range(n)] for n in (6, 1, 9)]
    responses = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 2, 8, 4, 3, 6)]
    owners = [0, 0, 1, 2, 2, 1]
    sequences = [prompts[o] + r for o, r in zip(owners, responses, strict=True)]
    starts = [len(prompts[o]) for o in owners]
    masks = [torch.tensor([k % 4 != 2 for k in range(len(r))]) for r in responses]
    [row] = pack_sequences(sequences, starts, 256, score_masks=masks, share_prompts=True)
    assert row.num_tokens == len(system) + 6 + 1 + 9 + sum(len(r) for r in responses)
    _assert_same_as_separate_forwards(model, [row], sequences, starts, masks, chunk_tokens=5)


def _dense_mask_of(spans: list[AttentionSpan], n: int) -> torch.Tensor:
    """The ``[n, n]`` mask that attending span by span amounts to."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for span in spans:
        mask[span.start : span.end, span.start : span.end] = torch.ones(
            span.end - span.start, span.end - span.start
        ).tril()
        for first, last in span.prefixes:
            mask[span.start : span.end, first:last] = True
    return mask


def test_attention_spans_amount_to_the_dense_mask() -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(100, 900) for _ in range(n)] for n in (7, 4, 9)]
    owners = [0, 0, 1, 2, 0, 2, 2, 1]
    sequences = [prompts[o] + [rng.randrange(100, 900) for _ in range(rng.randint(1, 6))] for o in owners]
    starts = [len(prompts[o]) for o in owners]
    for share in (True, False):
        for row in pack_sequences(sequences, starts, 30, share_prompts=share):
            dense = row.attention_mask("sdpa")
            assert dense is not None
            assert torch.equal(_dense_mask_of(row.attention_spans(), row.num_tokens), dense[0, 0])


def test_attention_spans_refuse_a_row_they_do_not_tile() -> None:
    [row] = pack_sequences([[1, 2, 3, 4], [5, 6, 7]], [2, 1], 20)
    gap = PackedRow(
        torch.cat([row.input_ids, torch.tensor([9])]), torch.cat([row.position_ids, torch.tensor([0])]), row.segments
    )
    with pytest.raises(ValueError, match="cover 7 of the row's 8 tokens"):
        gap.attention_spans()


def test_sdpa_packed_without_spans_is_sdpa(tiny_model: Path) -> None:
    """A plain forward (a padded batch, no packed row) takes sdpa's path with sdpa's mask."""
    packed, plain = _load(tiny_model, PACKED_ATTENTION), _load(tiny_model, "sdpa")
    ids = torch.tensor([[5, 6, 7, 8, 9], [2, 2, 10, 11, 12]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])  # the second row is left-padded
    with torch.no_grad():
        a = packed(input_ids=ids, attention_mask=attention).logits
        b = plain(input_ids=ids, attention_mask=attention).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_plain_linear_heads_take_the_fused_log_probs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    fused = packing.linear_token_logprobs

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(True)
        return fused(*args, **kwargs)

    monkeypatch.setattr(packing, "linear_token_logprobs", spy)
    hidden, labels = torch.randn(3, 4), torch.tensor([0, 5, 2])
    plain = torch.nn.Linear(4, 6, bias=False)
    expected = torch.log_softmax(plain(hidden), dim=-1).gather(1, labels[:, None])[:, 0]
    cases = [  # head, entropy with a gradient, fused
        (plain, False, True),
        (plain, True, False),  # an entropy bonus needs the logits' graph: the general path
        (torch.nn.Linear(4, 6, bias=True), False, False),
        (lambda h: plain(h), False, False),
    ]
    for head, entropy_grad, takes_fused in cases:
        calls.clear()
        logp, _ = packing._head_chunk(hidden, labels, head, with_entropy=True, entropy_grad=entropy_grad)
        assert bool(calls) == takes_fused
        if head is plain or not isinstance(head, torch.nn.Linear):
            torch.testing.assert_close(logp, expected)


def test_cpu_rows_and_scored_tokens_are_padded_to_the_shape_bucket(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU the decoder gets rows of a multiple of `CPU_SHAPE_BUCKET` tokens and the LM head a multiple of it of
    scored tokens (oneDNN reuses its kernels across rows); log-probs, entropies and gradients are those of the
    exact shapes: the padding is a span nothing sees, and its outputs are dropped."""
    model = _load(tiny_model, PACKED_ATTENTION)
    rng = random.Random(11)
    sequences = [[rng.randrange(100, 40000) for _ in range(n)] for n in (40, 27, 35)]
    starts = [12, 3, 30]
    [row] = pack_sequences(sequences, starts, 128)
    assert row.num_tokens % packing.CPU_SHAPE_BUCKET and row.score_positions().numel() % packing.CPU_SHAPE_BUCKET

    decoder_lengths: list[int] = []
    head_rows: list[int] = []
    fused = packing.linear_token_logprobs

    def head_spy(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        head_rows.append(hidden.shape[0])
        return fused(hidden, *args, **kwargs)

    monkeypatch.setattr(packing, "linear_token_logprobs", head_spy)
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: decoder_lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )

    def run(bucket: int) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor]]:
        monkeypatch.setattr(packing, "CPU_SHAPE_BUCKET", bucket)
        model.zero_grad()
        out = forward_packed(model, row, with_entropy=True, entropy_grad=False)  # the fused head, as in GRPO
        assert out.entropy is not None
        sum(lp.sum() for lp in out.logprobs).backward()  # type: ignore[union-attr]
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return [lp.detach() for lp in out.logprobs], list(out.entropy), grads

    exact = run(1)
    assert decoder_lengths == [row.num_tokens] and head_rows == [row.score_positions().numel()]
    decoder_lengths.clear()
    head_rows.clear()
    padded = run(64)
    assert decoder_lengths == [128] and head_rows == [64]  # 102 tokens -> 128; 57 scored -> 64
    hook.remove()
    for a, b in zip(padded[0] + padded[1], exact[0] + exact[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert padded[2].keys() == exact[2].keys()
    for name, grad in padded[2].items():
        torch.testing.assert_close(grad, exact[2][name], atol=1e-5, rtol=1e-4)
    assert packing._bucket_padding(100, "cuda") == 0  # GPUs build no kernels per shape: no padding there
