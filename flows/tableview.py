"""Reading a table folder for people: ``rollflow inspect`` (schema, rows, groups, summary statistics) and
``rollflow validate`` (schema and invariants). Both stream record batches, so memory does not grow with the table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from schemas.errors import SchemaError
from schemas.tables import TABLES, TableSpec
from stages.preflight import check_table_data
from stages.storage import Location, read_manifest, read_table_schema

IDENTITY_COLUMNS = ["row_id", "group_id", "traj_id", "turn_idx"]


def detect_spec(loc: Location, schema: pa.Schema) -> TableSpec:
    """The table contract of a folder: from its manifest, else the widest spec whose required columns it has."""
    manifest = read_manifest(loc)
    if manifest and manifest.get("table") in TABLES:
        return TABLES[manifest["table"]]
    for name in ("advantaged", "samples", "rewarded"):
        if all(c in schema.names for c in TABLES[name].required):
            return TABLES[name]
    closest = max(TABLES.values(), key=lambda spec: sum(c in schema.names for c in spec.required))
    if sum(c in schema.names for c in closest.required) > len(closest.required) // 2:
        closest.check_schema(schema, loc.path)  # names the missing column of the table it nearly is
    raise SchemaError(f"{loc.path}: the columns ({', '.join(schema.names)}) match no rollflow table "
                      f"({', '.join(TABLES)}); is this a stage output folder?")


@dataclass
class Moments:
    """Streaming count/sum/sumsq/min/max of a numeric column (or the flattened values of a list column)."""

    n: int = 0
    s: float = 0.0
    ss: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf
    nonfinite: int = 0

    def add(self, values: np.ndarray) -> None:
        v = np.asarray(values, dtype=np.float64)
        finite = np.isfinite(v)
        self.nonfinite += int((~finite).sum())
        v = v[finite]
        if v.size:
            self.n += v.size
            self.s += float(v.sum())
            self.ss += float((v * v).sum())
            self.lo = min(self.lo, float(v.min()))
            self.hi = max(self.hi, float(v.max()))

    def line(self) -> str:
        if not self.n:
            return "no values"
        mean = self.s / self.n
        std = math.sqrt(max(self.ss / self.n - mean * mean, 0.0))
        extra = f"  NON-FINITE: {self.nonfinite}" if self.nonfinite else ""
        return f"mean {mean:10.4g}  std {std:10.4g}  min {self.lo:10.4g}  max {self.hi:10.4g}{extra}"


@dataclass
class TableSummary:
    path: str
    spec: str
    rows: int = 0
    files: int = 0
    schema: list[str] = field(default_factory=list)
    groups: int = 0
    trajectories: int = 0
    columns: dict[str, Moments] = field(default_factory=dict)
    lengths: dict[str, Moments] = field(default_factory=dict)
    response_tokens: int = 0
    manifest: dict | None = None


def summarize(path: str) -> TableSummary:
    loc = Location.of(path)
    schema = read_table_schema(loc, "table")
    spec = detect_spec(loc, schema)
    out = TableSummary(loc.path, spec.name, schema=[f"{f.name}: {f.type}" for f in schema],
                       files=len(loc.parquet_files()), manifest=read_manifest(loc))
    groups, trajs = set(), set()
    dataset = pads.dataset(loc.parquet_files(), filesystem=loc.fs)
    for batch in dataset.to_batches(batch_size=4096):
        out.rows += batch.num_rows
        for name in batch.schema.names:
            col = batch.column(name)
            if name == "group_id":
                groups.update(col.to_pylist())
            elif name == "traj_id":
                trajs.update(col.to_pylist())
            elif pa.types.is_list(col.type):
                out.lengths.setdefault(name, Moments()).add(pc.list_value_length(col).to_numpy(zero_copy_only=False))
                if name == "response_mask":
                    out.response_tokens += int(pc.sum(pc.list_flatten(col)).as_py() or 0)
                elif pa.types.is_floating(col.type.value_type):
                    out.columns.setdefault(name, Moments()).add(pc.list_flatten(col).to_numpy(zero_copy_only=False))
            elif pa.types.is_floating(col.type) or (pa.types.is_integer(col.type) and name != "turn_idx"):
                out.columns.setdefault(name, Moments()).add(col.to_numpy(zero_copy_only=False))
    out.groups, out.trajectories = len(groups), len(trajs)
    return out


def render(summary: TableSummary) -> str:
    lines = [f"table     {summary.spec}  ({summary.path})",
             f"rows      {summary.rows:,} in {summary.files} file(s)"]
    if summary.manifest:
        m = summary.manifest
        lines.append(f"stage     {m.get('stage')} v{m.get('version')}  fingerprint {str(m.get('fingerprint'))[:12]}")
    if summary.groups:
        lines.append(f"groups    {summary.groups:,}  trajectories {summary.trajectories:,}  "
                     f"rows/trajectory {summary.rows / max(summary.trajectories, 1):.2f}")
    if summary.response_tokens:
        lines.append(f"tokens    {summary.response_tokens:,} response tokens "
                     f"({summary.response_tokens / max(summary.rows, 1):.1f} per row)")
    lines.append("schema")
    lines += [f"  {s}" for s in summary.schema]
    if summary.columns:
        lines.append("values (list columns: over all entries)")
        width = max(map(len, summary.columns))
        lines += [f"  {k:<{width}}  {v.line()}" for k, v in summary.columns.items()]
    if summary.lengths:
        lines.append("list lengths")
        width = max(map(len, summary.lengths))
        lines += [f"  {k:<{width}}  {v.line()}" for k, v in summary.lengths.items()]
    if summary.manifest and summary.manifest.get("metrics"):
        lines.append("stage metrics")
        lines += [f"  {k} = {v:.6g}" for k, v in sorted(summary.manifest["metrics"].items())]
    return "\n".join(lines)


def validate(path: str, group_size: int | None = None) -> str:
    """Check the schema, every row's invariants (reading all the data) and the whole-table structure; raise on the
    first problem. The same checks a command runs on its inputs before its first stage (stages/preflight.py)."""
    loc = Location.of(path)
    schema = read_table_schema(loc, "table")
    spec = detect_spec(loc, schema)
    spec.check_schema(schema, loc.path)
    manifest = read_manifest(loc) or {}
    if group_size is None:
        group_size = (manifest.get("params") or {}).get("group_size") or (manifest.get("section") or {}).get("group_size")
    rows = check_table_data(spec, loc, group_size, allow_empty=True)
    structure = all(c in schema.names for c in IDENTITY_COLUMNS)
    if not structure and "row_id" in schema.names:
        ids = pads.dataset(loc.parquet_files(), filesystem=loc.fs).to_table(columns=["row_id"]).column(0)
        if pc.count_distinct(ids).as_py() != len(ids):
            raise SchemaError(f"{loc.path}: row_id values are not unique")
    # name only the checks that ran (a narrow table has no turns or groups to check)
    checked = "schema, row invariants, unique row ids" + (", contiguous turns" if structure else "") + (
        f", complete groups of {group_size}" if structure and group_size else "")
    return f"OK  {spec.name} table {loc.path}: {rows:,} rows; checked {checked}"
