"""The HF engine: token invariants, logprob semantics, sampling, stop conditions, batching, weight swaps."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agentgym.inference import engine as engine_module
from agentgym.inference.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    EngineClosedError,
    EngineError,
    InvalidRequestError,
    SamplingParams,
    StaleVersionError,
    WeightLoadError,
    sample_tokens,
)
from agentgym.inference.sampling import (
    CDF_BLOCK,
    SliceWeights,
    _inverse_cdf_and_totals,
    choose_tokens,
    fill_slice_weights,
)

Rescore = Callable[[torch.nn.Module, list[int], list[int]], list[float]]
TOLERANCE = 1e-4


def prompt_of(engine: Engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


async def greedy(engine: Engine, prompt: list[int], max_tokens: int = 8, **kwargs: object) -> list[int]:
    out = await engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs))  # type: ignore[arg-type]
    return out.samples[0].token_ids


async def test_sampled_ids_and_raw_logprobs_match_a_rescoring_forward_pass(engine: Engine, rescore: Rescore) -> None:
    prompt = prompt_of(engine, "The agent opens the door and")
    for params in (
        SamplingParams(max_tokens=10, temperature=1.0, seed=3),
        SamplingParams(max_tokens=10, temperature=0.6, top_p=0.5, seed=4),  # reported logprobs stay unscaled
        SamplingParams(max_tokens=10, temperature=0.0),
    ):
        out = await engine.generate(prompt, params)
        [sample] = out.samples
        assert len(sample.token_ids) == len(sample.logprobs) == 10
        assert all(0 <= t < engine.vocab_size for t in sample.token_ids)
        expected = rescore(engine.model, prompt, sample.token_ids)
        assert max(abs(a - b) for a, b in zip(sample.logprobs, expected, strict=True)) < TOLERANCE
        assert out.prompt_tokens == len(prompt)
        assert out.completion_tokens == 10
        assert sample.finish_reason == FINISH_LENGTH


async def test_greedy_is_the_argmax_and_deterministic(engine: Engine) -> None:
    prompt = prompt_of(engine, "Pick up the red ball")
    first = await greedy(engine, prompt, 6)
    assert first == await greedy(engine, prompt, 6)
    ids = torch.tensor([prompt + first[:2]])
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0]
    assert int(logits[len(prompt) - 1].argmax()) == first[0]
    assert int(logits[len(prompt) + 1].argmax()) == first[2]


async def test_seeds_reproduce_and_differ(engine: Engine) -> None:
    prompt = prompt_of(engine, "go to the green key")
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    a = (await engine.generate(prompt, params)).samples[0].token_ids
    b = (await engine.generate(prompt, params)).samples[0].token_ids
    c = (await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=12))).samples[0].token_ids
    assert a == b
    assert a != c


async def test_n_samples_are_independent_and_aligned(engine: Engine, rescore: Rescore) -> None:
    prompt = prompt_of(engine, "craft 4 oak planks")
    out = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=5))
    assert [s.index for s in out.samples] == [0, 1, 2, 3]
    assert len({tuple(s.token_ids) for s in out.samples}) == 4
    for sample in out.samples:
        expected = rescore(engine.model, prompt, sample.token_ids)
        assert max(abs(a - b) for a, b in zip(sample.logprobs, expected, strict=True)) < TOLERANCE
    again = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=5))
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in out.samples]


async def test_stop_token_ids_end_the_sample_and_are_kept(engine: Engine) -> None:
    prompt = prompt_of(engine, "inventory")
    ids = await greedy(engine, prompt, 10)
    stop = ids[3]
    out = await engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop,)))
    [sample] = out.samples
    cut = ids.index(stop) + 1
    assert sample.token_ids == ids[:cut]
    assert sample.finish_reason == FINISH_STOP
    assert sample.stop_reason == stop


async def test_eos_ends_the_sample_unless_ignored(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = prompt_of(engine, "look around")
    ids = await greedy(engine, prompt, 8)
    eos = ids[2]
    monkeypatch.setattr(engine, "eos_token_ids", frozenset({eos}))
    [sample] = (await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))).samples
    assert sample.token_ids == ids[: ids.index(eos) + 1]
    assert (sample.finish_reason, sample.stop_reason) == (FINISH_STOP, None)
    [ignored] = (await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))).samples
    assert ignored.token_ids == ids
    assert ignored.finish_reason == FINISH_LENGTH


async def test_stop_strings_cut_text_but_keep_the_sampled_ids(engine: Engine) -> None:
    prompt = prompt_of(engine, "The answer is")
    ids = await greedy(engine, prompt, 12)
    tokenizer = engine.tokenizer
    full_text = tokenizer.decode(ids, skip_special_tokens=True)
    piece = next(
        tokenizer.decode([t], skip_special_tokens=True).strip()
        for t in ids[2:]
        if tokenizer.decode([t], skip_special_tokens=True).strip()
    )
    stop = piece[: max(1, len(piece) // 2 + 1)]
    # The first prefix of the sampled ids whose text contains the stop string.
    cut = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))
    out = await engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop=(stop, "\x00never")))
    [sample] = out.samples
    assert sample.token_ids == ids[:cut]
    assert sample.text == full_text[: full_text.find(stop)]
    assert sample.finish_reason == FINISH_STOP
    assert sample.stop_reason == stop


async def test_text_is_the_incremental_decoding_of_the_ids(engine: Engine) -> None:
    prompt = prompt_of(engine, "café 日本語")
    out = await engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=2))
    [sample] = out.samples
    assert sample.text == engine.tokenizer.decode(sample.token_ids, skip_special_tokens=True)


async def test_concurrent_requests_share_forward_passes(engine: Engine) -> None:
    prompts = [prompt_of(engine, "step " * (i + 1)) for i in range(12)]
    before = (engine.stats.prefill_batches, engine.stats.decode_steps, engine.stats.requests)
    outs = await asyncio.gather(
        *(engine.generate(p, SamplingParams(max_tokens=6, temperature=1.0, seed=i)) for i, p in enumerate(prompts))
    )
    prefills = engine.stats.prefill_batches - before[0]
    decodes = engine.stats.decode_steps - before[1]
    assert engine.stats.requests - before[2] == 12
    assert all(len(o.samples[0].token_ids) == 6 for o in outs)
    assert prefills < 12  # served in fewer forward batches than requests
    assert decodes < 12 * 5  # one-at-a-time would need 5 decode steps per request
    assert engine.stats.max_running > 1


async def test_batched_and_staggered_results_equal_solo_results(engine: Engine, rescore: Rescore) -> None:
    prompts = [prompt_of(engine, "go " * (2 * i + 1)) for i in range(5)]
    solo = [await greedy(engine, p, 8) for p in prompts]

    async def later(i: int, prompt: list[int]) -> list[int]:
        await asyncio.sleep(0.05 * i)  # join a running batch at different decode steps
        return await greedy(engine, prompt, 8)

    staggered = await asyncio.gather(*(later(i, p) for i, p in enumerate(prompts)))
    batched = await asyncio.gather(*(greedy(engine, p, 8) for p in prompts))
    assert staggered == solo
    assert batched == solo
    seeded = await asyncio.gather(
        *(engine.generate(p, SamplingParams(max_tokens=8, temperature=1.0, seed=7)) for p in prompts)
    )
    for prompt, out in zip(prompts, seeded, strict=True):
        sample = out.samples[0]
        expected = rescore(engine.model, prompt, sample.token_ids)
        assert max(abs(a - b) for a, b in zip(sample.logprobs, expected, strict=True)) < TOLERANCE
        alone = await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=7))
        assert alone.samples[0].token_ids == sample.token_ids  # same seed, same draws, batched or not


async def test_top_logprobs_are_the_most_likely_raw_tokens(engine: Engine) -> None:
    prompt = prompt_of(engine, "toggle")
    out = await engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0, top_logprobs=3))
    [sample] = out.samples
    assert sample.top_logprobs is not None and len(sample.top_logprobs) == 3
    for token, logprob, top in zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)  # greedy picked the most likely token


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([1] * 8190, SamplingParams(max_tokens=10), "context"),
        ([1, 2], SamplingParams(n=0), "n must be"),
        ([1, 2], SamplingParams(n=17), "n must be"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=0), "top_p"),
        ([1, 99_999], SamplingParams(), "vocabulary"),
        ([1, 2], SamplingParams(stop_token_ids=(-3,)), "stop_token_ids"),
    ],
)
async def test_invalid_requests_are_rejected(
    engine: Engine, prompt: list[int], params: SamplingParams, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        await engine.generate(prompt, params)


async def test_weight_swap_changes_outputs_and_version(
    fresh_engine: Engine, other_tiny_dir: Path, rescore: Rescore
) -> None:
    engine = fresh_engine
    prompt = prompt_of(engine, "open the door")
    before = await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    old_model = engine.model

    # A long request is running while the new weights load: it finishes on the old weights.
    steps = engine.stats.decode_steps
    running = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0)))
    while engine.stats.decode_steps <= steps:
        await asyncio.sleep(0.01)
    assert not running.done()
    assert await engine.load_weights(str(other_tiny_dir), 1) == 1
    assert running.done()  # the swap waited for the running batch
    in_flight = await running
    assert in_flight.policy_version == 0
    assert in_flight.samples[0].token_ids[:8] == before.samples[0].token_ids
    expected = rescore(old_model, prompt, in_flight.samples[0].token_ids)
    assert max(abs(a - b) for a, b in zip(in_flight.samples[0].logprobs, expected, strict=True)) < TOLERANCE

    after = await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    assert engine.policy_version == after.policy_version == 1
    assert after.samples[0].token_ids != before.samples[0].token_ids
    expected = rescore(engine.model, prompt, after.samples[0].token_ids)
    assert max(abs(a - b) for a, b in zip(after.samples[0].logprobs, expected, strict=True)) < TOLERANCE
    assert engine.metrics.registry.get_sample_value("agentgym_inference_policy_version") == 1


async def test_bad_weights_keep_the_old_ones_serving(fresh_engine: Engine, tmp_path: Path) -> None:
    engine = fresh_engine
    prompt = prompt_of(engine, "open the door")
    before = await greedy(engine, prompt, 6)
    wrong = {"model.embed_tokens.weight": torch.zeros(10, 4)}
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    (tmp_path / "not-a-model").mkdir()
    for uri in (str(tmp_path / "missing"), str(tmp_path / "not-a-model"), f"file://{tmp_path}/wrong.safetensors"):
        with pytest.raises(WeightLoadError):
            await engine.load_weights(uri, 1)
    assert engine.policy_version == 0
    assert await greedy(engine, prompt, 6) == before


async def test_state_dict_files_load_and_stale_versions_are_refused(
    fresh_engine: Engine, other_tiny_dir: Path, tmp_path: Path
) -> None:
    engine = fresh_engine
    prompt = prompt_of(engine, "open the door")
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(str(other_tiny_dir))
    state = {k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "step-3.safetensors"))
    expected = await greedy(engine, prompt, 6)
    assert await engine.load_weights(f"file://{tmp_path}/step-3.safetensors", 3) == 3
    changed = await greedy(engine, prompt, 6)
    assert changed != expected
    with pytest.raises(StaleVersionError):
        await engine.load_weights(f"file://{tmp_path}/step-3.safetensors", 2)
    assert engine.policy_version == 3
    torch.save(state, tmp_path / "step-4.pt")
    assert await engine.load_weights(str(tmp_path / "step-4.pt"), 4) == 4
    assert await greedy(engine, prompt, 6) == changed


async def test_a_cancelled_request_leaves_the_batch(engine: Engine) -> None:
    prompt = prompt_of(engine, "wait")
    task = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_tokens=200, temperature=0.0)))
    steps = engine.stats.decode_steps
    while engine.stats.decode_steps < steps + 2:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    out = await engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out.samples[0].token_ids) == 3
    assert engine.stats.decode_steps < steps + 100


@pytest.mark.parametrize(
    ("temperature", "top_p", "expected"),
    [
        (1.0, 1.0, [0.5, 0.3, 0.2]),
        (0.5, 1.0, [25 / 38, 9 / 38, 4 / 38]),  # p^(1/T), renormalised
        (1.0, 0.75, [0.625, 0.375, 0.0]),  # the nucleus {0, 1} reaches 0.8 >= 0.75
        (1.0, 0.4, [1.0, 0.0, 0.0]),
    ],
)
def test_sampler_draws_from_the_tempered_nucleus(temperature: float, top_p: float, expected: list[float]) -> None:
    draws = 4000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(draws, 1)
    generators = [torch.Generator().manual_seed(i) for i in range(draws)]
    tokens = sample_tokens(logits, [temperature] * draws, [top_p] * draws, generators)
    frequencies = torch.bincount(tokens, minlength=3).float() / draws
    assert frequencies.tolist() == pytest.approx(expected, abs=0.03)
    again = sample_tokens(
        logits, [temperature] * draws, [top_p] * draws, [torch.Generator().manual_seed(i) for i in range(draws)]
    )
    assert torch.equal(tokens, again)


def test_chosen_tokens_are_the_inverse_cdf_of_each_rows_draw_with_raw_logprobs() -> None:
    """Rows at temperature 1 without a nucleus: token = the first index whose running probability exceeds the row's
    uniform draw (probabilities 0.2, 0.5, 0.3: cumulative 0.2, 0.7, 1.0); logprob = log p(token), the raw model's,
    whatever the logits' offset."""
    probs = torch.tensor([0.2, 0.5, 0.3])
    rows = 64
    logits = (torch.log(probs) + 7.0).repeat(rows, 1)
    tokens, logprobs, log_normalizer = choose_tokens(
        logits, [1.0] * rows, [1.0] * rows, [torch.Generator().manual_seed(i) for i in range(rows)]
    )
    draws = [float(torch.rand((), generator=torch.Generator().manual_seed(i))) for i in range(rows)]
    assert tokens.tolist() == [0 if u < 0.2 else 1 if u < 0.7 else 2 for u in draws]
    torch.testing.assert_close(logprobs, torch.log(probs)[tokens], atol=1e-6, rtol=0)
    torch.testing.assert_close(log_normalizer, torch.full((rows,), 7.0), atol=1e-6, rtol=0)  # log sum e^(l+7)


def test_two_level_inverse_cdf_finds_the_column_across_blocks() -> None:
    """600 columns = two blocks of 256 and a short one of 88. Weights 1, 2, 1 at columns 10, 300 and 599 (the short
    block): running sums 1, 3, 4 of a total 4, so a draw u picks 10 below 0.25, 300 below 0.75, else 599."""
    assert CDF_BLOCK == 256
    weights = torch.zeros(5, 600)
    weights[:, 10], weights[:, 300], weights[:, 599] = 1.0, 2.0, 1.0
    uniforms = torch.tensor([0.0, 0.1, 0.25, 0.74, 0.8])
    tokens, totals = _inverse_cdf_and_totals(weights, uniforms)
    assert tokens.tolist() == [10, 10, 300, 300, 599]
    assert totals.tolist() == [4.0] * 5
    # the largest float32 below 1: still a column with weight, never one past the last such column
    almost_one = torch.tensor([1.0 - 2.0**-24])
    assert _inverse_cdf_and_totals(weights[:1], almost_one)[0].tolist() == [599]
    weights[:, 599] = 0.0
    assert _inverse_cdf_and_totals(weights[:1], almost_one)[0].tolist() == [300]


@pytest.mark.parametrize("columns", [64, 256, 257, 600, 49152])
def test_two_level_inverse_cdf_is_the_one_running_sum(columns: int) -> None:
    """The same column as one running sum over the whole row (ties to float rounding aside), always of weight > 0."""
    generator = torch.Generator().manual_seed(columns)
    for scale in (0.05, 3.0, 12.0):
        logits = torch.randn(64, columns, generator=generator) * scale
        weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
        uniforms = torch.rand(64, generator=generator)
        cdf = weights.cumsum(dim=-1)
        expected = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        tokens, totals = _inverse_cdf_and_totals(weights, uniforms)
        assert tokens.tolist() == expected.tolist()
        assert bool((weights.gather(1, tokens[:, None]) > 0).all())
        torch.testing.assert_close(totals, weights.sum(dim=-1))


def slice_weights_of(logits: torch.Tensor, slices: int) -> SliceWeights:
    """`SliceWeights` of `logits` cut into `slices` equal vocabulary slices, as the sliced LM head makes them."""
    rows, vocab = logits.shape
    width = vocab // slices
    weights, block_sums = torch.empty_like(logits), logits.new_empty((rows, vocab // CDF_BLOCK))
    peaks = logits.new_empty((rows, slices))
    for index in range(slices):
        columns = slice(index * width, (index + 1) * width)
        blocks = slice(index * width // CDF_BLOCK, (index + 1) * width // CDF_BLOCK)
        peaks[:, index] = fill_slice_weights(logits[:, columns], weights[:, columns], block_sums[:, blocks])
    return SliceWeights(weights, peaks, block_sums, width)


def test_chosen_tokens_from_slice_weights_rescale_each_slice_by_its_peak() -> None:
    """Two slices of 256 columns. Logits log 1, log 2 at columns 10 and 300, log 1 at 500, -inf-like elsewhere;
    slice 0's peak is log 1, slice 1's log 2: its weights are 1 and 1/2, its block sum 1.5, times exp(log 2 - log
    2) = 1, and slice 0's 1 times exp(0 - log 2) = 1/2. The CDF is 1, 3, 4 of 4 (over exp(l - log 2): 0.5, 1.5,
    2): a draw u below 0.25 picks 10, below 0.75 picks 300, else 500; each logprob is log softmax."""
    rows = 64
    logits = torch.full((rows, 512), -1e4)
    logits[:, 10], logits[:, 300], logits[:, 500] = 0.0, math.log(2.0), 0.0
    slices = slice_weights_of(logits, 2)
    assert slices.peaks[0].tolist() == pytest.approx([0.0, math.log(2.0)])
    assert slices.block_sums[0].tolist() == pytest.approx([1.0, 1.5])
    generators = [torch.Generator().manual_seed(row) for row in range(rows)]
    tokens, logprobs, log_normalizer = choose_tokens(logits, [1.0] * rows, [1.0] * rows, generators, slices)
    draws = [float(torch.rand((), generator=torch.Generator().manual_seed(row))) for row in range(rows)]
    expected = [10 if u < 0.25 else 300 if u < 0.75 else 500 for u in draws]
    assert tokens.tolist() == expected and set(expected) == {10, 300, 500}
    log_softmax = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, log_softmax, atol=1e-6, rtol=0)
    torch.testing.assert_close(log_normalizer, torch.full((rows,), math.log(4.0)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("scale", [0.05, 3.0, 30.0])
def test_chosen_tokens_from_slice_weights_are_those_of_the_whole_vocabulary(scale: float) -> None:
    """The same tokens as `choose_tokens` over the whole row with the same generators (float rounding aside),
    logprobs and log-normalizers within float32 rounding; rows whose slices' peaks lie far apart included."""
    generator = torch.Generator().manual_seed(int(scale * 100))
    rows, slices = 48, 4
    logits = torch.randn(rows, slices * 2 * CDF_BLOCK, generator=generator) * scale
    logits[::3, 3 * 2 * CDF_BLOCK :] += 40.0  # the last slice far above the others in every third row

    def generators() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(row) for row in range(rows)]

    whole = choose_tokens(logits, [1.0] * rows, [1.0] * rows, generators())
    sliced = choose_tokens(logits, [1.0] * rows, [1.0] * rows, generators(), slice_weights_of(logits, slices))
    assert sliced[0].tolist() == whole[0].tolist()
    torch.testing.assert_close(sliced[1], whole[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(sliced[2], torch.logsumexp(logits, dim=-1), atol=1e-5, rtol=1e-6)
    # A row at another temperature: the slices are left aside and the whole vocabulary is used.
    mixed = choose_tokens(logits, [0.5] + [1.0] * (rows - 1), [1.0] * rows, generators(), slice_weights_of(logits, 4))
    reference = choose_tokens(logits, [0.5] + [1.0] * (rows - 1), [1.0] * rows, generators())
    assert mixed[0].tolist() == reference[0].tolist()


def test_tokens_chosen_from_slice_weights_follow_the_softmax() -> None:
    """20,000 draws over two slices whose peaks differ by log 4: the frequencies of the four likely tokens (two in
    each slice) are their softmax probabilities 0.1, 0.1, 0.4, 0.4 (within 0.015)."""
    draws = 20_000
    logits = torch.full((draws, 2 * CDF_BLOCK), -1e4)
    logits[:, 3], logits[:, 200] = 0.0, 0.0
    logits[:, CDF_BLOCK + 7], logits[:, CDF_BLOCK + 100] = math.log(4.0), math.log(4.0)
    torch.manual_seed(0)  # rows without a generator draw from the global one
    tokens, _, _ = choose_tokens(logits, [1.0] * draws, [1.0] * draws, [None] * draws, slice_weights_of(logits, 2))
    counts = torch.bincount(tokens, minlength=2 * CDF_BLOCK).float() / draws
    likely = [3, 200, CDF_BLOCK + 7, CDF_BLOCK + 100]
    assert counts[likely].tolist() == pytest.approx([0.1, 0.1, 0.4, 0.4], abs=0.015)
    assert counts.sum().item() == pytest.approx(float(counts[likely].sum()))


def test_chosen_tokens_of_a_mixed_batch_follow_each_rows_parameters() -> None:
    """A greedy row takes the argmax; tempered or nucleus rows draw as `sample_tokens` does with the same generator;
    every logprob is the untempered model's log softmax at the chosen token."""
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    temperatures, top_ps = [0.0, 0.5, 1.0, 1.0], [1.0, 1.0, 0.4, 1.0]
    tokens, logprobs, log_normalizer = choose_tokens(
        logits, temperatures, top_ps, [torch.Generator().manual_seed(i) for i in range(4)]
    )
    alone = sample_tokens(
        logits[1:], temperatures[1:], top_ps[1:], [torch.Generator().manual_seed(i) for i in (1, 2, 3)]
    )
    assert tokens[0] == 1 and tokens[2] == 0  # the argmax; a 0.4 nucleus holds the most likely token only
    assert tokens[1:].tolist() == alone.tolist()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    torch.testing.assert_close(log_normalizer, torch.logsumexp(logits, -1))


async def test_a_tiny_nucleus_or_temperature_is_greedy(engine: Engine) -> None:
    prompt = prompt_of(engine, "move forward")
    expected = await greedy(engine, prompt, 6)
    for params in (
        SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-6, seed=1),
        SamplingParams(max_tokens=6, temperature=1e-5, seed=2),
    ):
        assert (await engine.generate(prompt, params)).samples[0].token_ids == expected


async def test_closing_fails_pending_requests_and_refuses_new_ones(fresh_engine: Engine) -> None:
    engine = fresh_engine
    steps = engine.stats.decode_steps
    running = asyncio.ensure_future(engine.generate([1, 2, 3], SamplingParams(max_tokens=500, temperature=0.0)))
    while engine.stats.decode_steps <= steps:
        await asyncio.sleep(0.01)
    await asyncio.to_thread(engine.close)
    with pytest.raises(EngineClosedError):
        await running
    with pytest.raises(EngineClosedError):
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("crash_in", ["prefill", "decode"])
async def test_a_crashed_worker_fails_the_requests_it_held_instead_of_leaving_them_waiting(
    fresh_engine: Engine, monkeypatch: pytest.MonkeyPatch, crash_in: str
) -> None:
    """A bug in a forward pass ends the engine, and every request it held gets the error: a request being
    prefilled is neither queued nor in the running batch, and used to wait forever."""
    engine = fresh_engine
    forward = engine._forward

    def failing(input_ids: torch.Tensor, *args: object, **kwargs: object) -> object:
        if (input_ids.shape[1] == 1) == (crash_in == "decode"):
            raise RuntimeError("a bug")
        return forward(input_ids, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "_forward", failing)
    with pytest.raises(EngineError, match="crashed: RuntimeError: a bug"):
        await asyncio.wait_for(engine.generate(list(range(100, 120)), SamplingParams(max_tokens=4)), 30)
    with pytest.raises(EngineClosedError):
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))


def test_nucleus_among_the_top_candidates_is_the_nucleus_of_the_whole_vocabulary() -> None:
    generator = torch.Generator().manual_seed(0)
    vocabulary = 5000

    def nucleus_by_sorting(row: torch.Tensor, top_p: float) -> set[int]:
        probs = torch.softmax(row.double(), dim=-1)
        kept, mass = set(), 0.0
        for token in torch.argsort(probs, descending=True).tolist():
            if mass >= top_p:
                break
            kept.add(token)
            mass += float(probs[token])
        return kept

    # Nuclei of 2, 1, 187, 4407 and 1333 tokens: inside 64 candidates, inside 1024, or only the whole vocabulary.
    logits = torch.randn(5, vocabulary, generator=generator) * torch.tensor([8.0, 8.0, 4.0, 0.1, 0.1]).unsqueeze(1)
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.9, 0.3])
    for width in (64, 1024, vocabulary):
        probs, ids, inside = engine_module._nucleus(logits, top_p, width)
        assert inside.tolist() == [True, True, width >= 1024, width == vocabulary, width == vocabulary]
        assert probs.shape == ids.shape == (5, width)
        for row in torch.nonzero(inside).flatten().tolist():
            members = ids[row][probs[row] > 0].tolist()
            assert set(members) == nucleus_by_sorting(logits[row], float(top_p[row]))
            expected = torch.softmax(logits[row], dim=-1)[members]
            assert probs[row][probs[row] > 0].tolist() == pytest.approx(expected.tolist(), rel=1e-5)
            assert probs[row].tolist() == sorted(probs[row].tolist(), reverse=True)  # most likely first


def test_rows_whose_nucleus_is_wide_are_sampled_from_all_of_it() -> None:
    # Row 0: one token holds 0.99, its nucleus at 0.9 is that token. Row 1: 100 equally likely tokens, a nucleus of
    # 90, wider than the first 64 candidates. Row 2: 5000 equally likely tokens, a nucleus of 4500, which no
    # 1024 candidates can hold (sorted whole at once). Row 3 (top-p 1) keeps its two tokens.
    logits = torch.full((4, 5000), -1e4)
    logits[0, 7], logits[0, 8] = 10.0, 10.0 - math.log(99.0)
    logits[1, :100] = 0.0
    logits[2] = 0.0
    logits[3, :2] = 0.0
    draws = 2000
    tokens = torch.stack(
        [
            sample_tokens(
                logits, [1.0] * 4, [0.9, 0.9, 0.9, 1.0], [torch.Generator().manual_seed(4 * i + r) for r in range(4)]
            )
            for i in range(draws)
        ]
    )
    assert set(tokens[:, 0].tolist()) == {7}
    assert int(tokens[:, 1].max()) < 100 and 85 <= len(set(tokens[:, 1].tolist())) <= 90  # ~90 tokens, ~1/90 each
    assert len(set(tokens[:, 2].tolist())) > 1024 and int(tokens[:, 2].max()) < 5000
    assert set(tokens[:, 3].tolist()) == {0, 1}
