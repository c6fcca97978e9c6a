"""Automatic prefix caching: the store (index, exact matches, LRU budget), the growing KV layer, and the engine
reusing cached KV without changing any output."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from agentgym.inference import prefix_cache as prefix_cache_module
from agentgym.inference.engine import Engine, EngineStats, SampleOutput, SamplingParams, _Prefill, _prefill_groups
from agentgym.inference.kv import GrowingLayer, compaction
from agentgym.inference.prefix_cache import CachedPrefix, KVFactory, PrefixCache

Rescore = Callable[[torch.nn.Module, list[int], list[int]], list[float]]
TOLERANCE = 1e-4


def ids(seed: int, length: int) -> list[int]:
    """Deterministic token ids; different seeds share no prefix."""
    return [(1000 + 37 * seed + 11 * k) % 49000 + 100 for k in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0) < TOLERANCE


def snapshot(stats: EngineStats) -> EngineStats:
    return EngineStats(**vars(stats))


# ---------------------------------------------------------------- the store


def store(
    cache: PrefixCache, tokens: list[int], version: int = 0, asked: list[int] | None = None, room: int = 0
) -> bool:
    """Insert `tokens` with each token's id as its key (and minus it as its value); `asked` collects the starts
    the cache asked the KV for."""

    def kv(start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if asked is not None:
            asked.append(start)
        keys = torch.tensor(tokens[start:], dtype=torch.float32).view(1, len(tokens) - start, 1)
        return [keys], [-keys]

    return cache.insert(tokens, version, kv, room)


def test_lookup_finds_the_longest_cached_prefix_to_the_token() -> None:
    cache = PrefixCache(max_tokens=1000, block_size=4)
    a = list(range(100, 130))  # 7 full blocks + 2 tokens
    b = a[:10] + list(range(500, 520))
    assert store(cache, a) and store(cache, b)
    entry, length = cache.lookup([*a, 1, 2, 3], 33, version=0)
    assert entry is not None and entry.ids == a and length == 30
    assert entry.keys[0][0, :, 0].tolist() == a and entry.values[0][0, :, 0].tolist() == [-t for t in a]
    entry, length = cache.lookup(a[:13] + [7] * 10, 23, 0)  # parts inside a block: exact to the token
    assert entry is not None and entry.ids == a and length == 13
    entry, length = cache.lookup(b[:15] + [9] * 5, 20, 0)  # a and b share 10 tokens, then it follows b
    assert entry is not None and entry.ids == b and length == 15
    assert cache.lookup(a, 29, 0)[1] == 29  # at most `limit`
    assert cache.lookup(a[:3] + [1] * 20, 23, 0) == (None, 0)  # under one block in common
    assert cache.lookup([1] * 40, 40, 0) == (None, 0)
    assert cache.lookup([*a, 1], 31, version=1) == (None, 0)  # other weights
    assert cache.lookup(a[:3], 3, 0) == (None, 0)


def test_a_longer_sequence_supersedes_its_prefix_and_covered_ones_are_not_stored_twice() -> None:
    cache = PrefixCache(max_tokens=1000, block_size=4)
    turn1 = list(range(10, 30))
    turn2 = turn1 + list(range(40, 50))
    assert store(cache, turn1)
    assert store(cache, turn2)  # the next turn's context: the first one is dropped
    assert (len(cache), cache.tokens, cache.superseded) == (1, 30, 1)
    assert not store(cache, turn1) and not store(cache, turn2)  # already covered
    other = turn1[:8] + [1] * 12  # shares a prefix but is not one: both kept
    assert store(cache, other)
    assert len(cache) == 2
    assert cache.lookup(turn1[:8] + [1] * 13, 21, 0)[1] == 20
    assert cache.lookup([*turn2, 0], 31, 0)[1] == 30
    assert store(cache, turn2, version=1)  # not covered by the other weights' entry (nor superseding it)
    assert len(cache) == 3 and cache.superseded == 1
    assert not store(cache, [1, 2, 3])  # shorter than a block: never found, never kept


def test_lru_eviction_keeps_the_token_budget_and_hits_refresh_entries() -> None:
    cache = PrefixCache(max_tokens=60, block_size=4)
    a, b, c, d = ([base + i for i in range(20)] for base in (100, 200, 300, 400))
    for tokens in (a, b, c):
        assert store(cache, tokens)
    assert (cache.tokens, len(cache), cache.evicted) == (60, 3, 0)
    assert cache.lookup([*a, 0], 21, 0)[1] == 20  # a is now the most recently used
    assert store(cache, d)
    assert (cache.tokens, len(cache), cache.evicted) == (60, 3, 1)
    assert cache.lookup([*b, 0], 21, 0) == (None, 0)  # b was the least recently used
    assert cache.lookup([*a, 0], 21, 0)[1] == 20 and cache.lookup([*c, 0], 21, 0)[1] == 20
    assert not store(cache, list(range(1000, 1061)))  # over the whole budget on its own
    assert cache.clear() == 3
    assert cache.tokens == 0 and cache.lookup([*a, 0], 21, 0) == (None, 0)
    assert not PrefixCache(max_tokens=0).enabled


def held(entry: CachedPrefix | None) -> list[int]:
    """The ids an entry's keys say it holds (`store` keys each token by its id), checked against its values."""
    assert entry is not None
    keys, values = entry.keys[0][0, :, 0], entry.values[0][0, :, 0]
    assert values.tolist() == (-keys).tolist()
    return [int(key) for key in keys.tolist()]


def test_a_superseding_entry_writes_only_its_new_columns_into_the_room_of_the_one_it_supersedes() -> None:
    cache = PrefixCache(max_tokens=1000, block_size=4)
    prompt = list(range(100, 120))
    asked: list[int] = []
    assert store(cache, prompt, asked=asked, room=15)  # a prompt whose request may sample 16 tokens
    first, _ = cache.lookup([*prompt, 0], 21, 0)
    assert first is not None and (first.capacity, cache.tokens, asked) == (35, 35, [0])
    finished = [*prompt, *range(500, 512)]  # 12 sampled ids fed back: within the room
    assert store(cache, finished, asked=asked)
    entry, length = cache.lookup([*finished, 0], 33, 0)
    assert entry is not None and length == 32 and held(entry) == finished
    assert asked == [0, 20]  # only the new columns' KV was asked for ...
    assert entry.key_buffers[0].data_ptr() == first.key_buffers[0].data_ptr()  # ... and written after the old
    assert (entry.capacity, cache.tokens, len(cache), cache.superseded) == (35, 35, 1, 1)
    assert held(first) == prompt  # a superseded entry still read by a prefill is unchanged

    # Past the room: new buffers, the old columns copied from the old entry's, the new ones asked for.
    longer = [*finished, *range(600, 610)]
    assert store(cache, longer, asked=asked, room=5)
    entry, _ = cache.lookup([*longer, 0], 43, 0)
    assert entry is not None and held(entry) == longer and asked == [0, 20, 32]
    assert entry.key_buffers[0].data_ptr() != first.key_buffers[0].data_ptr()
    assert (entry.capacity, cache.tokens, len(cache)) == (47, 47, 1)


def test_two_continuations_of_one_entry_never_write_into_each_other() -> None:
    cache = PrefixCache(max_tokens=1000, block_size=4)
    prompt = list(range(100, 120))
    asked: list[int] = []
    assert store(cache, prompt, room=30)
    a, b = [*prompt, *range(500, 508)], [*prompt, *range(700, 712)]
    assert store(cache, a, asked=asked)  # supersedes the prompt: its room
    assert store(cache, b, asked=asked)  # the prompt's entry is gone: a whole copy of its own
    assert asked == [20, 0] and cache.superseded == 1
    found_a, _ = cache.lookup([*a, 0], 29, 0)
    found_b, _ = cache.lookup([*b, 0], 33, 0)
    assert held(found_a) == a and held(found_b) == b
    assert found_a is not None and found_b is not None and found_a.key_buffers[0] is not found_b.key_buffers[0]
    assert cache.tokens == 50 + 32


def test_an_equal_entry_the_lookup_missed_is_superseded_with_no_new_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups compare the few most recent holders of a block only: an older entry with the very same ids can be
    missed as covering and then superseded, leaving nothing new to write."""
    monkeypatch.setattr(prefix_cache_module, "_CANDIDATES", 0)  # every lookup misses
    cache = PrefixCache(max_tokens=1000, block_size=4)
    tokens = list(range(100, 120))
    asked: list[int] = []
    assert store(cache, tokens, asked=asked, room=5) and store(cache, tokens, asked=asked)
    assert asked == [0, 20] and (len(cache), cache.superseded, cache.tokens) == (1, 1, 25)
    monkeypatch.setattr(prefix_cache_module, "_CANDIDATES", 16)
    entry, length = cache.lookup([*tokens, 0], 21, 0)
    assert length == 20 and held(entry) == tokens


def test_room_counts_against_the_budget_and_never_past_it() -> None:
    cache = PrefixCache(max_tokens=60, block_size=4)
    a, b = list(range(100, 120)), list(range(200, 220))
    assert store(cache, a, room=20) and store(cache, b, room=20)
    assert (cache.tokens, len(cache), cache.evicted) == (40, 1, 1)  # 40 + 40 columns > 60: a evicted
    assert cache.lookup([*a, 0], 21, 0) == (None, 0) and cache.lookup([*b, 0], 21, 0)[1] == 20
    assert cache.clear() == 1
    assert store(cache, list(range(300, 350)), room=40)
    entry, _ = cache.lookup([*range(300, 350), 0], 51, 0)
    assert entry is not None and entry.capacity == cache.tokens == 60  # the room cut at the budget


def test_hash_collisions_never_serve_another_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache_module, "chain_key", lambda previous, block: 7)  # every block collides
    cache = PrefixCache(max_tokens=1000, block_size=4)
    a, b = list(range(100, 120)), list(range(200, 220))
    assert store(cache, a) and store(cache, b)
    assert cache.lookup([1] * 20, 20, 0) == (None, 0)
    entry, length = cache.lookup(a[:9] + [5] * 11, 20, 0)
    assert entry is not None and entry.ids == a and length == 9
    entry, length = cache.lookup([*b, 5], 21, 0)
    assert entry is not None and entry.ids == b and length == 20


# ---------------------------------------------------------------- KV layer and prefill grouping


def live(layer: GrowingLayer) -> torch.Tensor:
    """The layer's live keys (set once it holds any)."""
    assert layer.keys is not None
    return layer.keys


def test_growing_layer_appends_in_place_and_copies_only_joining_and_moved_rows() -> None:
    layer = GrowingLayer()
    start = torch.arange(12, dtype=torch.float32).view(2, 1, 3, 2)
    keys, values = layer.update(start, -start)
    assert torch.equal(keys, start) and torch.equal(values, -start)
    step = torch.full((2, 1, 1, 2), 0.5)
    grown, _ = layer.update(step, step)
    assert grown.data_ptr() == keys.data_ptr()  # written in place: the cache is not copied
    steps = [step * i for i in range(100)]  # past the spare room: the buffer grows
    for extra in steps:
        layer.update(extra, -extra)
    expected = torch.cat([start, step, *steps], dim=2)
    assert (
        torch.equal(live(layer), expected)
        and layer.values is not None
        and torch.equal(layer.values[:, :, 4:], -expected[:, :, 4:])
    )
    # Joining rows are right-aligned; a wider one widens the live region to the left.
    short, wide = torch.rand(1, 1, 3, 2), torch.rand(1, 1, 110, 2)
    for joining in (short, wide):
        other = GrowingLayer()
        other.update(joining, -joining)
        layer.append_rows(other)
    assert (layer.rows, layer.columns) == (4, 110)
    assert torch.equal(live(layer)[:2, :, -104:], expected)
    assert torch.equal(live(layer)[2, :, -3:], short[0]) and torch.equal(live(layer)[3], wide[0])
    # Rows 0 and 2 leave: the last row moves into row 0's place.
    order, gaps, moved = compaction([1, 3], 4)
    assert (order, gaps, moved) == ([3, 1], [0], [3])
    before = live(layer).clone()
    layer.move_rows(gaps, moved, len(order))
    assert torch.equal(live(layer), before[order])
    layer.drop_leading(6)
    assert torch.equal(live(layer), before[order][:, :, 6:])
    layer.update(step, step)
    assert torch.equal(live(layer)[:, :, :-1], before[order][:, :, 6:]) and torch.equal(
        live(layer)[:, :, -1], step[:, :, 0]
    )
    snapshot_keys = live(layer).clone()
    layer.select(torch.tensor([1, 1, 0]))
    assert torch.equal(live(layer), snapshot_keys[[1, 1, 0]])


def test_prefill_groups_split_rows_of_very_different_lengths() -> None:
    def row(length: int, cached: int = 0) -> _Prefill:
        return _Prefill(list(range(length)), [], cached=cached)

    short = [row(120, cached=100) for _ in range(10)]  # 20 new tokens each
    groups = _prefill_groups([*short, row(1600)])
    assert [len(group) for group in groups] == [1, 10]
    assert len(_prefill_groups([row(30 + i) for i in range(8)])) == 1


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def plain(tiny_dir: Path, engine_factory: Callable[..., Engine]) -> Iterator[Engine]:
    """The reference: an engine without prefix caching."""
    eng = engine_factory(tiny_dir, prefix_cache_tokens=0)
    yield eng
    eng.close()


@pytest.fixture
def cached(tiny_dir: Path, engine_factory: Callable[..., Engine]) -> Iterator[Engine]:
    """An engine with prefix caching and an empty cache."""
    eng = engine_factory(tiny_dir)
    yield eng
    eng.close()


async def play(
    engine: Engine, seed: int, params: SamplingParams, turns: int = 3
) -> list[tuple[list[int], SampleOutput]]:
    """A multi-turn episode: each turn's prompt is the previous one + the sampled ids + new 'observation' ids."""
    context = ids(seed, 40)
    played = []
    for turn in range(turns):
        [sample] = (await engine.generate(context, params)).samples
        played.append((context, sample))
        context = context + sample.token_ids + ids(seed + 100 + turn, 12)
    return played


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_multi_turn_episodes_reuse_their_kv_without_changing_outputs(
    cached: Engine, plain: Engine, rescore: Rescore, temperature: float
) -> None:
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True)
    with_cache = await asyncio.gather(*(play(cached, seed, params) for seed in range(4)))
    without = await asyncio.gather(*(play(plain, seed, params) for seed in range(4)))
    stats = cached.stats
    assert stats.prefix_hits == 8  # every turn after the first reused the previous turn's context
    assert stats.prefix_hit_tokens >= 8 * (40 + 7)
    assert stats.prefill_tokens == stats.prompt_tokens - stats.prefix_hit_tokens
    assert plain.stats.prefix_lookups == 0 and plain.stats.prefill_tokens == plain.stats.prompt_tokens
    for episode, reference in zip(with_cache, without, strict=True):
        for (context, sample), (_, expected) in zip(episode, reference, strict=True):
            assert sample.token_ids == expected.token_ids
            assert close(sample.logprobs, expected.logprobs)
            assert close(sample.logprobs, rescore(cached.model, context, sample.token_ids))


async def test_a_finished_turn_stores_only_its_sampled_tokens_after_its_prompt(
    cached: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix_cache = cached.prefix_cache
    insert = prefix_cache.insert
    stored: list[tuple[int, list[int], int]] = []  # (ids, the starts their KV was asked from, room)

    def spy(ids: list[int], version: int, kv: KVFactory, room: int = 0) -> bool:
        asked: list[int] = []

        def traced(start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            asked.append(start)
            return kv(start)

        stored.append((len(ids), asked, room))
        return insert(ids, version, traced, room)

    monkeypatch.setattr(prefix_cache, "insert", spy)
    played = await play(cached, 7, SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True), turns=2)
    # Turn 1: its prompt (40) with room for 7 fed-back ids, then its context (47) written into that room; turn 2:
    # its prompt (47 + 1 + 12) copied out of the context's full buffers, then its sampled ids into its room.
    assert stored == [(40, [0], 7), (47, [40], 0), (60, [47], 7), (67, [60], 0)]
    entry, length = prefix_cache.lookup([*played[1][0], *played[1][1].token_ids], 68, cached.policy_version)
    assert entry is not None and length == 67 and entry.capacity == 67 and len(prefix_cache) == 1


async def test_hits_of_different_lengths_join_a_running_batch_in_one_prefill(
    cached: Engine, plain: Engine, rescore: Rescore
) -> None:
    first, second = ids(1, 70), ids(2, 30)
    [warm1] = (await cached.generate(first, greedy(6))).samples
    [warm2] = (await cached.generate(second, greedy(6))).samples
    # Cached prefixes of 75 and 35 tokens and a miss, each with 10 tokens to prefill: one forward pass.
    prompts = [first + warm1.token_ids + ids(3, 9), second + warm2.token_ids + ids(4, 9), ids(5, 10)]
    long_prompt = ids(6, 20)
    steps = cached.stats.decode_steps
    running = asyncio.ensure_future(cached.generate(long_prompt, greedy(60)))
    while cached.stats.decode_steps < steps + 2:
        await asyncio.sleep(0.005)
    # Hold the worker between two decode steps while the three requests queue, so they are admitted together.
    with cached._cond:
        assert cached.stats.decode_steps - steps < 50  # the long request is still running
        before = snapshot(cached.stats)
        joining = [asyncio.ensure_future(cached.generate(prompt, greedy(8))) for prompt in prompts]
        for _ in range(3):
            await asyncio.sleep(0)
    outs = await asyncio.gather(*joining)
    stats = cached.stats
    assert stats.prefill_batches - before.prefill_batches == 1
    assert stats.prefill_rows - before.prefill_rows == 3
    assert stats.prefix_hits - before.prefix_hits == 2
    assert stats.prefix_hit_tokens - before.prefix_hit_tokens == 75 + 35
    assert stats.prefill_tokens - before.prefill_tokens == 30
    assert stats.max_running >= 4
    for prompt, out in zip(prompts, outs, strict=True):
        [sample] = out.samples
        [expected] = (await plain.generate(prompt, greedy(8))).samples
        assert sample.token_ids == expected.token_ids
        assert close(sample.logprobs, expected.logprobs)
        assert close(sample.logprobs, rescore(cached.model, prompt, sample.token_ids))
    [long_sample] = (await running).samples
    assert long_sample.token_ids == (await plain.generate(long_prompt, greedy(60))).samples[0].token_ids


async def test_n_samples_share_the_prefill_and_the_hit(cached: Engine, plain: Engine, rescore: Rescore) -> None:
    prompt = ids(7, 50)
    [warm] = (await cached.generate(prompt, greedy(4))).samples
    follow_up = prompt + warm.token_ids + ids(8, 6)
    params = SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=9, ignore_eos=True)
    before = snapshot(cached.stats)
    out = await cached.generate(follow_up, params)
    assert cached.stats.prefill_rows - before.prefill_rows == 1  # one row for the four samples
    assert cached.stats.prefix_hit_tokens - before.prefix_hit_tokens == 53
    expected = await plain.generate(follow_up, params)
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in expected.samples]
    assert len({tuple(s.token_ids) for s in out.samples}) > 1
    for sample in out.samples:
        assert close(sample.logprobs, rescore(cached.model, follow_up, sample.token_ids))


async def test_requests_admitted_together_prefill_a_shared_prefix_once(
    cached: Engine, plain: Engine, rescore: Rescore
) -> None:
    system = ids(20, 100)
    prompts = [system + ids(30 + i, 6) for i in range(4)]
    outs = await asyncio.gather(*(cached.generate(p, greedy(5)) for p in prompts))  # one batch window
    stats = cached.stats
    assert stats.shared_prefills == 1
    assert stats.prefill_tokens == 100 + 4 * 6
    assert stats.prefix_hits == 4 and stats.prefix_hit_tokens == 4 * 100
    for prompt, out in zip(prompts, outs, strict=True):
        [sample] = out.samples
        assert sample.token_ids == (await plain.generate(prompt, greedy(5))).samples[0].token_ids
        assert close(sample.logprobs, rescore(cached.model, prompt, sample.token_ids))
    # A later request with the same system prompt reuses it too.
    [late] = (await cached.generate(system + ids(40, 6), greedy(5))).samples
    assert cached.stats.prefix_hits == 5 and cached.stats.shared_prefills == 1
    assert late.token_ids == (await plain.generate(system + ids(40, 6), greedy(5))).samples[0].token_ids


async def test_new_weights_never_reuse_old_kv(cached: Engine, other_tiny_dir: Path, rescore: Rescore) -> None:
    prompt = ids(11, 40)
    [first] = (await cached.generate(prompt, greedy(6))).samples
    assert len(cached.prefix_cache) == 1
    assert await cached.load_weights(str(other_tiny_dir), 1) == 1
    assert len(cached.prefix_cache) == 0 and cached.prefix_cache.tokens == 0
    registry = cached.metrics.registry
    assert registry.get_sample_value("agentgym_inference_prefix_cache_evictions_total", {"reason": "weights"}) == 1
    hits = cached.stats.prefix_hits
    follow_up = prompt + first.token_ids + ids(12, 5)
    out = await cached.generate(follow_up, greedy(6))
    assert cached.stats.prefix_hits == hits and out.policy_version == 1
    assert close(out.samples[0].logprobs, rescore(cached.model, follow_up, out.samples[0].token_ids))
    # The new weights' KV is cached and reused.
    third = follow_up + out.samples[0].token_ids + ids(13, 5)
    [sample] = (await cached.generate(third, greedy(6))).samples
    assert cached.stats.prefix_hits == hits + 1
    assert close(sample.logprobs, rescore(cached.model, third, sample.token_ids))


async def test_the_token_budget_bounds_the_cache_and_metrics_report_it(
    tiny_dir: Path, engine_factory: Callable[..., Engine]
) -> None:
    engine = engine_factory(tiny_dir, prefix_cache_tokens=100)
    try:
        outputs = [await engine.generate(ids(seed, 40), greedy(4)) for seed in range(4)]
        samples = [output.samples[0] for output in outputs]
        assert [output.cached_prompt_tokens for output in outputs] == [0, 0, 0, 0]  # no shared prefixes
        cache = engine.prefix_cache
        # Each request stored its prompt (40 tokens), superseded by prompt + 3 sampled ids: 2 fit in 100.
        assert (len(cache), cache.tokens, cache.superseded, cache.evicted) == (2, 86, 4, 2)
        follow_up = ids(3, 40) + samples[3].token_ids + ids(50, 4)
        hit = await engine.generate(follow_up, greedy(2))
        assert hit.cached_prompt_tokens == 43  # the request's own share of the hits (what its span reports)
        value = engine.metrics.registry.get_sample_value
        stats = engine.stats
        assert stats.prefix_hits == 1 and stats.prefix_hit_tokens == 43
        assert value("agentgym_inference_prefix_cache_lookups_total") == 5
        assert value("agentgym_inference_prefix_cache_hits_total") == 1
        assert value("agentgym_inference_prefix_cache_hit_tokens_total") == 43
        assert value("agentgym_inference_prefix_cache_hit_ratio") == pytest.approx(43 / stats.prompt_tokens)
        assert value("agentgym_inference_prompt_tokens_total") == stats.prompt_tokens == 4 * 40 + 48
        assert value("agentgym_inference_prefill_tokens_total") == stats.prompt_tokens - 43
        assert value("agentgym_inference_prefix_cache_tokens") == cache.tokens <= 100
        assert value("agentgym_inference_prefix_cache_entries") == len(cache)
        assert value("agentgym_inference_prefix_cache_capacity_tokens") == 100
        evictions = "agentgym_inference_prefix_cache_evictions_total"
        assert value(evictions, {"reason": "capacity"}) == cache.evicted >= 2
        assert value(evictions, {"reason": "superseded"}) == cache.superseded
    finally:
        engine.close()


async def test_models_without_a_plain_dynamic_cache_fall_back_to_full_prefills(
    tiny_dir: Path, engine_factory: Callable[..., Engine], plain: Engine, rescore: Rescore
) -> None:
    # As for a sliding-window model: no prefix cache, no merging into a running batch, transformers' cache.
    engine = engine_factory(tiny_dir)
    try:
        engine._growable = False
        prompts = [ids(60 + i, 30 + 5 * i) for i in range(3)]
        outs = await asyncio.gather(
            *(
                engine.generate(p, SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=i))
                for i, p in enumerate(prompts)
            )
        )
        [again] = (await engine.generate(prompts[0] + outs[0].samples[0].token_ids, greedy(4))).samples
        assert engine.stats.prefix_lookups == 0 and len(engine.prefix_cache) == 0
        for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            expected = await plain.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=i))
            assert [s.token_ids for s in out.samples] == [s.token_ids for s in expected.samples]
            for sample in out.samples:
                assert close(sample.logprobs, rescore(engine.model, prompt, sample.token_ids))
        follow_up = prompts[0] + outs[0].samples[0].token_ids
        assert again.token_ids == (await plain.generate(follow_up, greedy(4))).samples[0].token_ids
    finally:
        engine.close()
