"""The one runner that makes every stage resumable (DESIGN.md "One runner for every stage").

1. fingerprint = stage name + version + the config section the stage reads + the input fingerprints (+ carried
   state such as a KL controller);
2. an output folder whose manifest has that fingerprint is skipped (unless ``force``);
3. otherwise the stage's Ray Data pipeline writes into a temporary sibling folder, the output schema and
   invariants are validated, the manifest is written last, and the folder is renamed into place;
4. on any failure the temporary folder is removed and a previous output is untouched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from schemas.errors import RollflowError, SchemaError
from schemas.tables import TableSpec
from stages.storage import MANIFEST, Location, folder_fingerprint, read_manifest, read_table_schema

log = logging.getLogger("rollflow.runner")
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


@dataclass
class StageContext:
    """What a stage's ``build`` gets: its config section, its input folders and their schemas."""

    section: BaseModel
    inputs: dict[str, Location]
    schemas: dict[str, pa.Schema]
    state_in: dict[str, Any]
    output: Location
    batch_rows: int = 1024

    def read(self, name: str, columns: list[str] | None = None):
        """A Ray Data dataset over input ``name`` (optionally only ``columns``), in file order."""
        import ray.data

        loc = self.inputs[name]
        return ray.data.read_parquet(loc.parquet_files(), columns=columns, filesystem=loc.ray_filesystem())


SIDE_DIR = "_partials"


def write_partials(output: Location, key: str, partials: dict[str, Any]) -> None:
    """From inside a Ray task: record a batch's additive partials (metrics sums, counts) next to the output.

    ``key`` must identify the batch deterministically (e.g. its first row id), so a retried task overwrites its
    own file instead of counting twice."""
    import hashlib

    side = output.child(SIDE_DIR)
    side.fs.create_dir(side.path, recursive=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    side.child(f"{name}.json").write_text(json.dumps(partials))


def read_partials(output: Location) -> list[dict[str, Any]]:
    """All partials written by :func:`write_partials` for this output (the folder is removed by the runner)."""
    side = output.child(SIDE_DIR)
    if not side.exists():
        return []
    return [json.loads(Location(side.fs, i.path).read_text()) for i in side.list() if i.path.endswith(".json")]


def sum_partials(parts: list[dict[str, Any]]) -> dict[str, float]:
    """Key-wise sum of numeric partials."""
    total: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


@dataclass
class StageResult:
    output: str
    fingerprint: str
    skipped: bool
    rows: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)


class Stage(ABC):
    """A stage: named inputs of known table specs → one output table. Subclasses declare their contract and build a
    Ray Data pipeline; the runner does everything else."""

    name: ClassVar[str]
    version: ClassVar[str]
    output_spec: ClassVar[TableSpec]
    section_model: ClassVar[type[BaseModel]]
    input_specs: ClassVar[dict[str, TableSpec]]

    def required_columns(self, section: BaseModel) -> dict[str, tuple[str, ...]]:
        """Optional columns each input must have under this section (e.g. ``values`` for GAE)."""
        return {}

    @abstractmethod
    def build(self, ctx: StageContext):
        """Return the Ray Data dataset that produces the output rows."""

    def finalize(self, ctx: StageContext, written: Location) -> tuple[dict[str, float], dict[str, Any]]:
        """After writing: metrics for the manifest and state to carry to the next run (e.g. KL controller)."""
        return {}, {}

    def check_output(self, ctx: StageContext, written: Location) -> None:
        """Whole-table output invariants beyond the schema (optional)."""


def stage_fingerprint(stage: Stage, section: BaseModel, inputs: dict[str, Location], state_in: dict) -> str:
    payload = {
        "stage": stage.name,
        "version": stage.version,
        "section": section.model_dump(mode="json"),
        "inputs": {k: folder_fingerprint(v) for k, v in sorted(inputs.items())},
        "state_in": state_in,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _cleanup_leftovers(output: Location) -> None:
    """Remove temporary folders of crashed runs; restore an output moved aside by a crashed replace."""
    parent = output.parent
    if not parent.exists():
        return
    prefix_tmp = f".{output.name}{TMP_MARK}"
    prefix_old = f".{output.name}{OLD_MARK}"
    for info in parent.list():
        if info.base_name.startswith(prefix_tmp):
            log.warning("removing leftover temporary folder %s of an interrupted run", info.path)
            parent.fs.delete_dir(info.path)
        elif info.base_name.startswith(prefix_old):
            old = Location(parent.fs, info.path)
            if not output.exists():
                log.warning("restoring %s from an interrupted replace", output.path)
                old.rename(output)
            else:
                old.rmtree()


def _unwrap(err: BaseException) -> BaseException:
    """Find a RollflowError inside Ray's wrappers (RayTaskError, UserCodeException) so users see our message."""
    seen = set()
    stack = [err]
    while stack:
        e = stack.pop()
        if id(e) in seen or e is None:
            continue
        seen.add(id(e))
        if isinstance(e, RollflowError):
            return type(e)(*e.args) if e.args else e
        stack.extend([e.__cause__, e.__context__])
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            stack.append(cause)
    return err


def _rename_parts(tmp: Location) -> list[dict]:
    """Name the written files part-00000.parquet, ... in write order; return their row counts and sizes."""
    files = []
    for i, path in enumerate(tmp.parquet_files()):
        dest = f"{tmp.path}/part-{i:05d}.parquet"
        tmp.fs.move(path, dest)
        with tmp.fs.open_input_file(dest) as f:
            meta = pq.read_metadata(f)
        files.append({"name": f"part-{i:05d}.parquet", "rows": meta.num_rows,
                      "bytes": tmp.fs.get_file_info(dest).size})
    return files


def run_stage(stage: Stage, section: BaseModel, inputs: dict[str, str], output: str, *, force: bool = False,
              state_in: dict | None = None, batch_rows: int = 1024) -> StageResult:
    """Run ``stage`` on ``inputs`` (name → folder) into the folder ``output``; skip if already done."""
    start = time.time()
    out = Location.of(output)
    in_locs = {k: Location.of(v) for k, v in inputs.items()}
    state_in = state_in or {}
    _cleanup_leftovers(out)

    schemas = {}
    needs = stage.required_columns(section)
    for name, spec in stage.input_specs.items():
        if name not in in_locs:
            raise SchemaError(f"stage {stage.name}: input '{name}' was not given")
        schema = read_table_schema(in_locs[name], spec.name)
        spec.check_schema(schema, in_locs[name].path, needs.get(name, ()))
        schemas[name] = schema

    fp = stage_fingerprint(stage, section, in_locs, state_in)
    existing = read_manifest(out) if out.exists() else None
    if existing is not None and existing.get("fingerprint") == fp and not force:
        log.info("stage %s: %s is up to date (fingerprint %s), skipping", stage.name, out.path, fp[:12])
        return StageResult(out.path, fp, True, existing["rows"], time.time() - start,
                           existing.get("metrics", {}), existing.get("state", {}))
    if out.exists() and not force:
        what = f"output of stage {existing['stage']} with another config or input (fingerprint " \
               f"{existing['fingerprint'][:12]})" if existing else "files without a rollflow manifest"
        raise RollflowError(f"stage {stage.name}: {out.path} already holds {what}; pass --force to replace it, or "
                            "choose another output folder to keep both")

    tmp = out.parent.child(f".{out.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    out.parent.fs.create_dir(out.parent.path, recursive=True)
    ctx = StageContext(section, in_locs, schemas, state_in, tmp, batch_rows)
    try:
        ds = stage.build(ctx)
        ds.write_parquet(tmp.path, filesystem=tmp.ray_filesystem())
        if not tmp.exists():  # an empty dataset writes nothing
            tmp.fs.create_dir(tmp.path)
        files = _rename_parts(tmp)
        rows = sum(f["rows"] for f in files)
        schema = read_table_schema(tmp, stage.output_spec.name) if files else stage.output_spec.arrow_schema()
        stage.output_spec.check_schema(schema, f"{out.path} (output of {stage.name})")
        stage.check_output(ctx, tmp)
        metrics, state = stage.finalize(ctx, tmp)
        tmp.child(SIDE_DIR).rmtree()
        manifest = {
            "stage": stage.name,
            "version": stage.version,
            "fingerprint": fp,
            "table": stage.output_spec.name,
            "section": section.model_dump(mode="json"),
            "inputs": {k: {"path": v.path, "fingerprint": folder_fingerprint(v)} for k, v in in_locs.items()},
            "state_in": state_in,
            "rows": rows,
            "files": files,
            "schema": [f"{f.name}: {f.type}" for f in schema],
            "metrics": metrics,
            "state": state,
            "created_unix": time.time(),
            "seconds": round(time.time() - start, 3),
        }
        tmp.child(MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if out.exists():
            old = out.parent.child(f".{out.name}{OLD_MARK}{uuid.uuid4().hex[:8]}")
            out.rename(old)
            tmp.rename(out)
            old.rmtree()
        else:
            tmp.rename(out)
    except BaseException as err:
        tmp.rmtree()
        real = _unwrap(err)
        if real is not err:
            raise real from None
        raise
    log.info("stage %s: wrote %d rows to %s in %.1fs", stage.name, rows, out.path, time.time() - start)
    return StageResult(out.path, fp, False, rows, time.time() - start, metrics, state)
