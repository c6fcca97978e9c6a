"""The engine's running batch: requests, their sequences, prefill rows, and the batch bookkeeping between
forward passes (sampling each row's next token, stop conditions, merging and compacting batches).

Every function here runs on the engine's worker thread; none touches the model or the engine's counters.
"""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from agentgym.inference.decoder import PrefixSegment, SharedPrefixes
from agentgym.inference.kv import GrowingLayer, compaction, spare_columns
from agentgym.inference.prefix_cache import BLOCK_SIZE, CachedPrefix, block_keys, common_prefix
from agentgym.inference.sampling import SamplingParams, SliceWeights, _sample_seed, choose_tokens

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
_PREFILL_OVERHEAD_TOKENS = 64
"""The fixed cost of one prefill forward pass, in prompt tokens (about 10 ms on CPU for the tiny model)."""


@dataclass
class SampleOutput:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    """The stop string or stop token id that ended the sample; None for EOS or length."""
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class GenerationOutput:
    samples: list[SampleOutput]
    prompt_tokens: int
    policy_version: int
    queue_seconds: float
    generation_seconds: float
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (not prefilled again)."""

    @property
    def completion_tokens(self) -> int:
        return sum(len(sample.token_ids) for sample in self.samples)


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[GenerationOutput]
    loop: asyncio.AbstractEventLoop
    enqueued: float
    samples: list[SampleOutput | None] = field(default_factory=list)
    remaining: int = 0
    admitted: float = 0.0
    version: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    prompt_blocks: list[int] | None = None
    """The chained keys of the prompt's full blocks (`prefix_cache.block_keys`), once needed."""

    def cancelled(self) -> bool:
        return self.future.done()


class _Sequence:
    """One sample of a request while it runs."""

    __slots__ = (
        "decoder",
        "finish_reason",
        "generator",
        "index",
        "logprobs",
        "max_stop_len",
        "request",
        "stop_ids",
        "stop_reason",
        "text",
        "token_ids",
        "top",
    )

    def __init__(self, request: _Request, index: int, stop_ids: frozenset[int], device: torch.device) -> None:
        from tokenizers.decoders import DecodeStream

        self.request = request
        self.index = index
        self.stop_ids = stop_ids
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[dict[int, float]] | None = [] if request.params.top_logprobs > 0 else None
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.max_stop_len = max((len(s) for s in request.params.stop), default=0)
        self.generator: torch.Generator | None = None
        if request.params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(_sample_seed(request.params.seed, index))

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def output(self) -> SampleOutput:
        return SampleOutput(
            index=self.index,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            text=self.text,
            finish_reason=self.finish_reason or FINISH_LENGTH,
            stop_reason=self.stop_reason,
            top_logprobs=self.top,
        )


@dataclass
class _Swap:
    model: Any
    version: int
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Prefill:
    """One row of a prefill forward pass: a request's prompt (its `n` sequences share the row), or a prefix
    shared by several requests (no sequences: its KV only goes to the prefix cache)."""

    ids: list[int]
    sequences: list[_Sequence]
    request: _Request | None = None
    entry: CachedPrefix | None = None
    cached: int = 0
    """Leading ids whose KV comes from `entry`."""

    @property
    def suffix(self) -> int:
        return len(self.ids) - self.cached


@dataclass
class _Batch:
    """The running batch: one row per sequence, a left-padded KV cache, and what to feed next."""

    sequences: list[_Sequence]
    cache: Any
    mask: torch.Tensor  # [rows, cache length], 1 on real tokens
    lengths: torch.Tensor  # [rows], real tokens in the cache (= the next position id)
    next_tokens: torch.Tensor  # [rows], sampled but not yet fed
    shared: SharedPrefixes | None = None
    """The prefixes its rows share, for decode steps (`shared_prefixes`), while `shared_current`."""
    shared_current: bool = False


def _select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep `rows` of every cache layer (in that order, repeats allowed)."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.select(rows)
        else:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


def _prefill_groups(rows: list[_Prefill], overhead: int = _PREFILL_OVERHEAD_TOKENS) -> list[list[_Prefill]]:
    """Split prefill rows into forward passes: rows sorted by uncached length, cut where that minimises the
    estimated cost, `overhead` per pass + rows x longest uncached length (padding is computed too)."""
    order = sorted(rows, key=lambda row: row.suffix, reverse=True)
    count = len(order)
    best = [0.0] + [math.inf] * count
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        for start in range(end):
            cost = best[start] + overhead + (end - start) * order[start].suffix
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups: list[list[_Prefill]] = []
    end = count
    while end:
        groups.append(order[cut[end] : end])
        end = cut[end]
    groups.reverse()
    return groups


def prefill_inputs(
    group: list[_Prefill], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """A prefill forward pass's input ids, attention mask and position ids over the rows' uncached ids, and its
    cached and new widths: row columns are `[pad, cached, pad, new]`."""
    rows = len(group)
    width = max(row.suffix for row in group)
    cached = max(row.cached for row in group)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, cached + width), dtype=torch.long)
    for r, row in enumerate(group):
        input_ids[r, width - row.suffix :] = torch.tensor(row.ids[row.cached :], dtype=torch.long)
        mask[r, cached - row.cached : cached] = 1
        mask[r, cached + width - row.suffix :] = 1
    input_ids = input_ids.to(device)
    mask = mask.to(device)
    # Position ids count each row's real tokens: its cached prefix keeps positions 0..cached-1.
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, cached:]
    return input_ids, mask, positions, cached, width


def shared_prefix_jobs(rows: list[_Prefill], size: int) -> list[_Prefill] | None:
    """The prompt prefixes that several of `rows` share beyond their cache hits, at block granularity (`size`
    ids), as prefill rows to run once and store; None when that would not save more than a forward pass costs."""
    if len(rows) < 2:
        return None
    chains = [block_keys(row.ids, size, len(row.ids) - 1) for row in rows]
    counts: dict[int, int] = {}
    for chain in chains:
        for key in chain:
            counts[key] = counts.get(key, 0) + 1
    shared: dict[int, tuple[int, int]] = {}  # last block key of a shared prefix -> (a row with it, blocks)
    saved = 0
    for index, (row, chain) in enumerate(zip(rows, chains, strict=True)):
        depth = 0
        while depth < len(chain) and counts[chain[depth]] > 1:
            depth += 1
        if depth * size >= row.cached + size:
            shared.setdefault(chain[depth - 1], (index, depth))
            saved += depth * size - row.cached
    # A shared prefix that starts a longer shared prefix is served by the longer one's entry.
    inner = {key for index, depth in shared.values() for key in chains[index][: depth - 1]}
    jobs: list[_Prefill] = []
    for key, (index, depth) in shared.items():
        if key in inner:
            continue
        ids = rows[index].ids
        # Past the last shared block, up to where the rows sharing it part (or the shortest one ends).
        length = len(ids) - 1
        for other, chain in zip(rows, chains, strict=True):
            if len(chain) >= depth and chain[depth - 1] == key:
                length = common_prefix(ids, other.ids, depth * size, min(length, len(other.ids) - 1))
        jobs.append(_Prefill(ids[:length], [], None, rows[index].entry, rows[index].cached))
    cost = sum(job.suffix for job in jobs) + _PREFILL_OVERHEAD_TOKENS
    if saved - cost < _PREFILL_OVERHEAD_TOKENS:
        return None
    return jobs


def new_cache(config: Any, growable: bool, group: list[_Prefill], cached: int, width: int) -> Any:
    """A cache for a prefill of `width` new columns after `cached` columns of the rows' cached prefixes
    (each right-aligned, zeros before it)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if not growable:
        return cache
    entries = [row.entry for row in group if row.entry is not None]
    for i in range(len(cache.layers)):
        if not cached or not entries:
            cache.layers[i] = GrowingLayer()
            continue
        like_keys, like_values = entries[0].keys[i], entries[0].values[i]
        capacity = cached + width + spare_columns(cached + width)
        keys = like_keys.new_zeros((len(group), like_keys.shape[0], capacity, like_keys.shape[2]))
        values = like_values.new_zeros((len(group), like_values.shape[0], capacity, like_values.shape[2]))
        for r, row in enumerate(group):
            if row.entry is not None and row.cached:
                keys[r, :, cached - row.cached : cached].copy_(row.entry.keys[i][:, : row.cached])
                values[r, :, cached - row.cached : cached].copy_(row.entry.values[i][:, : row.cached])
        cache.layers[i] = GrowingLayer.from_buffers(keys, values, cached)
    return cache


def merge_batches(batches: list[_Batch], max_rows: int) -> _Batch:
    """One batch from several: the others' rows are copied into the first's free rows (at most `max_rows` in
    all), each cache left-padded (masked) to the longest one."""
    if len(batches) == 1:
        return batches[0]
    width = max(batch.mask.shape[1] for batch in batches)
    cache = batches[0].cache
    for i, layer in enumerate(cache.layers):
        for batch in batches[1:]:
            layer.append_rows(batch.cache.layers[i], max_rows=max_rows)
    return _Batch(
        sequences=[seq for batch in batches for seq in batch.sequences],
        cache=cache,
        mask=torch.cat([F.pad(batch.mask, (width - batch.mask.shape[1], 0)) for batch in batches]),
        lengths=torch.cat([batch.lengths for batch in batches]),
        next_tokens=torch.cat([batch.next_tokens for batch in batches]),
    )


def keep_rows(batch: _Batch, keep: list[int]) -> None:
    """Drop every row of `batch` but `keep` (not empty), in place."""
    # The last remaining rows move into the leavers' places: only they are copied.
    order, gaps, moved = compaction(keep, len(batch.sequences))
    index = torch.tensor(order, device=batch.mask.device)
    mask = batch.mask.index_select(0, index)
    # Columns that are padding in every remaining row are dead weight: trim them.
    first_real = int(torch.argmax((mask.sum(0) > 0).to(torch.int8)).item())
    for layer in batch.cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.move_rows(gaps, moved, len(order))
            layer.drop_leading(first_real)
        else:
            layer.keys = layer.keys.index_select(0, index)[:, :, first_real:, :]
            layer.values = layer.values.index_select(0, index)[:, :, first_real:, :]
    batch.mask = mask[:, first_real:]
    batch.sequences = [batch.sequences[row] for row in order]
    batch.lengths = batch.lengths.index_select(0, index)
    batch.next_tokens = batch.next_tokens.index_select(0, index)
    if batch.shared is not None:
        batch.shared = batch.shared.kept(order, first_real)
        batch.shared_current = batch.shared is not None


MIN_SHARED_PREFIX = 4 * BLOCK_SIZE
"""The shortest prefix a decode step reads once for the rows sharing it (`shared_prefixes`), in tokens."""

SEGMENT_COST_COLUMNS = 512
"""The fixed cost of reading shared prefixes apart (another attention product a layer, the merge), counted as this
many key columns read (row x column): ~0.1 ms, the time to read ~500 of the tiny model's float32 key/value columns."""


def shared_prefixes(sequences: list[_Sequence], mask: torch.Tensor) -> SharedPrefixes | None:
    """How a decode batch reads the prompt prefixes its rows share once (`decoder.cascade_attention`), or None
    when that would not read fewer key columns; `mask` `[rows, columns]` is the cache's (before the step's column).

    A row's cached ids are its prompt and its sampled ids but the last; what rows share is looked for in their
    prompts (their block keys kept on the request). Rows are grouped by a block-aligned
    prefix (`BLOCK_SIZE` ids; `prefix_cache.block_keys`) they share with others: each row takes, of the prefixes
    it shares, the one that saves the most reads per member ((members - 1) / members x length; so the 8 samples of
    a task group by their whole common prompt, not by the instructions every task shares), then extended to their
    longest common prefix. A group's segment is its first row's columns holding that prefix. Every row reads its
    own columns from the smallest first column after a shared prefix on (`SharedPrefixes.window`); a row sharing
    nothing whose tokens start before that reads its earlier columns as a segment of its own."""
    rows = len(sequences)
    if rows < 2:
        return None
    counts = mask.sum(1).tolist()
    ids: list[list[int]] = []
    chains: list[list[int]] = []
    for seq, count in zip(sequences, counts, strict=True):
        request = seq.request
        if request.prompt_blocks is None:
            request.prompt_blocks = block_keys(request.prompt_ids)
        matches = len(request.prompt_ids) + len(seq.token_ids) - 1 == count  # its cache: prompt, sampled but last
        ids.append(request.prompt_ids if matches else [])
        chains.append(request.prompt_blocks if matches else [])
    occurrences: dict[int, int] = {}
    for chain in chains:
        for key in chain:
            occurrences[key] = occurrences.get(key, 0) + 1
    members: dict[int, list[int]] = {}
    depth_of: dict[int, int] = {}
    for row, chain in enumerate(chains):
        best, choice = 0.0, None
        for depth, key in enumerate(chain, 1):
            sharing = occurrences[key]
            if sharing < 2:
                break
            saving = (sharing - 1) / sharing * depth
            if saving > best:
                best, choice = saving, key
                depth_of[key] = depth
        if choice is not None and depth_of[choice] * BLOCK_SIZE >= MIN_SHARED_PREFIX:
            members.setdefault(choice, []).append(row)
    groups = [(group, depth_of[key] * BLOCK_SIZE) for key, group in members.items() if len(group) >= 2]
    if not groups:
        return None
    real = mask.bool()
    before = real.cumsum(1)  # real tokens up to and including each column
    first = (before < 1).sum(1)  # each row's first real column
    own_start = first.clone()
    for group, blocks in groups:
        head = ids[group[0]]
        length = min(common_prefix(head, ids[row], blocks, counts[row]) for row in group[1:])
        # Each row reads itself from the column after its length-th token.
        own_start[group] = (before[group] < length).sum(1) + 1
    grouped = [row for group, _ in groups for row in group]
    window = int(own_start[grouped].min())
    segments = [PrefixSegment(group, group[0], int(first[group[0]]), int(own_start[group[0]])) for group, _ in groups]
    in_group = set(grouped)
    for row in range(rows):
        if row not in in_group and int(first[row]) < window:  # its earlier columns: a segment of its own
            segments.append(PrefixSegment([row], row, int(first[row]), window))
            own_start[row] = window
    columns = int(mask.shape[1]) + 1  # with the step's own
    reads = rows * (columns - window) + sum(part.end - part.start for part in segments) + SEGMENT_COST_COLUMNS
    if reads >= rows * columns:
        return None
    return SharedPrefixes(segments, own_start, window, mask)


def sample_next(
    sequences: list[_Sequence], logits: torch.Tensor, backend_tokenizer: Any, slices: SliceWeights | None = None
) -> torch.Tensor:
    """Pick each sequence's next token (`choose_tokens`, with the logits' `slices` when the head gave them), record
    it with its raw logprob, and check the stop conditions."""
    chosen, chosen_lp, log_normalizer = choose_tokens(
        logits,
        [s.params.temperature for s in sequences],
        [s.params.top_p for s in sequences],
        [s.generator for s in sequences],
        slices,
    )
    tokens = chosen.tolist()
    token_lps = chosen_lp.tolist()
    k = max((s.params.top_logprobs for s in sequences), default=0)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k:
        top = torch.topk(logits, k, dim=-1)
        top_values, top_ids = (top.values - log_normalizer[:, None]).tolist(), top.indices.tolist()
    for row, seq in enumerate(sequences):
        if seq.finish_reason is not None:
            continue
        token = int(tokens[row])
        seq.token_ids.append(token)
        seq.logprobs.append(float(token_lps[row]))
        if seq.top is not None:
            n_top = seq.params.top_logprobs
            entry = dict(zip(top_ids[row][:n_top], top_values[row][:n_top], strict=True))
            entry[token] = float(token_lps[row])
            seq.top.append(entry)
        advance_text(seq, token, backend_tokenizer)
    return chosen


def advance_text(seq: _Sequence, token: int, backend_tokenizer: Any) -> None:
    """Decode `token` into the sequence's text and end the sequence on a stop string, stop token or length."""
    chunk = seq.decoder.step(backend_tokenizer, token)
    if chunk:
        searched_from = max(0, len(seq.text) - seq.max_stop_len + 1)
        seq.text += chunk
        if seq.params.stop:
            hits = [(seq.text.find(s, searched_from), s) for s in seq.params.stop]
            found = [(pos, s) for pos, s in hits if pos >= 0]
            if found:
                pos, stop = min(found)
                seq.text = seq.text[:pos]
                seq.finish_reason = FINISH_STOP
                seq.stop_reason = stop
                return
    if token in seq.stop_ids:
        seq.finish_reason = FINISH_STOP
        # vLLM's convention: the id for a requested stop token, None for the model's EOS.
        seq.stop_reason = token if token in seq.params.stop_token_ids else None
        return
    if len(seq.token_ids) >= seq.params.max_tokens:
        seq.finish_reason = FINISH_LENGTH
