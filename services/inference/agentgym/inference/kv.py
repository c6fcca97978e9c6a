"""The running batch's KV cache layer: a `DynamicLayer` over buffers with spare rows and columns.

transformers' `DynamicLayer.update` concatenates the new keys/values to the whole cache, i.e. copies the
cache of every running sequence at every decode step; and rebuilding the batch cache whenever sequences
join or leave copies it again. With dozens of sequences of hundreds of tokens those copies cost as much
as the forward pass on CPU. `GrowingLayer` keeps each layer's keys/values in a buffer with room for more
rows and columns and exposes `keys` / `values` as views of its live region `[:rows, :, start:end]`:

- a forward pass writes its new columns in place (the buffer is reallocated, with more room, only when
  full);
- sequences join by copying just their rows into free rows (`append_rows`), right-aligned to the live
  columns (the live region widens to the left when they are longer);
- sequences leave by moving the last live rows into their places (`move_rows`: only moved rows are
  copied), and leading columns that became padding in every row are dropped by moving `start`.

Columns outside a row's real tokens hold finite values (zeros, or stale keys/values of earlier tokens)
which the attention mask excludes exactly (masked scores get zero weight).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


def spare_columns(live: int) -> int:
    """Room left after `live` columns when a buffer is (re)allocated: amortised O(1) copies per appended column."""
    return max(32, live // 8)


def compaction(keep: list[int], rows: int) -> tuple[list[int], list[int], list[int]]:
    """How to keep rows `keep` (sorted) of `rows` in `len(keep)` leading rows by moving the last kept rows into
    the gaps: (old index of each new row, gap rows, rows moved into them)."""
    count = len(keep)
    kept = set(keep)
    gaps = [row for row in range(count) if row not in kept]
    moved = [row for row in keep if row >= count]
    order = list(range(count))
    for gap, row in zip(gaps, moved, strict=True):
        order[gap] = row
    return order, gaps, moved


class GrowingLayer(DynamicLayer):
    """One layer's KV for a batch of rows: `keys` / `values` are views `[rows, kv_heads, columns, head_dim]`."""

    def __init__(self) -> None:
        super().__init__()
        self._keys: torch.Tensor | None = None  # [row capacity, kv_heads, column capacity, head_dim]
        self._values: torch.Tensor | None = None
        self._rows = 0
        self._start = 0
        self._end = 0

    @classmethod
    def from_buffers(cls, keys: torch.Tensor, values: torch.Tensor, end: int) -> GrowingLayer:
        """A layer whose live region is every row and columns `[:end]` of these buffers (which it takes over)."""
        layer = cls()
        layer.device = keys.device
        layer.is_initialized = True
        layer._keys, layer._values = keys, values
        layer._rows, layer._start, layer._end = int(keys.shape[0]), 0, end
        layer._expose()
        return layer

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def columns(self) -> int:
        return self._end - self._start

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self._keys is None:
            self._rows = int(key_states.shape[0])
            self._allocate(key_states, value_states, self._rows, n + spare_columns(n))
        elif self._end + n > self._keys.shape[-2]:
            live = self.columns + n
            self._allocate(key_states, value_states, self._keys.shape[0], live + spare_columns(live))
        assert self._keys is not None and self._values is not None
        self._keys[: self._rows, :, self._end : self._end + n].copy_(key_states)
        self._values[: self._rows, :, self._end : self._end + n].copy_(value_states)
        self._end += n
        self._expose()
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def append_rows(self, other: GrowingLayer, max_rows: int | None = None) -> None:
        """Add `other`'s rows after this layer's, right-aligned to its live columns: the live region widens to
        max(its columns, other's columns); the new rows' extra leading columns (and the old rows' new leading
        columns) are padding for the caller's mask."""
        assert other.keys is not None and other.values is not None
        if self._keys is None or self._values is None:
            self.is_initialized, self.device = True, other.device
            self._allocate(other.keys, other.values, 0, 0)
        assert self._keys is not None and self._values is not None
        rows = self._rows + other.rows
        width = other.columns
        if rows > self._keys.shape[0] or self._end - width < 0:
            capacity = max(rows, rows * 3 // 2)
            if max_rows is not None:
                capacity = max(rows, min(capacity, max_rows))
            live = max(self.columns, width)
            self._allocate(other.keys, other.values, capacity, live + spare_columns(live), right_align=live)
        assert self._keys is not None and self._values is not None
        self._keys[self._rows : rows, :, self._end - width : self._end].copy_(other.keys)
        self._values[self._rows : rows, :, self._end - width : self._end].copy_(other.values)
        self._rows = rows
        self._start = min(self._start, self._end - width)
        self._expose()

    def move_rows(self, gaps: list[int], moved: list[int], rows: int) -> None:
        """Copy the live columns of rows `moved` into rows `gaps`, then keep the first `rows` rows
        (see `compaction`)."""
        if gaps and self._keys is not None and self._values is not None:
            device = self._keys.device
            to = torch.tensor(gaps, device=device)
            source = torch.tensor(moved, device=device)
            columns = slice(self._start, self._end)
            self._keys[to, :, columns] = self._keys[source, :, columns]
            self._values[to, :, columns] = self._values[source, :, columns]
        self._rows = rows
        self._expose()

    def drop_leading(self, columns: int) -> None:
        """Drop the first `columns` live columns (padding in every row)."""
        self._start += columns
        self._expose()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (in that order, repeats allowed): a copy of the live region."""
        if self.keys is None or self.values is None:
            return
        keys = self.keys.index_select(0, rows)
        values = self.values.index_select(0, rows)
        live = self.columns
        self._allocate(keys, values, keys.shape[0], live + spare_columns(live), copy=False)
        assert self._keys is not None and self._values is not None
        self._keys[:, :, :live].copy_(keys)
        self._values[:, :, :live].copy_(values)
        self._rows, self._start, self._end = int(keys.shape[0]), 0, live
        self._expose()

    def row(self, row: int, columns: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """One row's keys/values at these live columns, `[kv_heads, columns, head_dim]`: views of a `slice` of
        them (to be read before the layer changes), copies of an index tensor's."""
        assert self.keys is not None and self.values is not None
        if isinstance(columns, slice):
            return self.keys[row, :, columns], self.values[row, :, columns]
        return self.keys[row].index_select(1, columns), self.values[row].index_select(1, columns)

    def _allocate(
        self,
        keys_like: torch.Tensor,
        values_like: torch.Tensor,
        rows: int,
        columns: int,
        *,
        copy: bool = True,
        right_align: int | None = None,
    ) -> None:
        """New zeroed buffers of `rows` x `columns`; the live region is copied over (when `copy`), its columns
        ending at `right_align` (default: its width)."""
        live = self.columns
        end = live if right_align is None else right_align
        keys = keys_like.new_zeros((rows, keys_like.shape[1], columns, keys_like.shape[3]))
        values = values_like.new_zeros((rows, values_like.shape[1], columns, values_like.shape[3]))
        if copy and self._rows and live and self.keys is not None and self.values is not None:
            keys[: self._rows, :, end - live : end].copy_(self.keys)
            values[: self._rows, :, end - live : end].copy_(self.values)
        self._keys, self._values = keys, values
        self._start, self._end = end - live, end

    def _expose(self) -> None:
        if self._keys is not None and self._values is not None:
            self.keys = self._keys[: self._rows, :, self._start : self._end]
            self.values = self._values[: self._rows, :, self._start : self._end]
