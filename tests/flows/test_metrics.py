"""The metrics table (append, replace, resume, read) and its TensorBoard mirror read back with EventAccumulator."""

from __future__ import annotations

import logging
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from schemas.errors import SchemaError
from stages.metrics import METRICS_SCHEMA, MetricsLog, part_file_name, read_metrics


def _rows(table) -> dict[tuple[int, str, str], float]:
    """``(iteration, stage, name) → value``; fails on duplicate keys."""
    keys = list(zip(table["iteration"].to_pylist(), table["stage"].to_pylist(), table["name"].to_pylist()))
    assert len(keys) == len(set(keys)), "duplicate (iteration, stage, name) rows"
    return dict(zip(keys, table["value"].to_pylist()))


def _scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # it warns when it applies a restart marker
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_rows_schema_and_values(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.log(0, "train", {"actor/pg_loss": 0.5, "critic/kl": np.float32(0.25), "actor/clipfrac": torch.tensor(0.1),
                             "actor/samples_used": 7, "env/FrozenLake/success": True}, wall_s=3.0)
        log.log(0, "rollout", {"env/FrozenLake/action_is_valid": np.array(0.75)})
    table = read_metrics(tmp_path)
    assert table.schema == METRICS_SCHEMA
    rows = _rows(table)
    assert rows == pytest.approx({
        (0, "train", "actor/pg_loss"): 0.5, (0, "train", "critic/kl"): 0.25, (0, "train", "actor/clipfrac"): 0.1,
        (0, "train", "actor/samples_used"): 7.0, (0, "train", "env/FrozenLake/success"): 1.0,
        (0, "train", "time/train"): 3.0, (0, "rollout", "env/FrozenLake/action_is_valid"): 0.75})
    walls = {(s, w) for s, w in zip(table["stage"].to_pylist(), table["wall_s"].to_pylist())}
    assert walls == {("train", 3.0), ("rollout", None)}


def test_append_replace_and_resume_leave_no_duplicates(tmp_path):
    with MetricsLog(tmp_path) as log:
        for it in range(3):
            log.log(it, "train", {"actor/pg_loss": float(it), "critic/kl": 0.1 * it})
            log.log(it, "rollout", {"env/FrozenLake/success": it / 4})
    # a resumed run (new process, new MetricsLog) re-runs iteration 2's train stage with other values
    with MetricsLog(tmp_path) as log:
        log.log(2, "train", {"actor/pg_loss": 20.0})
    rows = _rows(read_metrics(tmp_path))
    assert rows[(2, "train", "actor/pg_loss")] == 20.0
    assert (2, "train", "critic/kl") not in rows  # the whole (iteration, stage) was replaced
    assert rows[(2, "rollout", "env/FrozenLake/success")] == 0.5  # other stages of that iteration kept
    assert rows[(1, "train", "actor/pg_loss")] == 1.0
    assert len(rows) == 3 * 3 - 1
    assert len(list((tmp_path / "metrics").glob("part-*.parquet"))) == 6


def test_drop_after_removes_later_iterations(tmp_path):
    with MetricsLog(tmp_path) as log:
        for it in range(4):
            log.log(it, "train", {"actor/pg_loss": float(it)})
        assert log.drop_after(1) == 2
        log.log(2, "train", {"actor/pg_loss": -2.0})
    assert _rows(read_metrics(tmp_path)) == {(0, "train", "actor/pg_loss"): 0.0, (1, "train", "actor/pg_loss"): 1.0,
                                             (2, "train", "actor/pg_loss"): -2.0}
    assert _scalars(tmp_path)["actor/pg_loss"] == [(0, 0.0), (1, 1.0), (2, -2.0)]


def test_interrupted_write_leaves_no_part_and_is_ignored(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.log(0, "train", {"actor/pg_loss": 1.0})
    # what a kill during pq.write_table leaves behind: a hidden temporary file, never a part
    (tmp_path / "metrics" / f".tmp-{part_file_name(1, 'train')}-123").write_bytes(b"PAR1 truncated")
    assert _rows(read_metrics(tmp_path)) == {(0, "train", "actor/pg_loss"): 1.0}


def test_reopening_deletes_a_dead_writers_temporary_file_only(tmp_path):
    """A resumed run's metrics log deletes what a killed writer left; a live writer's file stays."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / "metrics" / f".tmp-{part_file_name(0, 'train')}-{gone.pid}"
    live = tmp_path / "metrics" / f".tmp-{part_file_name(0, 'rollout')}-{os.getppid()}"
    dead.parent.mkdir()
    dead.write_bytes(b"PAR1 truncated")
    live.write_bytes(b"PAR1 being written")
    with MetricsLog(tmp_path) as log:
        log.log(0, "train", {"actor/pg_loss": 1.0})
    assert not dead.exists() and live.exists()
    assert _rows(read_metrics(tmp_path)) == {(0, "train", "actor/pg_loss"): 1.0}


def test_part_names_are_distinct_for_similar_stage_names():
    assert part_file_name(3, "a/b") != part_file_name(3, "a_b")
    assert part_file_name(3, "train") < part_file_name(10, "train")


def test_empty_run_reads_empty_table(tmp_path):
    table = read_metrics(tmp_path)
    assert table.num_rows == 0 and table.schema == METRICS_SCHEMA


@pytest.mark.parametrize("metrics, wall, match", [
    ({"actor/pg_loss": "high"}, None, "actor/pg_loss"),
    ({"actor/pg_loss": np.array([1.0, 2.0])}, None, "one number"),
    ({"actor/pg_loss": torch.ones(3)}, None, "one number"),
    ({"actor/pg_loss": 1.0}, float("nan"), "wall_s"),
    ({"actor/pg_loss": 1.0}, -1.0, "wall_s"),
])
def test_bad_values_are_refused_and_nothing_is_written(tmp_path, metrics, wall, match):
    with MetricsLog(tmp_path) as log, pytest.raises((TypeError, ValueError), match=match):
        log.log(0, "train", metrics, wall_s=wall)
    assert read_metrics(tmp_path).num_rows == 0


@pytest.mark.parametrize("iteration, stage", [(-1, "train"), (1.0, "train"), (True, "train"), (0, "")])
def test_bad_iteration_or_stage(tmp_path, iteration, stage):
    with MetricsLog(tmp_path) as log, pytest.raises(ValueError):
        log.log(iteration, stage, {"x": 1.0})


def test_foreign_part_file_is_a_schema_error(tmp_path):
    import pyarrow as pa

    (tmp_path / "metrics").mkdir()
    pq.write_table(pa.table({"step": [1]}), tmp_path / "metrics" / part_file_name(0, "x"))
    with pytest.raises(SchemaError, match="missing columns"):
        read_metrics(tmp_path)


def test_tensorboard_mirror_matches_the_table(tmp_path):
    with MetricsLog(tmp_path) as log:
        for it in range(3):
            log.log(it, "train", {"actor/pg_loss": float(it), "critic/kl": 0.5 * it}, wall_s=1.0 + it)
            log.log(it, "rollout", {"env/FrozenLake/success": it / 2})
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1  # no restart while iterations only grow
    scalars = _scalars(tmp_path)
    assert scalars["actor/pg_loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert scalars["critic/kl"] == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert scalars["env/FrozenLake/success"] == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert scalars["time/train"] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_tensorboard_after_resume_shows_replaced_values_once(tmp_path):
    with MetricsLog(tmp_path) as log:
        for it in range(3):
            log.log(it, "train", {"actor/pg_loss": float(it)})
            log.log(it, "rollout", {"env/FrozenLake/success": 0.25})
    with MetricsLog(tmp_path) as log:  # resume: iteration 1 is run again
        log.log(1, "train", {"actor/pg_loss": 10.0})
        log.log(1, "train", {"actor/pg_loss": 11.0})  # and again in the same process
    scalars = _scalars(tmp_path)
    assert scalars["actor/pg_loss"] == [(0, 0.0), (1, 11.0), (2, 2.0)]
    assert scalars["env/FrozenLake/success"] == [(0, 0.25), (1, 0.25), (2, 0.25)]


def test_tensorboard_appends_the_stages_of_an_overlapped_run_and_restarts_only_for_what_it_would_drop(tmp_path):
    """A run that plays the next rollout ahead logs an iteration's training after the next one's rollout: new tags at
    an older step, which TensorBoard keeps, so they are appended (one event file, the table not read again). A value
    that TensorBoard would drop — a tag at a step before one it already holds — starts a new file from that step."""
    with MetricsLog(tmp_path) as log:
        log.log(0, "rollout", {"rollout/success": 0.25})
        log.log(1, "rollout", {"rollout/success": 0.5})  # played ahead, beside iteration 0's training
        log.log(0, "train", {"actor/pg_loss": 1.0})
        log.log(2, "rollout", {"rollout/success": 0.75})
        log.log(1, "train", {"actor/pg_loss": 2.0})
        # filed under an older step than the last rollout's, with the rollout's name: a tag of its own (val/...)
        log.log(1, "eval", {"rollout/success": 0.5})
        assert len(list((tmp_path / "tensorboard").iterdir())) == 1
        assert _scalars(tmp_path) == {"rollout/success": [(0, 0.25), (1, 0.5), (2, 0.75)],
                                      "actor/pg_loss": [(0, 1.0), (1, 2.0)], "val/rollout/success": [(1, 0.5)]}
        log.log(1, "score", {"rollout/success": 0.125, "score/mean": 0.375})  # a tag held at steps 1 and 2 already
        assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    expected = {(it, stage, name): value for it, stage, name, value in (
        (0, "rollout", "rollout/success", 0.25), (1, "rollout", "rollout/success", 0.5),
        (0, "train", "actor/pg_loss", 1.0), (2, "rollout", "rollout/success", 0.75), (1, "train", "actor/pg_loss", 2.0),
        (1, "eval", "rollout/success", 0.5), (1, "score", "rollout/success", 0.125), (1, "score", "score/mean", 0.375))}
    assert _rows(read_metrics(tmp_path)) == expected
    scalars = _scalars(tmp_path)
    assert scalars["actor/pg_loss"] == [(0, 1.0), (1, 2.0)] and scalars["val/rollout/success"] == [(1, 0.5)]
    assert scalars["score/mean"] == [(1, 0.375)]
    assert sorted(scalars["rollout/success"]) == [(0, 0.25), (1, 0.125), (1, 0.5), (2, 0.75)]  # step 2 kept


def test_tensorboard_restarts_within_one_second_are_read_in_order(tmp_path, monkeypatch):
    """Event files are read in name order: a restart file must sort after the files it overrides, also when many
    are made within one second of one process (a frozen clock here). Names carrying a per-process counter as text
    sorted the 10th file before the 9th (and the 100th before the 99th), and TensorBoard then showed an overridden
    value; 101 restarts cross such a boundary wherever the counter starts."""
    import time

    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.25)
    with MetricsLog(tmp_path) as log:
        for it in range(3):
            log.log(it, "train", {"actor/pg_loss": float(it)})
    for attempt in range(101):
        with MetricsLog(tmp_path) as log:  # a resume re-running iteration 1
            log.log(1, "train", {"actor/pg_loss": 100.0 + attempt})
        if attempt in (0, 100):
            assert _scalars(tmp_path)["actor/pg_loss"] == [(0, 0.0), (1, 100.0 + attempt), (2, 2.0)], attempt
    assert len(list((tmp_path / "tensorboard").iterdir())) == 102


def test_deleted_tensorboard_folder_is_rebuilt_from_the_table(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.log(0, "train", {"actor/pg_loss": 1.0})
        log.log(1, "train", {"actor/pg_loss": 2.0})
    for f in (tmp_path / "tensorboard").iterdir():
        os.remove(f)
    with MetricsLog(tmp_path) as log:
        log.log(2, "train", {"actor/pg_loss": 3.0})
    assert _scalars(tmp_path)["actor/pg_loss"] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_a_mirror_that_named_the_evaluation_as_the_rollout_is_rewritten_as_named_now(tmp_path):
    """A run folder mirrored before the evaluation's metrics went under ``val/`` (its events name them as the
    rollout's, in files of the old name) is rewritten from step 0 at its next log, so TensorBoard shows the table as
    the trackers name it now; a mirror written since is appended to."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    from stages.metrics import _EventFile

    with MetricsLog(tmp_path, tensorboard=False) as log:
        log.log(0, "eval", {"rollout/success_rate": 0.25})
        log.log(0, "rollout", {"rollout/success_rate": 0.5})
        log.log(1, "eval", {"rollout/success_rate": 0.125})
    (tmp_path / "tensorboard").mkdir()
    old = _EventFile(tmp_path / "tensorboard" / f"{_EventFile.PREFIX}0000000001.host.rollflow")
    for row in read_metrics(tmp_path).to_pylist():  # every row under its metric name, as the mirror wrote it then
        old.add_event(Event(step=row["iteration"], wall_time=1.0, summary=Summary(
            value=[Summary.Value(tag=row["name"], simple_value=row["value"])])))
    old.close()
    assert sorted(_scalars(tmp_path)["rollout/success_rate"]) == [(0, 0.25), (0, 0.5), (1, 0.125)]  # mixed
    with MetricsLog(tmp_path) as log:
        log.log(1, "rollout", {"rollout/success_rate": 0.75})
    named_now = {"rollout/success_rate": [(0, 0.5), (1, 0.75)], "val/rollout/success_rate": [(0, 0.25), (1, 0.125)]}
    assert _scalars(tmp_path) == named_now
    files = len(list((tmp_path / "tensorboard").iterdir()))
    with MetricsLog(tmp_path) as log:  # written as named now: appended, nothing rewritten
        log.log(2, "rollout", {"rollout/success_rate": 1.0})
    assert _scalars(tmp_path) == {**named_now, "rollout/success_rate": [(0, 0.5), (1, 0.75), (2, 1.0)]}
    newest = sorted((tmp_path / "tensorboard").iterdir())
    assert len(newest) == files + 1
    events = list(EventFileLoader(str(newest[-1])).Load())  # the file version, then the one new value
    assert [(e.step, [v.tag for v in e.summary.value]) for e in events[1:]] == [(2, ["rollout/success_rate"])]


def test_without_tensorboard_no_event_files(tmp_path):
    with MetricsLog(tmp_path, tensorboard=False) as log:
        log.log(0, "train", {"actor/pg_loss": 1.0})
    assert not (tmp_path / "tensorboard").exists()
    assert read_metrics(tmp_path).num_rows == 1


def test_a_stage_skipped_on_resume_keeps_the_record_of_the_run_that_computed_it(tmp_path, capsys):
    """``record`` (flows/runkit.py): a resumed run skips committed stages; their metrics and real wall time stay as
    the computing run logged them, and a record lost to a kill between the commit and the log is written again."""
    from types import SimpleNamespace

    from flows.runkit import record

    with MetricsLog(tmp_path, tensorboard=False) as log:
        record(log, 0, "train", SimpleNamespace(metrics={"actor/pg_loss": 0.5}, seconds=31.0, skipped=False))
        record(log, 0, "train", SimpleNamespace(metrics={"actor/pg_loss": 0.5}, seconds=0.01, skipped=True))
        record(log, 1, "train", SimpleNamespace(metrics={"actor/pg_loss": 0.25}, seconds=0.02, skipped=True))
        table = log.table()
    rows = table.to_pylist()
    walls = {(r["iteration"], r["stage"]): r["wall_s"] for r in rows}
    assert walls == {(0, "train"): 31.0, (1, "train"): 0.02}
    assert _rows(table)[(1, "train", "actor/pg_loss")] == 0.25
    assert "committed earlier, skipped" in capsys.readouterr().out
