"""Shared prompt prefixes read once a decode step: `batching.shared_prefixes` (which rows share what),
`decoder.cascade_attention` (attending a prefix and each row's own columns apart, then merging), and the engine
sampling what it samples without them."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from agentgym.inference import batching as batching_module
from agentgym.inference import decoder as decoder_module
from agentgym.inference.batching import MIN_SHARED_PREFIX, shared_prefixes
from agentgym.inference.decoder import ForwardHelper, PrefixSegment, SharedPrefixes, cascade_attention
from agentgym.inference.engine import CASCADE_ATTENTION_VARIABLE, Engine
from agentgym.inference.kv import compaction
from agentgym.inference.models import tiny_model_dir
from agentgym.inference.prefix_cache import BLOCK_SIZE
from agentgym.inference.sampling import SamplingParams

COLUMNS = 14
HEAD_DIM = 8

# One decode step's cache, 6 rows x 14 columns (P: a shared prefix's token, o: the row's own, .: padding; the
# last column is the step's own token). Rows 0 and 1 share prefix A (6 tokens; row 1 holds it with a gap), rows 2
# and 5 prefix B (5 tokens), row 3 shares nothing, row 4 is short.
LAYOUT = [
    "..AAAAAAoooooo",
    "AAA.AAAooooooo",
    "...BBBBBoooooo",
    "oooooooooooooo",
    "..........oooo",
    ".BBBBB.ooooooo",
]


def cache_of(layout: list[str], kv_heads: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random keys/values `[rows, kv_heads, columns, d]` where the k-th token of a prefix holds the same key and
    value in every row that has it; and the mask."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(layout)
    keys = torch.randn(rows, kv_heads, COLUMNS, HEAD_DIM, generator=generator)
    values = torch.randn(rows, kv_heads, COLUMNS, HEAD_DIM, generator=generator)
    prefixes = {name: torch.randn(2, kv_heads, 8, HEAD_DIM, generator=generator) for name in "AB"}
    for row, line in enumerate(layout):
        token = 0
        for column, cell in enumerate(line):
            if cell in prefixes:
                keys[row, :, column] = prefixes[cell][0, :, token]
                values[row, :, column] = prefixes[cell][1, :, token]
                token += 1
    mask = torch.tensor([[cell != "." for cell in line] for line in layout], dtype=torch.long)
    return keys, values, mask


def by_formula(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V over each row's real columns, in float64, one query head at a time."""
    batch, heads = q.shape[:2]
    group = heads // keys.shape[1]
    out = torch.zeros(batch, heads, 1, HEAD_DIM, dtype=torch.float64)
    for row in range(batch):
        columns = mask[row].nonzero().squeeze(1)
        for head in range(heads):
            k = keys[row, head // group, columns].double()
            v = values[row, head // group, columns].double()
            scores = k @ q[row, head, 0].double() / math.sqrt(HEAD_DIM)
            out[row, head, 0] = torch.softmax(scores, dim=0) @ v
    return out


def hand_shared(mask: torch.Tensor) -> SharedPrefixes:
    """The layout's prefixes, by hand: the window starts at the smallest column after a prefix (row 5's 6); row 3
    reads its columns before it as a segment of its own; row 4 starts after it."""
    segments = [
        PrefixSegment([0, 1], 1, 0, 7),  # row 1's columns 0-6, the gap at 3 included (masked)
        PrefixSegment([2, 5], 2, 3, 8),
        PrefixSegment([3], 3, 0, 6),
    ]
    own_start = torch.tensor([8, 7, 8, 6, 10, 6])
    return SharedPrefixes(segments, own_start, 6, mask)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    shared: SharedPrefixes,
    mask: torch.Tensor,
    helper: ForwardHelper | None = None,
) -> torch.Tensor:
    """`cascade_attention` of layer 0 for a decode step whose cache mask is `mask` (float32)."""
    window, segments = shared.window_mask(mask, torch.float32), shared.segment_mask(torch.float32)
    return cascade_attention(q, keys, values, shared, 0, window, segments, HEAD_DIM**-0.5, helper)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("with_helper", [False, True], ids=["one-thread", "helper"])
def test_cascade_attention_is_the_attention_over_each_rows_whole_cache(kv_heads: int, with_helper: bool) -> None:
    keys, values, mask = cache_of(LAYOUT, kv_heads)
    q = torch.randn(len(LAYOUT), 4, 1, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    shared = hand_shared(mask)
    assert shared.padding is not None and shared.padding[0, 0, 0].tolist() == [False] * 3 + [True] + [False] * 3
    helper = ForwardHelper() if with_helper else None
    try:
        got = attend(q, keys, values, shared, mask, helper)
    finally:
        if helper is not None:
            helper.close()
    expected = by_formula(q, keys, values, mask)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # The engine's attention of the whole rows, the reference it replaces.
    allowed = mask.bool()[:, None, None, :]
    whole = decoder_module.shared_attention(q, keys, values, allowed, HEAD_DIM**-0.5, None)
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)


def test_the_window_mask_hides_each_rows_segment_and_padding_but_never_its_own_token() -> None:
    _, _, mask = cache_of(LAYOUT, 1)
    shared = hand_shared(mask)
    window = shared.window_mask(mask, torch.float32)[:, 0, 0]  # columns 6..13
    visible = [[int(value == 0) for value in row] for row in window.tolist()]
    assert visible == [
        [0, 0, 1, 1, 1, 1, 1, 1],  # row 0: prefix A to column 7
        [0, 1, 1, 1, 1, 1, 1, 1],  # row 1: its own from 7
        [0, 0, 1, 1, 1, 1, 1, 1],  # row 2: prefix B to column 7
        [1, 1, 1, 1, 1, 1, 1, 1],  # row 3: its segment ends at 6
        [0, 0, 0, 0, 1, 1, 1, 1],  # row 4: padding to 9
        [0, 1, 1, 1, 1, 1, 1, 1],  # row 5: column 6 is padding
    ]


def test_prefixes_survive_rows_leaving_from_their_copies_even_the_row_that_held_one() -> None:
    keys, values, mask = cache_of(LAYOUT, 2)
    q = torch.randn(len(LAYOUT), 4, 1, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    shared = hand_shared(mask)
    unused = shared.kept([0, 1, 2], 0)
    assert unused is None  # not copied yet: the rows holding a segment may be gone, find them again
    attend(q, keys, values, shared, mask)
    shared.copied = True
    # Rows 0, 2 (prefix B's holder) and 3 leave: rows 4 and 5 move into their places, row 1 stays with A.
    keep = [1, 4, 5]
    order, _, _ = compaction(keep, len(LAYOUT))
    assert order == [4, 1, 5]
    index = torch.tensor(order)
    kept_mask = mask.index_select(0, index)
    kept = shared.kept(order, 0)  # row 1's column 0 is real: none dropped
    assert kept is not None and kept.copied
    assert [part.rows for part in kept.segments] == [[1], [2]]  # A for row 1, B for old row 5; row 3's is gone
    assert kept.own_start.tolist() == [10, 7, 6] and kept.window == 6
    got = attend(q.index_select(0, index), keys.index_select(0, index), values.index_select(0, index), kept, kept_mask)
    # Row 2's keys are gone from the batch: prefix B comes from the copy.
    expected = by_formula(
        q.index_select(0, index), keys.index_select(0, index), values.index_select(0, index), kept_mask
    )
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert shared.kept([4], 0) is None  # row 4 shares nothing
    dropped = shared.kept([1, 4], 4)  # only rows 1 and 4 left, had columns 0-3 been padding in both
    assert dropped is not None and dropped.own_start.tolist() == [3, 6] and dropped.window == 3
    dropped = shared.kept([1, 4], 4)  # had rows 0, 2, 3 and 5 left and columns 0-3 become padding in both
    assert dropped is not None and dropped.own_start.tolist() == [3, 6] and dropped.window == 3


def sequence(prompt: list[int], sampled: int = 1) -> Any:
    """What `shared_prefixes` reads of a running sequence: its request's prompt and its sampled ids."""
    return SimpleNamespace(request=SimpleNamespace(prompt_ids=prompt, prompt_blocks=None), token_ids=[7] * sampled)


def distinct(seed: int, length: int) -> list[int]:
    return [1000 * seed + i for i in range(length)]


def test_rows_are_grouped_by_the_shared_prompt_prefix_that_saves_the_most_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batching_module, "SEGMENT_COST_COLUMNS", 0)  # six rows: whatever saves a read is taken
    common = distinct(1, 64)  # 4 blocks every row has
    task = common + distinct(2, 99)  # rows 0-2: 163 tokens in common (10 blocks and 3 tokens)
    other = common + distinct(3, 32)  # rows 3 and 4: 96 in common (6 blocks)
    prompts = [
        task + distinct(10, 40),
        task + distinct(11, 20),
        task + distinct(12, 30),
        other + distinct(13, 50),
        other + distinct(14, 50),
        common + distinct(15, 70),
    ]
    sequences = [sequence(prompt, sampled=3) for prompt in prompts]
    lengths = [len(prompt) + 2 for prompt in prompts]  # prompt and sampled ids but the last
    columns = max(lengths)
    mask = torch.zeros(len(prompts), columns, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, columns - length :] = 1
    shared = shared_prefixes(sequences, mask)
    assert shared is not None
    # Rows 0-2: 10 shared blocks among 3 (2/3 x 10) beat 4 among 6 (5/6 x 4); rows 3 and 4: 4 among 6 beat 6
    # among 2 (1/2 x 6), so they read the common prefix with row 5.
    assert [(part.rows, part.row) for part in shared.segments] == [([0, 1, 2], 0), ([3, 4, 5], 3)]
    first = [columns - length for length in lengths]
    assert [(part.start, part.end) for part in shared.segments] == [
        (first[0], first[0] + 163),
        (first[3], first[3] + 64),
    ]
    expected_own = [first[row] + (163 if row < 3 else 64) for row in range(6)]
    assert shared.own_start.tolist() == expected_own
    assert shared.window == min(expected_own)
    assert all(sequence.request.prompt_blocks is not None for sequence in sequences)  # kept for the next time


def test_nothing_is_shared_when_no_prefix_is_long_enough_or_it_would_save_too_little() -> None:
    short = distinct(1, MIN_SHARED_PREFIX - BLOCK_SIZE)
    sequences = [sequence(short + distinct(2 + row, 100)) for row in range(3)]
    mask = torch.ones(3, len(short) + 100, dtype=torch.long)
    assert shared_prefixes(sequences, mask) is None
    common = distinct(1, MIN_SHARED_PREFIX)
    sequences = [sequence(common + distinct(2 + row, 2000)) for row in range(2)]  # 64 of 2,064 columns: no gain
    assert shared_prefixes(sequences, torch.ones(2, len(common) + 2000, dtype=torch.long)) is None
    one = [sequence(common + distinct(2, 100))]
    assert shared_prefixes(one, torch.ones(1, len(common) + 100, dtype=torch.long)) is None


async def _play(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple[list[int], list[float]]]:
    outputs = await asyncio.gather(
        *(
            engine.generate(prompt, SamplingParams(max_tokens=tokens, temperature=1.0, seed=row, ignore_eos=True))
            for row, (prompt, tokens) in enumerate(zip(prompts, max_tokens, strict=True))
        )
    )
    return [(out.samples[0].token_ids, out.samples[0].logprobs) for out in outputs]


def test_an_engine_reading_shared_prompts_once_samples_what_it_samples_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three tasks' prompts, three samples each, leaving at different steps (rows leave with their prefixes'
    copies kept): the same tokens and logprobs as attending every row's whole cache (float32: the two differ by
    float rounding only; bf16's rounding of the attention's output is checked on logits below)."""
    tasks = [distinct(seed, 120) for seed in (1, 2, 3)]
    prompts = [task + distinct(10 + row, 5 + row) for row, task in enumerate(tasks * 3)]
    max_tokens = [4 + 3 * row for row in range(len(prompts))]
    calls = {"cascade": 0, "kept": 0}
    cascade, kept = decoder_module.cascade_attention, SharedPrefixes.kept

    def counted_cascade(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["cascade"] += 1
        return cascade(*args, **kwargs)

    def counted_kept(self: SharedPrefixes, *args: Any) -> SharedPrefixes | None:
        result = kept(self, *args)
        calls["kept"] += result is not None
        return result

    monkeypatch.setattr(decoder_module, "cascade_attention", counted_cascade)
    monkeypatch.setattr(SharedPrefixes, "kept", counted_kept)
    results = {}
    for enabled in ("1", "0"):
        monkeypatch.setenv(CASCADE_ATTENTION_VARIABLE, enabled)
        engine = Engine(tiny_model_dir(), device="cpu", max_batch_size=16, batch_window_ms=200)
        try:
            assert engine._cascade == (enabled == "1")
            results[enabled] = asyncio.run(_play(engine, prompts, max_tokens))
        finally:
            engine.close()
        if enabled == "1":
            assert calls["cascade"] > 0 and calls["kept"] > 0
            used = dict(calls)
    assert calls == used  # none without
    for (tokens, logprobs), (plain_tokens, plain_logprobs) in zip(results["1"], results["0"], strict=True):
        assert tokens == plain_tokens
        assert logprobs == pytest.approx(plain_logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "matmuls", ["float32", "bf16-float32-attention", "bf16-bf16-attention"], ids=lambda matmuls: matmuls
)
def test_a_decode_step_reading_shared_prefixes_once_gives_the_logits_of_whole_rows(
    monkeypatch: pytest.MonkeyPatch, matmuls: str
) -> None:
    """The lean forward's decode step with and without `shared`, from the same prefilled cache: equal logits up to
    float rounding; with bf16 matmuls, up to a bf16 rounding step of the attention's output (rounded to bf16 for
    the output projection, where a float-rounding difference can land it one step away)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from agentgym.inference import weights as weights_module
    from agentgym.inference.decoder import LeanDecoder
    from agentgym.inference.kv import GrowingLayer

    monkeypatch.setattr(batching_module, "SEGMENT_COST_COLUMNS", 0)
    monkeypatch.setattr(weights_module, "cpu_has_bf16_units", lambda: True)
    monkeypatch.setattr(decoder_module, "attention_in_float32", lambda *args: matmuls != "bf16-bf16-attention")
    low = None if matmuls == "float32" else torch.bfloat16
    if low is not None and not decoder_module._onednn_bf16():
        pytest.skip("oneDNN has no native bf16 matmul on this CPU")
    task = distinct(1, 80)
    prompts = [task + distinct(2, 12), task + distinct(3, 5), task + distinct(4, 20), distinct(5, 90)]
    columns = max(len(prompt) for prompt in prompts)
    ids = torch.zeros(len(prompts), columns, dtype=torch.long)
    mask = torch.zeros(len(prompts), columns, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, columns - len(prompt) :] = torch.tensor(prompt) % 1000
        mask[row, columns - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    sequences = [sequence(prompt) for prompt in prompts]  # one sampled id, not yet fed: the cache is the prompt
    step_ids = torch.tensor([[11], [12], [13], [14]])
    step_mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
    step_positions = mask.sum(1, keepdim=True)
    logits = {}
    for reading in ("shared", "whole"):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir()), dtype=torch.float32).eval()
        lean = LeanDecoder(model, low)
        assert lean.kv_dtype == (torch.bfloat16 if matmuls == "bf16-bf16-attention" else torch.float32)
        cache = DynamicCache(config=model.config)
        for index in range(len(cache.layers)):
            cache.layers[index] = GrowingLayer()
        lean.forward(ids, mask, positions, cache)
        shared = shared_prefixes(sequences, mask) if reading == "shared" else None
        if reading == "shared":
            assert shared is not None and [part.rows for part in shared.segments] == [[0, 1, 2], [3]]
        logits[reading] = lean.forward(step_ids, step_mask, step_positions, cache, shared)
    gap = (logits["shared"] - logits["whole"]).abs().max().item()
    assert gap <= (1e-4 if low is None else 0.05), gap
