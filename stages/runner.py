"""The one runner that makes every stage resumable (DESIGN.md "One runner for every stage").

1. fingerprint = stage name + version + the config section the stage reads + the input fingerprints (+ carried
   state such as a KL controller);
2. an output folder whose manifest has that fingerprint is skipped (unless ``force``);
3. otherwise the stage's Ray Data pipeline writes into a temporary sibling folder, the output schema and
   invariants are validated, the manifest is written last, and the folder is renamed into place;
4. on any failure the temporary folder is removed and a previous output is untouched.

Steps 2-4 are :func:`commit_folder`, which also commits a folder written by other code (a training checkpoint).
On an object store, which has no atomic rename, step 3 writes under a unique attempt prefix inside the output folder
instead and the manifest, written last in one PUT, names the attempt and its files (:func:`_commit_attempt`,
docs/object-storage.md).
A folder whose parts are committed one by one (an evaluation's rollout: reset, turn and samples tables, each its own
stage so that a killed run resumes at the turn) gets its own manifest, recording what the whole was made from, last,
from :func:`commit_record`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pydantic import BaseModel

from schemas.errors import RollflowError, SchemaError
from schemas.tables import TableSpec
from stages.paths import cache_root_path
from stages.storage import (ATTEMPT_KEY, MANIFEST, Location, folder_fingerprint, read_manifest, read_table_schema,
                            upload_folder)

log = logging.getLogger("rollflow.runner")
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
ATTEMPT_MARK = ".attempt-"  # object stores: the prefix, inside the output folder, of one attempt's files
# every output this process committed or found committed, in that order (an interrupted command says what it has:
# flows/interrupt.py)
COMMITTED: list[str] = []


def _committed(output: Location, result: tuple[dict[str, Any], bool]) -> tuple[dict[str, Any], bool]:
    COMMITTED.append(output.uri())
    return result


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


def cleanup_leftovers(output: Location) -> None:
    """Remove temporary folders of crashed runs; restore an output moved aside by a crashed replace. On an object
    store: remove the attempt prefixes in ``output`` that its manifest does not name."""
    if not output.atomic_rename:
        _drop_attempts(output, keep=None)
        return
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


def _find_rollflow_error(err: BaseException | None) -> RollflowError | None:
    """The RollflowError inside Ray's wrappers: a task's error arrives as ``RayTaskError(<class>)`` whose ``cause``
    is the original exception (``__cause__`` chains do not survive pickling)."""
    seen = set()
    stack = [err]
    while stack:
        e = stack.pop()
        if id(e) in seen or e is None:
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        if isinstance(e, RollflowError) and not isinstance(cause, RollflowError):
            return e
        stack.extend([e.__cause__, e.__context__])
        if isinstance(cause, BaseException):
            stack.append(cause)
    return None


# Ray Data appends its retry advice to a failed task's exception message; it does not apply to user errors
_RAY_RETRY_NOTE = re.compile(r"\nFailed to .+? after \d+/\d+ attempts \(total backoff .*", re.S)


def unwrap_error(err: BaseException) -> BaseException:
    """The RollflowError inside Ray's wrappers of ``err``, as its own class and without Ray's retry advice, so users
    see our message; ``err`` itself when it carries none."""
    found = _find_rollflow_error(err)
    if found is None:
        return err
    args = list(found.args)
    if args and isinstance(args[0], str):
        args[0] = _RAY_RETRY_NOTE.sub("", args[0])
    return type(found)(*args)


@contextmanager
def unwrapped_errors(find: Callable[[BaseException], BaseException] = unwrap_error) -> Iterator[None]:
    """Re-raise an error of the block as the user error ``find`` sees in it (default :func:`unwrap_error`)."""
    try:
        yield
    except BaseException as err:
        real = find(err)
        if real is not err:
            raise real from None
        raise


class _HideReportedUserErrors(logging.Filter):
    """Ray Data logs a failed task's error as an internal Ray error with a full trace before re-raising it; for a
    RollflowError (bad input or config) the runner's caller prints one clear message instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        return _find_rollflow_error(exc) is None


def _surface_user_errors() -> None:
    """Make Ray Data raise a map function's own exception (not a ``UserCodeException`` that drops it), so that
    :func:`unwrap_error` finds our errors; silence Ray's report of those errors. Idempotent."""
    import ray.data

    ray.data.DataContext.get_current().raise_original_map_exception = True
    for name in ("ray.data.exceptions", "ray.data._internal.execution.streaming_executor_state"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HideReportedUserErrors) for f in logger.filters):
            logger.addFilter(_HideReportedUserErrors())


_SINK_CLASS: list[type] = []


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
                tables = [t for t in (BlockAccessor.for_block(b).to_arrow() for b in blocks) if t.num_rows]
                if not tables:
                    return 0
                schema = pa.unify_schemas([t.schema for t in tables])
                with self.folder.fs.open_output_stream(f"{self.folder.path}/{ctx.task_idx:08d}.parquet") as f:
                    with pq.ParquetWriter(f, schema, **parquet_write_options(schema)) as writer:
                        for table in tables:
                            writer.write_table(table.cast(schema))
                return sum(t.num_rows for t in tables)

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


def _existing_output(output: Location, fingerprint: str, force: bool, who: str, other: str) -> dict | None:
    """The manifest of ``output`` when it has ``fingerprint`` (nothing to do), None when the output is to be written;
    raises when ``output`` holds something else and ``force`` is not set."""
    # an object store keeps an empty "folder" (a marker) after its files are deleted: only content counts there
    present = output.exists() and (output.atomic_rename or bool(output.list()))
    existing = read_manifest(output) if present else None
    if existing is not None and existing.get("fingerprint") == fingerprint and not force:
        log.info("%s: %s is up to date (fingerprint %s), skipping", who, output.path, fingerprint[:12])
        return existing
    if present and not force:
        what = f"{other.format_map(existing)} (fingerprint {existing['fingerprint'][:12]})" if existing \
            else "files without a rollflow manifest"
        raise RollflowError(f"{who}: {output.path} already holds {what}; pass --force to replace it, or choose "
                            "another output folder to keep both")
    return None


def _replace(tmp: Location, output: Location, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` into ``tmp`` (last), then rename ``tmp`` to ``output``; a previous output is moved aside
    first and removed only after the rename (:func:`cleanup_leftovers` restores it after a crash in between)."""
    tmp.child(MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    if output.exists():
        old = output.parent.child(f".{output.name}{OLD_MARK}{uuid.uuid4().hex[:8]}")
        output.rename(old)
        tmp.rename(output)
        old.rmtree()
    else:
        tmp.rename(output)


def commit_folder(output: Location, fingerprint: str, fill: Callable[[Location], dict[str, Any]], *, who: str,
                  other: str, force: bool = False, local: bool = False) -> tuple[dict[str, Any], bool]:
    """Commit the folder ``output``, written by any code (``fill``), the runner's way; return (its manifest, skipped).

    Leftovers of a crashed run are cleaned first. When the manifest of ``output`` has ``fingerprint`` (and not
    ``force``), nothing runs and that manifest comes back with ``skipped`` true. Otherwise ``fill(tmp)`` writes the
    output into ``tmp``, a new empty sibling folder, and returns its manifest (``fingerprint`` is added); the manifest
    is written last and ``tmp`` renamed to ``output``. On any failure ``tmp`` (and an output parent made for it) is
    removed, a previous output is untouched, and a RollflowError raised inside Ray's wrappers is raised as itself.
    ``who`` names the writer in log lines and errors ("stage advantages"); ``other`` says what ``output`` holds when
    its manifest has another fingerprint, formatted with that manifest's fields ("output of stage {stage}").

    On an object store ``tmp`` is an attempt prefix inside ``output`` instead (:func:`_commit_attempt`); with
    ``local`` (``fill`` writes with local paths: DeepSpeed, Hugging Face) ``fill`` gets a local staging folder whose
    files are then uploaded into the attempt."""
    if not output.atomic_rename:
        return _committed(output, _commit_attempt(output, fingerprint, _staged(fill) if local else fill, who=who,
                                                  other=other, force=force))
    cleanup_leftovers(output)
    existing = _existing_output(output, fingerprint, force, who, other)
    if existing is not None:
        return _committed(output, (existing, True))
    tmp = output.parent.child(f".{output.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    created_parent = not output.parent.exists()
    with unwrapped_errors():
        try:
            tmp.fs.create_dir(tmp.path, recursive=True)
            manifest = {**fill(tmp), "fingerprint": fingerprint}
            _replace(tmp, output, manifest)
        except BaseException:
            tmp.rmtree()
            if created_parent and not output.parent.list():  # leave no empty output folder behind either
                output.parent.rmtree()
            raise
    return _committed(output, (manifest, False))


def _drop_attempts(output: Location, keep: str | None) -> None:
    """Object stores: delete what a crashed or superseded attempt left in ``output``. ``keep=None``: every attempt
    prefix its manifest does not name (a resume's clean-up); otherwise everything but the manifest and ``keep`` (the
    attempt just committed: the previous output's files and any files of a folder replaced with ``force``)."""
    if not output.is_dir():
        return
    named = (read_manifest(output) or {}).get(ATTEMPT_KEY) if keep is None else keep
    for info in output.list():
        stale = info.base_name.startswith(ATTEMPT_MARK) if keep is None else info.base_name != MANIFEST
        if stale and info.base_name != named:
            log.warning("removing %s, left by an earlier or interrupted write of %s", info.path, output.path)
            if info.type == pafs.FileType.Directory:
                output.fs.delete_dir(info.path)
            else:
                output.fs.delete_file(info.path)


def _attempt_objects(output: Location, attempt: Location) -> list[dict]:
    """Every file under ``attempt`` as ``{"name": <path relative to output>, "bytes": size}``, sorted by name."""
    # allow_not_found: an output of no rows wrote no object, so the attempt prefix does not exist
    infos = attempt.fs.get_file_info(pafs.FileSelector(attempt.path, recursive=True, allow_not_found=True))
    return sorted(({"name": i.path[len(output.path) + 1:], "bytes": i.size} for i in infos
                   if i.type == pafs.FileType.File), key=lambda o: o["name"])


def _staged(fill: Callable[[Location], dict[str, Any]]) -> Callable[[Location], dict[str, Any]]:
    """``fill`` run into a local staging folder (under the rollflow cache) whose files are then uploaded to the
    folder it is given; the staging folder is removed either way."""
    def run(attempt: Location) -> dict[str, Any]:
        root = cache_root_path() / "staging"
        root.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f"{attempt.name}-", dir=root)
        try:
            os.mkdir(f"{staging}/{attempt.parent.name}")
            manifest = fill(Location.of(f"{staging}/{attempt.parent.name}"))
            upload_folder(f"{staging}/{attempt.parent.name}", attempt)
            return manifest
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return run


def _commit_attempt(output: Location, fingerprint: str, fill: Callable[[Location], dict[str, Any]], *, who: str,
                    other: str, force: bool) -> tuple[dict[str, Any], bool]:
    """:func:`commit_folder` on an object store (no atomic rename; docs/object-storage.md): ``fill`` writes into a
    new attempt prefix ``output/.attempt-<pid>-<random>/``; the manifest, written last in one PUT (an object is
    visible whole or not at all), names the attempt (``attempt``), its tables' files (``files``, names relative to
    ``output``) and every object it wrote (``objects``). Readers trust only what a manifest lists, so until that
    PUT they see the previous output (or none); a failure removes the attempt. After the commit the previous
    output's files are deleted; a killed run's attempts are deleted on the next write (:func:`cleanup_leftovers`)."""
    cleanup_leftovers(output)
    existing = _existing_output(output, fingerprint, force, who, other)
    if existing is not None:
        return existing, True
    attempt = output.child(f"{ATTEMPT_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with unwrapped_errors():
        try:
            manifest = {**fill(attempt), "fingerprint": fingerprint, ATTEMPT_KEY: attempt.name}
            if "files" in manifest:
                manifest["files"] = [{**f, "name": f"{attempt.name}/{f['name']}"} for f in manifest["files"]]
            manifest["objects"] = _attempt_objects(output, attempt)
            output.child(MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        except BaseException:
            attempt.rmtree()
            if output.is_dir() and not output.list():  # no empty folder marker left behind either
                output.rmtree()
            raise
    _drop_attempts(output, keep=attempt.name)
    return manifest, False


def commit_record(output: Location, fingerprint: str, build: Callable[[], dict[str, Any]], *, force: bool = False
                  ) -> tuple[dict[str, Any], bool]:
    """Write the manifest of the folder ``output`` whose parts were each committed already (by their own stages,
    :func:`commit_folder`), recording what the whole was made from; return (its manifest, skipped).

    :func:`commit_folder` cannot commit such a folder: it writes a whole folder into a temporary sibling, so a killed
    run would start the folder over (not resume at its last committed part), and an existing folder of parts without
    a manifest (a run folder written before these records) would be refused. Here the parts are the content and
    decide by their own fingerprints what is redone; the manifest is written last, atomically (a temporary file
    renamed), once they all are there. A manifest that has ``fingerprint`` (and not ``force``) is kept and comes back
    with ``skipped`` true; one of another fingerprint is replaced (the parts were committed for this one)."""
    if not output.is_dir():
        raise RollflowError(f"{output.path}: the parts of this output are missing; run the stage that writes them")
    existing = read_manifest(output)
    if existing is not None and existing.get("fingerprint") == fingerprint and not force:
        return _committed(output, (existing, True))
    for info in output.list():  # the temporary file of a killed earlier write
        if info.base_name.startswith(f".{MANIFEST}{TMP_MARK}"):
            output.fs.delete_file(info.path)
    manifest = {**build(), "fingerprint": fingerprint}
    if not output.atomic_rename:  # an object store: one PUT is atomic (and a move would be a copy)
        output.child(MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        return _committed(output, (manifest, False))
    tmp = output.child(f".{MANIFEST}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    output.fs.move(tmp.path, output.child(MANIFEST).path)
    return _committed(output, (manifest, False))


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
    _surface_user_errors()
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
