"""The metrics table of a training run and its TensorBoard mirror.

Every stage of every iteration logs its metrics once: ``MetricsLog(run_dir).log(iteration, stage, metrics, wall_s)``.
Rows go to ``runs/<run>/metrics/`` as one Parquet part file per ``(iteration, stage)``, written to a hidden temporary
file and renamed into place, so a killed run leaves either the old part or the new one, never half a file (the next
MetricsLog of the run deletes the temporary file a killed writer left). Logging the
same ``(iteration, stage)`` again (a resumed run re-running an iteration) replaces that part: the merged table never
holds duplicates. Columns: ``iteration, stage, name, value, wall_s, timestamp`` (long format, one row per metric).

Metric names are ROLL's (``actor/pg_loss``, ``critic/kl``, ``env/FrozenLake/success``, …, spec §12). When ``wall_s``
is given the stage's wall time is also logged as the metric ``time/<stage>``.

The trackers (stages/trackers.py) name a series by one name where the table keys it by ``(stage, name)``: the
evaluation logs the rollout's metrics under their names (``rollout/success_rate``, ``env/<tag>/success``, ...), so
:func:`tracker_name` files an evaluation stage's rows under ``val/`` there (ROLL's prefix of evaluation metrics),
and an iteration's rollout and evaluation stay two series in every tracker. A TensorBoard mirror written before
(its events name the evaluation's metrics as the rollout's) is rewritten from step 0 when its run next logs.

The TensorBoard mirror (``runs/<run>/tensorboard/``, tag = tracker name, step = iteration) is written with
tensorboard's own event writer (no torch import). Rows are appended to the events; when TensorBoard would not show
them as the table holds them — an ``(iteration, stage)`` logged again, or a step before the last one mirrored that a
tag of the new rows already holds a value at or after (TensorBoard drops a tag's values from such a step on) — a new
event file starts with a TensorBoard "restart" marker at that step (TensorBoard then discards the older events from
that step on) and every table row from that step on is written again, so TensorBoard shows exactly the table.
TensorBoard's writer needs local files: for a run folder on an object store (``s3://...``) the events go to the
folder's local side (``<cache>/mirror/s3/<bucket>/<path>/tensorboard``, stages/storage.py ``local_side``; a new
machine rebuilds them from the table), which ``rollflow train`` uploads into the run folder at its end; the table's
parts are written in one PUT each (atomic there: an object appears whole or not at all).

No Ray or Prefect import: the training flow, stages and the report all use this module.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import socket
import time
from numbers import Real
from pathlib import Path
from typing import Mapping, Protocol, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from schemas.errors import SchemaError
from stages.storage import Location, local_side
from stages.watchdog import start_time

METRICS_DIR = "metrics"
TENSORBOARD_DIR = "tensorboard"
TIME_PREFIX = "time/"

EVALUATION_STAGES = frozenset({"eval", "validation"})  # the stages that evaluate a checkpoint (flows' Evaluation)
EVALUATION_PREFIX = "val/"  # where the trackers file their metrics

METRICS_SCHEMA = pa.schema([
    pa.field("iteration", pa.int64(), nullable=False),
    pa.field("stage", pa.string(), nullable=False),
    pa.field("name", pa.string(), nullable=False),
    pa.field("value", pa.float64()),
    pa.field("wall_s", pa.float64()),      # the stage's wall time in this iteration (same on all its rows)
    pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
])


def tracker_name(stage: str, name: str) -> str:
    """The name a tracker gives metric ``name`` of ``stage``: the metric's own, under ``val/`` for an evaluation
    stage (a name already there stays as it is): ``("eval", "rollout/success_rate") -> "val/rollout/success_rate"``,
    ``("rollout", "rollout/success_rate") -> "rollout/success_rate"``."""
    if stage in EVALUATION_STAGES and not name.startswith(EVALUATION_PREFIX):
        return EVALUATION_PREFIX + name
    return name


def tracker_names(rows: pa.Table) -> list[str]:
    """:func:`tracker_name` of each row of a metrics table (n,)."""
    return [tracker_name(stage, name) for stage, name in zip(rows["stage"].to_pylist(), rows["name"].to_pylist())]


def part_file_name(iteration: int, stage: str) -> str:
    """File name of the part holding ``(iteration, stage)``: sortable by iteration, readable, collision-free
    (the stage name is slugged for the file system and disambiguated by a short hash of the exact name)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", stage)[:40]
    digest = hashlib.sha256(stage.encode()).hexdigest()[:8]
    return f"part-iter{iteration:06d}-{slug}-{digest}.parquet"


def _part_files(metrics_dir: Location) -> list[str]:
    """Committed part files (hidden temporary files of an interrupted write are not parts); none when there is no
    ``metrics_dir``, a SchemaError naming it when it is there but not a folder (on a local disk; on an object store
    the folder is listed at once, one request, and a ``metrics`` object that is no folder holds no parts)."""
    if metrics_dir.atomic_rename and not metrics_dir.is_dir():
        if metrics_dir.exists():
            raise SchemaError(f"metrics table {metrics_dir.uri()} is a file, where a run keeps its metrics (a folder "
                              "of part files that MetricsLog writes); move the file out of the run folder")
        return []
    return sorted(i.path for i in metrics_dir.list(missing_ok=True) if i.type == pafs.FileType.File
                  and i.base_name.startswith("part-iter") and i.base_name.endswith(".parquet"))


def _as_float(stage: str, name: str, value: object) -> float:
    """A metric value as a float (Python/NumPy numbers, bools, one-element arrays and tensors); else TypeError."""
    if isinstance(value, (bool, Real)):
        return float(value)
    count = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
    if count == 1 and callable(getattr(value, "item", None)):
        item = value.item()
        if isinstance(item, (bool, Real)):
            return float(item)
    raise TypeError(f"metrics of stage {stage!r}: {name!r} is a {type(value).__name__}, expected one number; "
                    "log scalars only (reduce arrays to a mean/max first)")


def read_metrics(run_dir: str | os.PathLike) -> pa.Table:
    """The merged metrics table of ``run_dir`` (empty with ``METRICS_SCHEMA`` if none), sorted by iteration, stage,
    name. Raises SchemaError naming the part file when one is not a metrics part."""
    metrics_dir = Location.of(str(run_dir)).child(METRICS_DIR)
    tables = []
    for path in _part_files(metrics_dir):
        try:
            table = pq.read_table(path, filesystem=metrics_dir.fs)
        except (OSError, pa.ArrowInvalid) as err:
            raise SchemaError(f"metrics part {path}: cannot be read as Parquet ({err}); delete it and re-run that "
                              "iteration, or restore it") from err
        missing = [f.name for f in METRICS_SCHEMA if f.name not in table.column_names]
        if missing:
            raise SchemaError(f"metrics part {path}: missing columns {missing}; expected {METRICS_SCHEMA.names} — "
                              "this file was not written by MetricsLog, move it out of the metrics folder")
        tables.append(table.select(METRICS_SCHEMA.names).cast(METRICS_SCHEMA))
    if not tables:
        return METRICS_SCHEMA.empty_table()
    merged = pa.concat_tables(tables)
    return merged.sort_by([("iteration", "ascending"), ("stage", "ascending"), ("name", "ascending")])


_TMP_PREFIX = ".tmp-"


def _remove_dead_writers_temporaries(metrics_dir: Path) -> None:
    """Delete the part files a killed run was writing (``.tmp-<part>-<pid>`` whose process is gone): its rename
    never came, so the part it replaced (or none) still stands. A live writer's file is left alone."""
    for tmp in metrics_dir.glob(f"{_TMP_PREFIX}*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and start_time(int(pid)) is not None:
            continue
        tmp.unlink(missing_ok=True)


class Tracker(Protocol):
    """An opened tracker (stages/trackers.py opens them): the rows a stage logged (``METRICS_SCHEMA``), iterations
    dropped, the end of the run."""

    def log(self, iteration: int, stage: str, rows: pa.Table) -> None: ...

    def drop_after(self, iteration: int) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """Append-or-replace metrics of one run; see the module docstring. Use as a context manager or call close().

    ``trackers``: where every stage's rows go besides the table (stages/trackers.py ``open_trackers``, in the order
    given); by default the TensorBoard mirror alone (none with ``tensorboard=False``)."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True,
                 trackers: Sequence[Tracker] | None = None) -> None:
        self.run_dir = str(run_dir)
        self.metrics = Location.of(self.run_dir).child(METRICS_DIR)
        local = self.metrics.atomic_rename
        self.metrics_dir = Path(self.metrics.path) if local else None
        self.metrics.fs.create_dir(self.metrics.path, recursive=True)
        if local:
            _remove_dead_writers_temporaries(self.metrics_dir)
        if trackers is None:
            trackers = [TensorBoardMirror(self.run_dir)] if tensorboard else []
        self.trackers = list(trackers)

    # ---- the table ----------------------------------------------------------------------------------------------

    def log(self, iteration: int, stage: str, metrics: Mapping[str, object], wall_s: float | None = None) -> str:
        """Write the metrics of ``stage`` in ``iteration`` (replacing any earlier ones of that pair), then hand the
        rows to each tracker. Returns the part file. ``wall_s``: the stage's wall time, stored on every row and
        logged as ``time/<stage>``."""
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
            raise ValueError(f"metrics log {self.metrics.path}: iteration {iteration!r} must be an int >= 0")
        if not stage or not isinstance(stage, str):
            raise ValueError(f"metrics log {self.metrics.path}: stage name {stage!r} must be a non-empty string")
        values = {str(name): _as_float(stage, str(name), v) for name, v in metrics.items()}
        if wall_s is not None:
            if not math.isfinite(wall_s) or wall_s < 0:
                raise ValueError(f"metrics of stage {stage!r}, iteration {iteration}: wall_s {wall_s!r} must be a "
                                 "finite number of seconds >= 0")
            values.setdefault(f"{TIME_PREFIX}{stage}", float(wall_s))
        table = self._rows(iteration, stage, values, wall_s)
        path = self.metrics.child(part_file_name(iteration, stage))
        if self.metrics.atomic_rename:
            tmp = self.metrics_dir / f"{_TMP_PREFIX}{path.name}-{os.getpid()}"
            pq.write_table(table, tmp)
            os.replace(tmp, path.path)
        else:  # one PUT: the object appears whole or not at all
            with path.fs.open_output_stream(path.path) as f:
                pq.write_table(table, f)
        for tracker in self.trackers:
            tracker.log(iteration, stage, table)
        return path.path

    def has(self, iteration: int, stage: str) -> bool:
        """Whether the metrics of ``stage`` in ``iteration`` are recorded."""
        return self.metrics.child(part_file_name(iteration, stage)).exists()

    def drop_after(self, iteration: int) -> int:
        """Delete the parts of iterations after ``iteration`` (a run resumed from the checkpoint of ``iteration``
        recomputes them). Returns how many parts were deleted. TensorBoard drops them at the next log()."""
        dropped = 0
        for path in _part_files(self.metrics):
            if int(re.match(r"part-iter(\d+)-", path.rsplit("/", 1)[-1]).group(1)) > iteration:
                self.metrics.fs.delete_file(path)
                dropped += 1
        if dropped:
            for tracker in self.trackers:
                tracker.drop_after(iteration)
        return dropped

    def table(self) -> pa.Table:
        """The merged table (see read_metrics)."""
        return read_metrics(self.run_dir)

    @staticmethod
    def _rows(iteration: int, stage: str, values: dict[str, float], wall_s: float | None) -> pa.Table:
        n = len(values)
        now_us = int(time.time() * 1e6)
        return pa.table({"iteration": pa.array([iteration] * n, pa.int64()),
                         "stage": pa.array([stage] * n, pa.string()),
                         "name": pa.array(list(values), pa.string()),
                         "value": pa.array(list(values.values()), pa.float64()),
                         "wall_s": pa.array([wall_s] * n, pa.float64()),
                         "timestamp": pa.array([now_us] * n, pa.timestamp("us", tz="UTC"))},
                        schema=METRICS_SCHEMA)

    def close(self) -> None:
        """Close every tracker (each is closed even when an earlier one fails; the first failure is raised)."""
        failure = None
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as err:  # noqa: BLE001 - re-raised below, after the others are closed
                failure = failure or err
        if failure is not None:
            raise failure

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorBoardMirror:
    """The TensorBoard mirror of a run's metrics table (see the module docstring): the ``tensorboard`` tracker."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        metrics = Location.of(run_dir).child(METRICS_DIR)
        # a run folder on an object store: the events go to its local side (TensorBoard's writer needs local files)
        self.tensorboard_dir = Path(local_side(metrics.parent)) / TENSORBOARD_DIR
        self._writer = None
        existing = read_metrics(run_dir)
        if not metrics.atomic_rename and existing.num_rows == 0 and self.tensorboard_dir.is_dir():
            shutil.rmtree(self.tensorboard_dir)
        # the mirror is assumed to hold the table; a missing mirror is rebuilt from it at the first log()
        self._mirrored: set[tuple[int, str]] = set()  # the (iteration, stage) pairs the mirror holds
        self._last_step: dict[str, int] = {}  # the last step the mirror holds of each tag
        self._note_mirrored(existing)
        files = self._event_files()
        self._rebuild_mirror = existing.num_rows > 0 and not files
        self._purge_from: int | None = None  # set by drop_after: TensorBoard must forget steps >= this
        if files and not any(f.name.endswith(_EventFile.SUFFIX) for f in files) and \
                EVALUATION_STAGES & set(existing["stage"].to_pylist()):
            self._purge_from = 0  # its events name the evaluation's metrics as the rollout's: rewritten as now

    def log(self, iteration: int, stage: str, new_rows: pa.Table) -> None:
        self._mirror(iteration, new_rows)

    def drop_after(self, iteration: int) -> None:
        """The table's iterations after ``iteration`` are gone: TensorBoard forgets them at the next log()."""
        if self._last_mirrored() > iteration:
            self._purge_from = iteration + 1

    def _event_files(self) -> list[Path]:
        if self.tensorboard_dir is None or not self.tensorboard_dir.is_dir():
            return []
        return sorted(self.tensorboard_dir.glob(_EventFile.PREFIX + "*"))

    def _new_writer(self) -> "_EventFile":
        if self._writer is not None:
            self._writer.close()
        self._writer = _EventFile.create(self.tensorboard_dir)
        return self._writer

    def _mirror(self, iteration: int, new_rows: pa.Table) -> None:
        """Append ``new_rows`` to the events, unless TensorBoard would then show other than the table: ``(iteration,
        stage)`` logged again (its old values are in the events), or a step before the last one mirrored that a tag
        of it already holds a value at or after (an event whose step is before the last one makes TensorBoard discard
        its tags' values from that step on). Then a new event file restarts the steps from ``iteration`` and the
        table's rows from there are written again. An older iteration's stage whose tags hold nothing from its step
        on (a stage of the iteration being trained while the next one's rollout, played ahead, was logged) is
        appended."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        stage = new_rows["stage"][0].as_py() if new_rows.num_rows else ""
        again = (iteration, stage) in self._mirrored or (iteration < self._last_mirrored() and any(
            self._last_step.get(tag, -1) >= iteration for tag in set(tracker_names(new_rows))))
        restart = iteration if again else None
        if self._purge_from is not None:
            restart = min(self._purge_from, iteration if restart is None else restart)
            self._purge_from = None
        if self._rebuild_mirror or restart is not None:
            writer = self._new_writer()
            table = whole = read_metrics(self.run_dir)  # read once (every part: on S3 a HEAD and a GET each)
            if self._rebuild_mirror:  # the table exists but the mirror was deleted: write it all again
                self._rebuild_mirror = False
            else:  # TensorBoard discards the earlier events with step >= restart; write those steps again
                writer.add_event(Event(step=restart, wall_time=time.time(),
                                       session_log=SessionLog(status=SessionLog.START)))
                table = table.filter(pc.greater_equal(table["iteration"], restart))
            self._write_scalars(table)
            self._note_mirrored(whole)
        else:
            if self._writer is None:
                self._new_writer()
            self._write_scalars(new_rows)
            self._note_mirrored(new_rows, add=True)
        self._writer.flush()

    def _last_mirrored(self) -> int:
        """The last step the mirror holds (-1: none)."""
        return max(self._last_step.values(), default=-1)

    def _note_mirrored(self, table: pa.Table, add: bool = False) -> None:
        """Remember the (iteration, stage) pairs and each tag's last step that ``table`` puts in the mirror: all the
        mirror holds, or (``add``) what it holds besides."""
        if not add:
            self._mirrored, self._last_step = set(), {}
        for iteration, stage, tag in zip(table["iteration"].to_pylist(), table["stage"].to_pylist(),
                                         tracker_names(table)):
            self._mirrored.add((iteration, stage))
            if iteration > self._last_step.get(tag, -1):
                self._last_step[tag] = iteration

    def _write_scalars(self, table: pa.Table) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for row, tag in zip(table.to_pylist(), tracker_names(table)):
            if row["value"] is None:
                continue
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=row["value"])])
            self._writer.add_event(Event(step=row["iteration"], wall_time=row["timestamp"].timestamp(),
                                         summary=summary))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class _EventFile:
    """One TensorBoard event file, written synchronously, named so that the files of a folder sort in the order they
    were created (TensorBoard reads them in name order; a restart marker only works in a later file).

    tensorboard's own ``EventFileWriter`` names its files ``…tfevents.<seconds>.<host>.<pid>.<counter>``: two files
    of one process in the same second sort by their counter as text, so the 10th sorts before the 9th and a restart
    would be read first and overwritten by the older values. Here the seconds field is kept strictly increasing over
    the folder's files instead (``max(now, newest + 1)``): a name, not a clock reading (each event carries its own
    wall time)."""

    PREFIX = "events.out.tfevents."
    # the files of a mirror whose evaluation metrics are under val/ (tracker_name); a mirror without such a file was
    # written with the metric names alone, and is rewritten from step 0 when it holds an evaluation's
    SUFFIX = ".rollflow2"

    def __init__(self, path: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._records = RecordWriter(open(path, "wb"))
        self.add_event(Event(wall_time=time.time(), file_version="brain.Event:2"))

    @classmethod
    def create(cls, folder: Path) -> "_EventFile":
        folder.mkdir(parents=True, exist_ok=True)
        seconds = [int(m.group(1)) for f in folder.glob(cls.PREFIX + "*")
                   if (m := re.match(re.escape(cls.PREFIX) + r"(\d+)\.", f.name))]
        stamp = max([int(time.time())] + [s + 1 for s in seconds])
        return cls(folder / f"{cls.PREFIX}{stamp:010d}.{socket.gethostname()}{cls.SUFFIX}")

    def add_event(self, event) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        if not self._records.closed:
            self._records.close()
