"""The rows a training step reads: the training columns of an advantaged table, every part of its stage folder, in a
fixed row order (sorted by ``row_id``), as :class:`stages.train.batching.TokenRows`. No Ray, no DeepSpeed."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from stages.train.batching import TokenRows


# Columns the training step reads (the rest of the advantaged table stays on disk).
TRAIN_COLUMNS = ("row_id", "input_ids", "response_mask", "advantages", "returns", "values", "old_log_probs",
                 "ref_log_probs", "infer_logprobs", "final_response_mask", "difficulty")


def read_train_table(samples, names: list[str]):
    """The columns of the advantaged table that training reads (of ``names``, the table's columns), every Parquet
    part of the stage folder ``samples`` (a :class:`stages.storage.Location`) in order; None when it has no part."""
    columns = [c for c in TRAIN_COLUMNS if c in names]
    parts = [pq.read_table(p, columns=columns, filesystem=samples.fs) for p in samples.parquet_files()]
    return pa.concat_tables(parts) if parts else None


def rows_of_table(table, where: str) -> TokenRows:
    """The token columns of an advantaged table in a fixed order (sorted by ``row_id``), whatever order the files
    or the data loader delivered them in: every rank and every resume sees the same rows at the same indices."""
    if "row_id" in table.column_names:
        table = table.sort_by("row_id")
    return TokenRows.from_arrow(table, where)
