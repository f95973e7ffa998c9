"""The one runner that makes every stage resumable (DESIGN.md "One runner for every stage"), and the stage contract.

1. fingerprint = stage name + version + the config section the stage reads + the input fingerprints (+ carried
   state such as a KL controller);
2. an output folder whose manifest has that fingerprint is skipped (unless ``force``);
3. otherwise the stage's Ray Data pipeline writes into a temporary sibling folder, the output schema and
   invariants are validated, the manifest is written last, and the folder is renamed into place;
4. on any failure the temporary folder is removed and a previous output is untouched.

Steps 2-4 are :func:`stages.commit.commit_folder` (the commit protocols, local and object store, live in
``stages/commit.py``); our errors raised inside Ray come out as themselves through ``stages/ray_errors.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from schemas.errors import SchemaError
from schemas.tables import TableSpec
from stages.commit import commit_folder
from stages.ray_errors import surface_user_errors
from stages.storage import Location, folder_fingerprint, read_table_schema

log = logging.getLogger("rollflow.runner")
@dataclass
class StageContext:
    """What a stage's ``build`` gets: its config section, its input folders and their schemas."""

    section: BaseModel
    inputs: dict[str, Location]
    schemas: dict[str, pa.Schema]
    state_in: dict[str, Any]
    output: Location
    batch_rows: int = 1024
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources (runtime.stage_resources)

    def task_options(self) -> dict[str, Any]:
        """Ray options of the stage's map tasks: the custom resources the run pins the stage with, if any."""
        return {"resources": dict(self.resources)} if self.resources else {}

    def read(self, name: str, columns: list[str] | None = None):
        """A Ray Data dataset over input ``name`` (optionally only ``columns``), in file order."""
        import ray.data

        loc = self.inputs[name]
        return ray.data.read_parquet(loc.parquet_files(), columns=columns, filesystem=loc.ray_filesystem())

    def read_per_file(self, name: str, columns: list[str] | None = None, include_paths: bool = False):
        """:meth:`read` with one read task per file, whose blocks are not split further: a ``map_batches`` with
        ``batch_size=None`` after it runs in the same task on whole blocks (Ray Data fuses read, map and write), so a
        row-parallel stage runs as one task per file and slices the blocks itself (:func:`slices`). Without it
        Ray Data splits a read into at least 200 blocks (``read_op_min_num_blocks``) and bundles them again for a
        separate map task per ~1,024 rows: at 200k rows ~200 tasks a stage, and most of the stage's time was spent
        around them (BENCHMARKS.md, issue 49). ``include_paths``: each row also has its file's path (column
        ``path``)."""
        import ray.data

        loc = self.inputs[name]
        files = loc.parquet_files()
        return ray.data.read_parquet(files, columns=columns, filesystem=loc.ray_filesystem(),
                                     override_num_blocks=max(1, len(files)), include_paths=include_paths)

    def one_task(self, produce: Callable[[], pa.Table | Iterator[pa.Table]]):
        """A Ray Data dataset whose only task (with the stage's task options) returns ``produce()``: for a
        whole-table step that reads its inputs itself. ``produce`` may yield its rows as several tables, in order (a
        step that streams its output). The task is named after ``produce``."""
        import ray.data

        def task(_: pa.Table) -> Iterator[pa.Table]:
            out = produce()
            if isinstance(out, pa.Table):
                yield out
            else:
                yield from out

        task.__name__ = task.__qualname__ = produce.__name__
        return ray.data.from_items([{"task": 0}]).map_batches(task, batch_size=None, batch_format="pyarrow",
                                                             **self.task_options())


def slices(table: pa.Table, rows: int) -> list[pa.Table]:
    """``table`` cut into consecutive slices of ``rows`` rows (the last one shorter; none for an empty table)."""
    return [table.slice(lo, rows) for lo in range(0, table.num_rows, rows)]


SIDE_DIR = "_partials"

# Ray options of a stage's Ray Data actor pool (``map_batches(..., compute=ActorPoolStrategy(...), **ACTOR_POOL)``).
# Ray Data restarts a dead pool actor forever by default (max_restarts=-1); its constructor arguments (the data
# context and the map function) live in the object store, so Ray core logs an error line on the console for every
# such actor ("has constructor arguments in the object store and max_restarts > 0"). A stage whose actor dies should
# fail instead (the runner keeps the committed stages; ``--resume`` runs it again), not restart without bound.
# Ray 2.60 takes it only as a Ray remote argument, which it deprecates for 2.64 (a warning in the log file).
ACTOR_POOL = {"max_restarts": 0}


def write_partials(output: Location, key: str, partials: dict[str, Any]) -> None:
    """From inside a Ray task: record a batch's additive partials (metrics sums, counts) next to the output.

    ``key`` must identify the batch deterministically (e.g. its first row id), so a retried task overwrites its
    own file instead of counting twice."""
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

    def inputs_for(self, section: BaseModel) -> dict[str, TableSpec]:
        """The inputs the stage reads under this section (all of ``input_specs`` unless a section selects fewer,
        e.g. the scores table only for RLVR rewards). Only these enter the fingerprint."""
        return self.input_specs

    @abstractmethod
    def build(self, ctx: StageContext):
        """Return the Ray Data dataset that produces the output rows."""

    def finalize(self, ctx: StageContext, written: Location) -> tuple[dict[str, float], dict[str, Any]]:
        """After writing: metrics for the manifest and state to carry to the next run (e.g. KL controller)."""
        return {}, {}

    def check_output(self, ctx: StageContext, written: Location) -> None:
        """Whole-table output invariants beyond the schema (optional)."""

    def preflight(self, section: BaseModel, on_disk: dict[str, str], schemas: dict[str, pa.Schema]) -> None:
        """Checks of the section against the inputs that a command's pre-flight (stages/preflight.py) runs before
        Prefect and Ray start, beyond the input contracts (optional): ``on_disk`` maps the inputs already on disk to
        their folders, ``schemas`` every input to its (expected) schema. Raise a RollflowError naming field and fix."""

    def output_schema(self, input_schemas: dict[str, pa.Schema]) -> pa.Schema:
        """The columns the output may have on inputs of these schemas (what a pre-flight check of the next stage
        checks against): the spec's required and optional columns, unless a stage knows which it writes."""
        return self.output_spec.arrow_schema()


def stage_fingerprint(stage: Stage, section: BaseModel, inputs: dict[str, Location], state_in: dict) -> str:
    payload = {
        "stage": stage.name,
        "version": stage.version,
        "section": section.model_dump(mode="json"),
        "inputs": {k: folder_fingerprint(v) for k, v in sorted(inputs.items())},
        "state_in": state_in,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


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


def _ordered_parquet_sink(folder: Location):
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


def _rename_parts(tmp: Location) -> list[dict]:
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


def _input_schemas(stage: Stage, section: BaseModel, inputs: dict[str, Location]) -> dict[str, pa.Schema]:
    """The schema of each input ``stage`` declares, checked against its spec and the columns ``section`` needs."""
    schemas = {}
    needs = stage.required_columns(section)
    specs = stage.inputs_for(section)
    unread = sorted(set(inputs) - set(specs))
    if unread:  # an input the stage does not read would still change its fingerprint
        raise SchemaError(f"stage {stage.name}: input(s) {unread} are not read under this config section (it reads "
                          f"{sorted(specs)}); leave them out")
    for name, spec in specs.items():
        if name not in inputs:
            raise SchemaError(f"stage {stage.name}: input '{name}' was not given")
        schema = read_table_schema(inputs[name], spec.name)
        spec.check_schema(schema, inputs[name].path, needs.get(name, ()))
        schemas[name] = schema
    return schemas


def _write_output(stage: Stage, ctx: StageContext, out: Location, start: float,
                  context: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``stage``'s pipeline into ``ctx.output`` (the temporary folder of ``out``), validate what it wrote and
    return the manifest (all but the fingerprint; ``context``, when given, is recorded as it is)."""
    surface_user_errors()
    tmp = ctx.output
    stage.build(ctx).write_datasink(_ordered_parquet_sink(tmp))
    files = _rename_parts(tmp)
    schema = read_table_schema(tmp, stage.output_spec.name) if files else stage.output_spec.arrow_schema()
    stage.output_spec.check_schema(schema, f"{out.path} (output of {stage.name})")
    stage.check_output(ctx, tmp)
    metrics, state = stage.finalize(ctx, tmp)
    tmp.child(SIDE_DIR).rmtree()
    manifest = {
        "stage": stage.name,
        "version": stage.version,
        "table": stage.output_spec.name,
        "section": ctx.section.model_dump(mode="json"),
        "inputs": {k: {"path": v.uri(), "fingerprint": folder_fingerprint(v)} for k, v in ctx.inputs.items()},
        "state_in": ctx.state_in,
        "rows": sum(f["rows"] for f in files),
        "files": files,
        "schema": [f"{f.name}: {f.type}" for f in schema],
        "metrics": metrics,
        "state": state,
        "created_unix": time.time(),
        "seconds": round(time.time() - start, 3),
    }
    if context is not None:
        manifest["context"] = context
    return manifest


def run_stage(stage: Stage, section: BaseModel, inputs: dict[str, str], output: str, *, force: bool = False,
              state_in: dict | None = None, batch_rows: int = 1024,
              context: dict[str, Any] | None = None, resources: dict[str, float] | None = None) -> StageResult:
    """Run ``stage`` on ``inputs`` (name → folder) into the folder ``output``; skip if already done.

    ``context``: what ran the stage beyond what its output depends on, recorded in the manifest and not in the
    fingerprint (a rollout turn's checkpoint folder and engine settings, so ``rollflow stage`` can replay it).
    ``resources``: the custom Ray resources its map tasks ask for (``runtime.resources_for(stage.name)``; where the
    stage runs is not part of its fingerprint)."""
    start = time.time()
    out = Location.of(output)
    in_locs = {k: Location.of(v) for k, v in inputs.items()}
    state_in = state_in or {}
    schemas = _input_schemas(stage, section, in_locs)
    fp = stage_fingerprint(stage, section, in_locs, state_in)
    manifest, skipped = commit_folder(
        out, fp, lambda tmp: _write_output(stage, StageContext(section, in_locs, schemas, state_in, tmp, batch_rows,
                                                               dict(resources or {})),
                                           out, start, context),
        who=f"stage {stage.name}", other="output of stage {stage} with another config or input", force=force)
    if not skipped:
        log.info("stage %s: wrote %d rows to %s in %.1fs", stage.name, manifest["rows"], out.path,
                 time.time() - start)
    return StageResult(out.uri(), fp, skipped, manifest["rows"], time.time() - start, manifest.get("metrics", {}),
                       manifest.get("state", {}))
