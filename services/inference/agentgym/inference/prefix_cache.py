"""Automatic prefix caching: the KV caches of earlier sequences, reused by prompts that start with their ids.

An entry holds the keys/values of a token sequence the engine has already run through the model (a prompt
once it was prefilled; a finished or cancelled sequence: its prompt and every sampled id but the last,
which was never fed). A new prompt that starts with an entry's ids reuses that entry's KV for the common
prefix and only the rest of the prompt is prefilled.

Index: ids are cut into blocks of `block_size` tokens; block i's key is the chained hash
`hash((key of block i-1, *ids of block i))` (`chain_key`), so one key stands for the whole prefix up to
the end of its block. `_holders[key]` lists the entries containing that prefix. A lookup hashes the
prompt block by block while some entry holds the prefix (O(prompt length)), then extends the match token
by token within the next (partial) block of the few most recently stored holders, so the match is exact
to the token, not rounded down to a block. Entries shorter than one block are not kept. The chosen
entry's ids are compared with the prompt before it is used: a hash collision can never serve another
prefix's KV (it only shortens the match to the true common prefix).

Bounded by a token budget: entries are kept in LRU order (a hit or a re-insert refreshes an entry) and the
least recently used are evicted while the columns they hold exceed `max_tokens`. An entry whose ids are a prefix
of a newly inserted one is dropped (superseded: the new entry serves every prompt it served, as far), and an
insert already covered by an entry is not stored twice: a multi-turn episode keeps one entry, its latest
context.

Storage: an entry's keys/values are views of the first `length` columns of its buffers, which may have `room` for
more (the engine stores a prompt after its prefill with room for the tokens its request may still sample). The
entry that supersedes one takes its buffers over and writes only its new columns after the old ones when they fit
(else new buffers, the old columns copied from the old ones): a turn's finished context is stored by writing its
sampled tokens' KV after its prompt's, instead of copying the whole context again. Nothing ever writes a column
an entry holds, so a superseded entry that a prefill still reads from stays valid. The budget counts the buffers'
columns, room included.

Entries carry the policy version of the weights that computed them; `clear()` drops everything (the engine calls
it when it swaps weights) and lookups skip entries of another version.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice

import torch

BLOCK_SIZE = 16
_ROOT = 0x5EED  # the chain's seed (the "hash" of the empty prefix)
_CANDIDATES = 16  # holders of the deepest matched block compared token by token (the most recently stored first)


def chain_key(previous: int, block: Sequence[int]) -> int:
    """The key of a block given the key of the prefix before it."""
    return hash((previous, *block))


def block_keys(
    ids: Sequence[int], block_size: int = BLOCK_SIZE, limit: int | None = None, known: Sequence[int] = ()
) -> list[int]:
    """The chained key of each full block of `ids[:limit]`; `known`: the keys of a prefix of `ids` already computed
    (a completion's prompt's), continued from."""
    end = len(ids) if limit is None else min(limit, len(ids))
    keys = list(known)
    key = keys[-1] if keys else _ROOT
    for start in range(len(keys) * block_size, end - block_size + 1, block_size):
        key = chain_key(key, ids[start : start + block_size])
        keys.append(key)
    return keys


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0, stop: int | None = None) -> int:
    """The length of the common prefix of `a` and `b` (capped at `stop`), given that `a[:start] == b[:start]`."""
    end = min(len(a), len(b)) if stop is None else min(len(a), len(b), stop)
    n = start
    while n < end and a[n] == b[n]:
        n += 1
    return n


@dataclass(eq=False)
class CachedPrefix:
    """The KV of `ids`: one `[kv_heads, len(ids), head_dim]` key and value tensor per layer (views of the first
    `len(ids)` columns of `key_buffers` / `value_buffers`, `[kv_heads, capacity, head_dim]` each)."""

    ids: list[int]
    key_buffers: list[torch.Tensor] = field(repr=False)
    value_buffers: list[torch.Tensor] = field(repr=False)
    version: int
    block_keys: list[int] = field(repr=False)
    keys: list[torch.Tensor] = field(init=False, repr=False)
    values: list[torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.keys = [buffer[:, : self.length] for buffer in self.key_buffers]
        self.values = [buffer[:, : self.length] for buffer in self.value_buffers]

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def capacity(self) -> int:
        """Columns of its buffers, room included: what it counts against the cache's budget."""
        return int(self.key_buffers[0].shape[1])


KVFactory = Callable[[int], tuple[list[torch.Tensor], list[torch.Tensor]]]
"""`kv(start)`: the keys and values of the inserted ids from `start` on, `[kv_heads, len(ids) - start, head_dim]`
per layer."""


class PrefixCache:
    """LRU store of KV caches keyed by their token ids; see the module docstring."""

    def __init__(self, max_tokens: int, block_size: int = BLOCK_SIZE) -> None:
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.tokens = 0
        """Columns of KV held, room included (bounded by `max_tokens`)."""
        self.evicted = 0
        """Entries dropped to stay within the token budget (cumulative)."""
        self.superseded = 0
        """Entries dropped because a longer entry starting with their ids was inserted (cumulative)."""
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # LRU order: least recently used first
        self._holders: dict[int, dict[int, None]] = {}  # block key -> entries holding that prefix (ordered set)
        self._ends: dict[int, dict[int, None]] = {}  # key of an entry's last full block -> such entries
        self._next_id = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens >= self.block_size

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int], limit: int, version: int) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the longest prefix with `ids[:limit]` and that prefix's length (None, 0 on a miss).

        A hit refreshes the entry's LRU position."""
        best, length, key = self._find(ids, limit, version)
        if best is None:
            return None, 0
        self._entries.move_to_end(key)
        return best, length

    def insert(self, ids: list[int], version: int, kv: KVFactory, room: int = 0) -> bool:
        """Keep the KV of `ids` (`kv(start)` returns it from `start` on, called only when it is stored: from
        where a superseded entry's KV ends, else 0), in new buffers with `room` columns more unless a superseded
        entry's buffers hold it; False when not stored (too short, over the budget alone, or already covered by
        an entry, which is refreshed instead)."""
        n = len(ids)
        if n < self.block_size or n > self.max_tokens:
            return False
        covering, length, key = self._find(ids, n, version)
        if covering is not None and length == n:
            self._entries.move_to_end(key)
            return False
        keys = block_keys(ids, self.block_size)
        base: CachedPrefix | None = None  # the longest superseded entry: its KV is this one's first columns
        for block_key in keys:  # entries that are a prefix of this one end at one of its blocks
            for other in list(self._ends.get(block_key, ())):
                entry = self._entries[other]
                if entry.length <= n and entry.version == version and entry.ids == ids[: entry.length]:
                    self._remove(other)
                    self.superseded += 1
                    if base is None or entry.length > base.length:
                        base = entry
        key_buffers, value_buffers = self._buffers(base, n, kv, room)
        entry = CachedPrefix(list(ids), key_buffers, value_buffers, version, keys)
        entry_id = self._next_id
        self._next_id += 1
        self._entries[entry_id] = entry
        for block_key in keys:
            self._holders.setdefault(block_key, {})[entry_id] = None
        self._ends.setdefault(keys[-1], {})[entry_id] = None
        self.tokens += entry.capacity
        while self.tokens > self.max_tokens:
            oldest = next(iter(self._entries))
            self._remove(oldest)
            self.evicted += 1
        return True

    def _buffers(
        self, base: CachedPrefix | None, length: int, kv: KVFactory, room: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Buffers holding the KV of an entry of `length` tokens whose first `base.length` are `base`'s: `base`'s
        own with the new columns written after its own when they fit (it was just removed from the index: nothing
        else writes there), else new ones of `length + room` columns (at most the budget)."""
        start = 0 if base is None else base.length
        new_keys, new_values = kv(start)
        if base is not None and base.capacity >= length:
            for buffer, part in zip(base.key_buffers + base.value_buffers, new_keys + new_values, strict=True):
                buffer[:, start:length].copy_(part)
            return base.key_buffers, base.value_buffers
        capacity = min(self.max_tokens, length + max(room, 0))
        old_keys, old_values = ([], []) if base is None else (base.keys, base.values)
        buffers: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for layers, parts, olds in ((buffers[0], new_keys, old_keys), (buffers[1], new_values, old_values)):
            for index, part in enumerate(parts):
                buffer = part.new_empty((part.shape[0], capacity, part.shape[2]))
                if start:
                    buffer[:, :start].copy_(olds[index])
                buffer[:, start:length].copy_(part)
                layers.append(buffer)
        return buffers

    def clear(self) -> int:
        """Drop every entry; returns how many there were."""
        count = len(self._entries)
        self._entries.clear()
        self._holders.clear()
        self._ends.clear()
        self.tokens = 0
        return count

    def _find(self, ids: list[int], limit: int, version: int) -> tuple[CachedPrefix | None, int, int]:
        limit = min(limit, len(ids))
        size = self.block_size
        if limit < size or not self._entries:
            return None, 0, -1
        holders: dict[int, None] | None = None
        depth = 0
        key = _ROOT
        for start in range(0, limit - size + 1, size):
            key = chain_key(key, ids[start : start + size])
            found = self._holders.get(key)
            if not found:
                break
            holders = found
            depth += 1
        if holders is None:
            return None, 0, -1
        matched = depth * size
        candidates: list[tuple[int, int, CachedPrefix]] = []
        for entry_id in islice(reversed(holders), _CANDIDATES):
            entry = self._entries[entry_id]
            if entry.version == version:
                candidates.append((common_prefix(entry.ids, ids, matched, limit), entry_id, entry))
        candidates.sort(key=lambda candidate: candidate[0], reverse=True)  # stable: most recent first on ties
        # Equal chained keys almost surely mean equal ids; make sure (a collision must never serve wrong KV).
        for length, entry_id, entry in candidates:
            if entry.ids[:matched] == ids[:matched]:
                return entry, length, entry_id
        # A hash collision: fall back to the candidates' true common prefixes.
        best: tuple[int, int, CachedPrefix | None] = (0, -1, None)
        for _, entry_id, entry in candidates:
            length = common_prefix(entry.ids, ids, 0, limit)
            if length > best[0]:
                best = (length, entry_id, entry)
        return best[2], best[0], best[1]

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.tokens -= entry.capacity
        for block_key in entry.block_keys:
            holders = self._holders.get(block_key)
            if holders is not None:
                holders.pop(entry_id, None)
                if not holders:
                    del self._holders[block_key]
        ends = self._ends.get(entry.block_keys[-1])
        if ends is not None:
            ends.pop(entry_id, None)
            if not ends:
                del self._ends[entry.block_keys[-1]]
