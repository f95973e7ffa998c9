"""Helpers of the spine tests: run the two recompute stages without Prefect, read and fingerprint folders, write
modified copies of a samples table."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.config import AdvantageSection, RecomputeConfig, ResponseRewardSection, load_config, section
from stages.runner import run_stage
from stages.stage import StageResult

REPO = Path(__file__).resolve().parents[2]
GIGPO = str(REPO / "configs/recompute_gigpo.yaml")
GRPO = str(REPO / "configs/recompute_grpo.yaml")


def config(path: str | None = GIGPO, **overrides) -> RecomputeConfig:
    """A validated config from ``path`` with dotted ``overrides`` (``{"runtime.batch_rows": 64}``)."""
    return load_config(RecomputeConfig, path, {k.replace("__", "."): v for k, v in overrides.items()})


def run_recompute(samples: str, out: str, cfg: RecomputeConfig | str = GIGPO, *, force: bool = False,
                  state_in: dict | None = None) -> dict[str, StageResult]:
    """Both recompute stages through the runner, exactly as flows/recompute.py wires them, minus Prefect."""
    from stages.advantages import AdvantagesStage
    from stages.response_rewards import ResponseRewardsStage

    if isinstance(cfg, str):
        cfg = config(cfg)
    rewarded = f"{out}/rewarded"
    r1 = run_stage(ResponseRewardsStage(), section(cfg, ResponseRewardSection), {"samples": samples}, rewarded,
                   force=force, batch_rows=cfg.runtime.batch_rows)
    r2 = run_stage(AdvantagesStage(), section(cfg, AdvantageSection), {"samples": samples, "rewarded": rewarded},
                   f"{out}/advantaged", force=force, state_in=state_in, batch_rows=cfg.runtime.batch_rows)
    return {"rewarded": r1, "advantaged": r2}


def flow_runs(client, name: str = "recompute") -> list:
    """The flow runs of flow ``name`` that Prefect ``client``'s server holds, the latest started first."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])),
                                 sort=FlowRunSort.START_TIME_DESC)


def parquet_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("*.parquet"))


def read_table(folder: str | Path, columns: list[str] | None = None) -> pa.Table:
    """All Parquet files of ``folder`` in file order, concatenated (the row order a reader sees)."""
    tables = [pq.read_table(p, columns=columns) for p in parquet_files(folder)]
    return pa.concat_tables(tables) if tables else pa.table({})


def by_row_id(table: pa.Table) -> pa.Table:
    return table.sort_by("row_id")


def tree_digest(folder: str | Path) -> dict[str, tuple[str, int]]:
    """``relative path → (sha256, mtime_ns)`` of every file under ``folder`` (hidden ones included)."""
    out = {}
    root = Path(folder)
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def siblings(folder: str | Path) -> list[str]:
    """Names in the parent of ``folder`` that belong to it (the folder, its .tmp-/.old- leftovers)."""
    folder = Path(folder)
    if not folder.parent.exists():
        return []
    return sorted(n for n in os.listdir(folder.parent) if n == folder.name or n.startswith(f".{folder.name}."))


def write_samples(table: pa.Table, folder: str | Path, rows_per_file: int | None = None) -> str:
    """Write ``table`` as a plain folder of Parquet files (no manifest), ``rows_per_file`` rows each."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    step = rows_per_file or max(table.num_rows, 1)
    for i, start in enumerate(range(0, max(table.num_rows, 1), step)):
        pq.write_table(table.slice(start, step), folder / f"part-{i:05d}.parquet")
    return str(folder)


def modified_copy(src: str, dst: str | Path, change: Callable[[pa.Table], pa.Table],
                  rows_per_file: int | None = None) -> str:
    """A plain copy of the samples in ``src`` with ``change`` applied to the whole table."""
    return write_samples(change(read_table(src)), dst, rows_per_file)


def set_column(table: pa.Table, name: str, values, typ: pa.DataType | None = None) -> pa.Table:
    typ = typ or table.schema.field(name).type
    i = table.schema.get_field_index(name)
    return table.set_column(i, pa.field(name, typ), pa.array(values, typ))


def replace_value(table: pa.Table, name: str, row: int, value) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = value
    return set_column(table, name, values)


def assert_tables_equal(a: pa.Table, b: pa.Table, what: str = "") -> None:
    """Same columns and types, and row by row the same values (NaN-safe, exact)."""
    assert a.schema.remove_metadata().equals(b.schema.remove_metadata()), f"{what}: schemas differ"
    assert a.num_rows == b.num_rows, f"{what}: {a.num_rows} vs {b.num_rows} rows"
    for name in a.column_names:
        x, y = a.column(name), b.column(name)
        if x.equals(y):
            continue
        xs, ys = x.to_pylist(), y.to_pylist()
        bad = next(i for i, (u, v) in enumerate(zip(xs, ys)) if u != v and not _both_nan(u, v))
        raise AssertionError(f"{what}: column {name} differs first at row {bad}: {xs[bad]!r} vs {ys[bad]!r}")


def _both_nan(u, v) -> bool:
    return isinstance(u, float) and isinstance(v, float) and np.isnan(u) and np.isnan(v)
