"""A stage's output as Parquet part files: the Ray Data sink that writes each write task's blocks, in order, into one
file (:func:`ordered_parquet_sink`), the writer options of a stage's files (:func:`parquet_write_options`), and the
part files' names and sizes for the manifest (:func:`rename_parts`). No Ray import at module top."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stages.storage import Location

_SINK_CLASS: list[type] = []
# Rows per Parquet row group of a stage's output: a reader of a row range (the advantages stage's join of the
# rewarded rows of one samples file) decodes at most this many rows more than it needs.
ROW_GROUP_ROWS = 65_536


def parquet_write_options(schema: pa.Schema) -> dict[str, Any]:
    """Options of ``pq.ParquetWriter`` for a stage's output: dictionary encoding for the string columns only.

    pyarrow's default dictionary-encodes every column; for the token and float list columns (token ids, log-probs,
    advantages: few repeats) it builds a dictionary per page and then falls back to plain
    encoding, which made writing a 1,024-row block of an advantaged table 4× slower and its file 30 % larger
    (BENCHMARKS.md, issue 49). The values written are the same either way."""
    return {"use_dictionary": [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]}


def ordered_parquet_sink(folder: Location):
    """A Ray Data datasink writing each write task's blocks, in order, into one file named by the task index.

    Ray Data's ``write_parquet`` hands a task's blocks to pyarrow's threaded dataset writer, which may put them into
    the file in another order (about 1 run in 100 here), so outputs differed from run to run. Task indices follow
    the dataset order (``preserve_order``): the sorted file names give the rows in dataset order. The class is
    made on first use so that importing this module does not import Ray."""
    if not _SINK_CLASS:
        from ray.data.block import BlockAccessor
        from ray.data.datasource import Datasink

        class OrderedParquetSink(Datasink):
            def __init__(self, folder: Location):
                self.folder = folder

            def write(self, blocks, ctx) -> int:
                """The task's blocks into one file as they come (a streaming step's output is never whole), in row
                groups of at most :data:`ROW_GROUP_ROWS`. The file's schema is the blocks' unified schema: blocks
                are held back while it still has a column of type null (a block whose values in it are all None),
                and written, each cast to it, from the first block that types every column (or at the end)."""
                rows, writer, f, held = 0, None, None, []
                try:
                    for table in (BlockAccessor.for_block(b).to_arrow() for b in blocks):
                        if not table.num_rows:
                            continue
                        rows += table.num_rows
                        if writer is not None:
                            writer.write_table(table if table.schema.equals(schema) else table.cast(schema),
                                               row_group_size=ROW_GROUP_ROWS)
                            continue
                        held.append(table)
                        schema = pa.unify_schemas([t.schema for t in held])
                        if not any(pa.types.is_null(fld.type) for fld in schema):
                            f, writer = self._open(ctx, schema, held)
                            held = []
                    if held:
                        f, writer = self._open(ctx, pa.unify_schemas([t.schema for t in held]), held)
                finally:
                    if writer is not None:
                        writer.close()
                    if f is not None:
                        f.close()
                return rows

            def _open(self, ctx, schema: pa.Schema, held: list[pa.Table]):
                """(stream, writer) of the task's file with ``schema``, the ``held`` blocks written into it."""
                f = self.folder.fs.open_output_stream(f"{self.folder.path}/{ctx.task_idx:08d}.parquet")
                writer = pq.ParquetWriter(f, schema, **parquet_write_options(schema))
                for table in held:
                    writer.write_table(table.cast(schema), row_group_size=ROW_GROUP_ROWS)
                return f, writer

        _SINK_CLASS.append(OrderedParquetSink)
    return _SINK_CLASS[0](folder)


def rename_parts(tmp: Location) -> list[dict]:
    """Name the written files part-00000.parquet, ... in write order; return their row counts and sizes. On an
    object store, where a move is a copy, the files keep the names the sink gave them (the write tasks' indices, in
    write order) and the manifest lists them in that order."""
    files = []
    for i, path in enumerate(tmp.parquet_files()):
        dest = f"{tmp.path}/part-{i:05d}.parquet" if tmp.atomic_rename else path
        if dest != path:
            tmp.fs.move(path, dest)
        with tmp.fs.open_input_file(dest) as f:
            meta = pq.read_metadata(f)
        files.append({"name": dest.rsplit("/", 1)[-1], "rows": meta.num_rows,
                      "bytes": tmp.fs.get_file_info(dest).size})
    return files
