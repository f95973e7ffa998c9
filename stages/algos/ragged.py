"""Ragged arrays: flat values plus row offsets, the in-memory form of Arrow ``list<...>`` columns.

Token data never gets padded on disk. Inside the pure algorithm code a column of ``B`` variable-length rows is a
:class:`Ragged`: ``values`` of shape ``(N,)`` (all rows concatenated) and ``offsets`` of shape ``(B+1,)`` with
``offsets[0] = 0`` and ``offsets[B] = N``; row ``b`` is ``values[offsets[b]:offsets[b+1]]``. Per-row reductions use
``np.bincount`` over :meth:`Ragged.row_index`, so empty rows are legal everywhere and no Python loop runs per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Ragged:
    """``B`` rows of variable length stored flat. ``values (N,)``, ``offsets (B+1,) int64``."""

    values: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or self.offsets[0] != 0:
            raise ValueError("Ragged.offsets must be 1-D, non-empty and start at 0")
        if self.offsets[-1] != len(self.values):
            raise ValueError(f"Ragged.offsets end at {self.offsets[-1]} but there are {len(self.values)} values")

    # ---- shape -----------------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """``(B,)`` int64 row lengths."""
        return np.diff(self.offsets)

    def row_index(self) -> np.ndarray:
        """``(N,)`` int64: the row each flat element belongs to."""
        return np.repeat(np.arange(self.num_rows, dtype=np.int64), self.lengths)

    def position(self) -> np.ndarray:
        """``(N,)`` int64: the position of each flat element inside its row."""
        return np.arange(len(self.values), dtype=np.int64) - np.repeat(self.offsets[:-1], self.lengths)

    def with_values(self, values: np.ndarray) -> "Ragged":
        """Same rows, new flat values ``(N,)``."""
        return Ragged(np.asarray(values), self.offsets)

    def row(self, b: int) -> np.ndarray:
        return self.values[self.offsets[b] : self.offsets[b + 1]]

    # ---- conversion --------------------------------------------------------------------------------------------
    @classmethod
    def from_arrow(cls, column: pa.Array | pa.ChunkedArray, dtype: np.dtype | type | None = None) -> "Ragged":
        """From an Arrow ``list<T>`` column (no null rows). Zero-copy where Arrow allows it."""
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        if column.null_count:
            raise ValueError("ragged column has null rows; every row needs a list (possibly empty)")
        offsets = column.offsets.to_numpy().astype(np.int64)
        flat = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        offsets = offsets - offsets[0]
        if dtype is not None:
            flat = flat.astype(dtype, copy=False)
        return cls(flat, offsets)

    def to_arrow(self, value_type: pa.DataType) -> pa.ListArray:
        """To an Arrow ``list<value_type>`` column."""
        return pa.ListArray.from_arrays(pa.array(self.offsets.astype(np.int32)), pa.array(self.values, type=value_type))

    @classmethod
    def from_rows(cls, rows: list, dtype: np.dtype | type = np.float32) -> "Ragged":
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.concatenate([np.asarray(r, dtype=dtype) for r in rows]) if len(rows) else np.zeros(0, dtype)
        return cls(flat.astype(dtype, copy=False), offsets)

    @classmethod
    def from_padded(cls, padded: np.ndarray, lengths: np.ndarray) -> "Ragged":
        """From a right-padded ``(B, T)`` array keeping the first ``lengths[b]`` entries of each row."""
        lengths = np.asarray(lengths, dtype=np.int64)
        keep = np.arange(padded.shape[1])[None, :] < lengths[:, None]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return cls(np.asarray(padded)[keep], offsets)

    def to_padded(self, width: int | None = None, fill: float = 0) -> np.ndarray:
        """To a right-padded ``(B, width)`` array (``width`` defaults to the longest row)."""
        width = int(self.lengths.max(initial=0)) if width is None else width
        out = np.full((self.num_rows, width), fill, dtype=self.values.dtype)
        keep = np.arange(width)[None, :] < self.lengths[:, None]
        out[keep] = self.values
        return out


def row_sum(x: Ragged, mask: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
    """``(B,)`` float64 ``Σ_t x·mask`` per row (0 for empty rows), summed in row order. ``rows``: ``x.row_index()``
    when the caller has it."""
    v = x.values if mask is None else x.values * mask
    rows = x.row_index() if rows is None else rows
    return np.bincount(rows, weights=v.astype(np.float64, copy=False), minlength=x.num_rows)


def row_masked_mean(x: Ragged, mask: np.ndarray) -> np.ndarray:
    """``(B,)`` float64 ``Σ x·m / (Σ m + 1e-8)``, exactly 0 where ``Σ m = 0`` (ROLL ``masked_mean(dim=-1)``)."""
    rows = x.row_index()
    s = row_sum(x.with_values(mask), rows=rows)
    total = row_sum(x, mask, rows=rows)
    return np.where(s > 0, total / (s + 1e-8), 0.0)


def last_index(x: Ragged) -> np.ndarray:
    """``(B,)`` flat index of each row's last element (``-1`` for empty rows)."""
    return np.where(x.lengths > 0, x.offsets[1:] - 1, -1)


def segment_ids(x: Ragged, mask: np.ndarray) -> np.ndarray:
    """``(N,)`` int64 id of the maximal run of ``mask == 1`` inside a row each element belongs to, ``-1`` outside.

    Runs never cross row boundaries. Ids are consecutive from 0 in flat order.
    """
    m = np.asarray(mask).astype(bool)
    starts = m.copy()
    starts[1:] &= ~m[:-1]
    starts[x.offsets[:-1][x.lengths > 0]] = m[x.offsets[:-1][x.lengths > 0]]
    ids = np.cumsum(starts) - 1
    return np.where(m, ids, -1)
