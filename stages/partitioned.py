"""A whole-group step over a table larger than memory: its rows hash-partitioned by a group key and spilled to local
disk, the step run on one partition at a time, its outputs merged back into the input's row order (issue 49).

The step sees each partition's rows in input order and every row of a group in one partition, so a step whose
values depend only on the rows of each group (and their order) gives the values it gives on the whole table: the
agentic response-level rewards (stages/response_rewards.py) sum each group with ``np.bincount`` in row order, and
discount each trajectory on its own. Memory: one partition's rows and the step's scratch, the merge's cursor per
partition; the partition of each row is a ``uint16`` file read in chunks. No Ray, no Prefect.

Shapes: ``batches`` are tables of the input's columns in input order; ``step(table (n,)) → (table (n,), result)``
keeps the number and order of its rows.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from schemas.errors import InvariantError
from stages.advantages import row_id_keys

PARTITION_FILE = "partition.u16"  # the partition of every input row, in input order
_FNV_OFFSET, _FNV_PRIME = np.uint64(14695981039346656037), np.uint64(1099511628211)


def key_hash(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """n string keys → (n,) uint64 FNV-1a hashes of their bytes and :func:`row_id_keys`' terminator (not of the
    padding, whose width depends on the batch): the same key gives the same hash in every batch and process (never
    Python's ``hash``)."""
    fixed = row_id_keys(keys)
    n = len(fixed)
    width = fixed.dtype.itemsize
    matrix = fixed.view(np.uint8).reshape(n, width)
    lengths = np.char.str_len(fixed)  # the key's bytes and its terminator
    out = np.full(n, _FNV_OFFSET, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(width):
            out = np.where(lengths > j, (out ^ matrix[:, j].astype(np.uint64)) * _FNV_PRIME, out)
    return out


def _spill(batches: Iterable[pa.Table], key: str, parts: int, folder: str) -> pa.Schema | None:
    """Pass 1: each row to ``in-{p}.arrow`` of its partition ``p`` (input order kept), ``p`` to the partition file.
    Returns the input's schema (None when there were no batches)."""
    writers: list[Any] = []
    schema = None
    with open(os.path.join(folder, PARTITION_FILE), "wb") as ids_out:
        for batch in batches:
            if schema is None:
                schema = batch.schema
                writers = [ipc.new_stream(os.path.join(folder, f"in-{p}.arrow"), schema) for p in range(parts)]
            part = (key_hash(batch.column(key)) % np.uint64(parts)).astype(np.uint16)
            part.tofile(ids_out)
            order = np.argsort(part, kind="stable")
            bounds = np.searchsorted(part[order], np.arange(parts + 1))
            grouped = batch.take(pa.array(order))
            for p in np.flatnonzero(np.diff(bounds)):
                writers[p].write_table(grouped.slice(int(bounds[p]), int(bounds[p + 1] - bounds[p])))
    for writer in writers:
        writer.close()
    return schema


def _compute(parts: int, folder: str, step: Callable[[pa.Table], tuple[pa.Table, Any]]) -> list[tuple[int, Any]]:
    """Pass 2: ``step`` on each non-empty partition, its table to ``out-{p}.arrow``; (rows, result) per partition."""
    results = []
    for p in range(parts):
        source = os.path.join(folder, f"in-{p}.arrow")
        if not os.path.exists(source):  # no input rows at all
            results.append((0, None))
            continue
        with pa.memory_map(source) as f:
            table = ipc.open_stream(f).read_all()
        os.remove(source)
        if not table.num_rows:
            results.append((0, None))
            continue
        out, result = step(table)
        if out.num_rows != table.num_rows:
            raise InvariantError(f"partitioned step returned {out.num_rows} rows for {table.num_rows}; it must keep "
                                 "every row, in order")
        with ipc.new_stream(os.path.join(folder, f"out-{p}.arrow"), out.schema) as writer:
            writer.write_table(out)
        results.append((table.num_rows, result))
        del table, out
    return results


class _Cursor:
    """The rows of one partition's output, handed out in order ``n`` at a time."""

    def __init__(self, path: str | None):
        self.reader = ipc.open_stream(pa.memory_map(path)) if path else None
        self.pending: list[pa.RecordBatch] = []
        self.left = 0

    def take(self, n: int) -> pa.Table:
        parts = []
        while n:
            if not self.pending:
                self.pending = [self.reader.read_next_batch()]
            head = self.pending[0]
            k = min(n, head.num_rows)
            parts.append(head.slice(0, k))
            self.pending = [head.slice(k)] if k < head.num_rows else []
            n -= k
        return pa.Table.from_batches(parts)


def _merged(parts: int, folder: str, rows: int) -> Iterator[pa.Table]:
    """Pass 3: the partitions' outputs back in input order, ``rows`` rows a table."""
    cursors = [_Cursor(path if os.path.exists(path) else None)
               for path in (os.path.join(folder, f"out-{p}.arrow") for p in range(parts))]
    with open(os.path.join(folder, PARTITION_FILE), "rb") as ids_in:
        while True:
            part = np.fromfile(ids_in, dtype=np.uint16, count=rows)
            if not len(part):
                return
            order = np.argsort(part, kind="stable")
            counts = np.bincount(part, minlength=parts)
            pieces = pa.concat_tables([cursors[p].take(int(counts[p])) for p in np.flatnonzero(counts)])
            inverse = np.empty_like(order)
            inverse[order] = np.arange(len(order))
            yield pieces.take(pa.array(inverse))


def partitioned(batches: Iterable[pa.Table], key: str, parts: int, step: Callable[[pa.Table], tuple[pa.Table, Any]],
                folder: str, rows: int = 65_536) -> tuple[list[tuple[int, Any]], Iterator[pa.Table]]:
    """Run ``step`` on the rows of ``batches`` in ``parts`` hash partitions of column ``key`` (a string column), with
    ``folder`` (an empty local folder the caller removes) for the spill. Returns the (rows, result) of each partition
    — an empty one's result is None — and an iterator over the steps' output rows in input order, ``rows`` a table;
    the iterator needs ``folder`` until it ends."""
    if not 1 <= parts <= np.iinfo(np.uint16).max:
        raise InvariantError(f"partitioned step: {parts} partitions; use 1 to {np.iinfo(np.uint16).max}")
    _spill(batches, key, parts, folder)
    results = _compute(parts, folder, step)
    return results, _merged(parts, folder, rows)
