"""benchmarks/compare_commits.py (issue 43): the RESULT lines it reads and writes, and the runs it alternates, on
benchmarks that are one-line Python programs (no engine, no Ray)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest

from benchmarks.compare_commits import (Bench, Failed, compare, compare_line, mean_figures, parse_result, run_figures,
                                        run_once)
from stages.metrics import MetricsLog


def test_the_last_result_line_gives_the_figures_and_words_are_left_out():
    out = ("RESULT rows_per_s=1\nwarming up\n"
           "RESULT rows_per_s=5691 io_floor_ratio=2.98 wall_s=nan exit_code=-1 mode=fp32\n")
    figures = parse_result(out)
    assert figures.keys() == {"rows_per_s", "io_floor_ratio", "wall_s", "exit_code"}
    assert (figures["rows_per_s"], figures["exit_code"]) == (5691.0, -1.0) and math.isnan(figures["wall_s"])
    with pytest.raises(Failed, match="no RESULT line"):
        parse_result("Traceback (most recent call last):\n  RESULTS are below\n")


def test_figures_are_averaged_over_the_rounds_that_have_them():
    assert mean_figures([{"a": 1.0, "b": 4.0}, {"a": 3.0}]) == {"a": 2.0, "b": 4.0}


def test_the_last_line_pairs_old_and_new_and_gives_new_over_old_of_the_speed_figure():
    benches = {"train": Bench("train", (), "stage_tok_per_s"),
               "rlvr": Bench("rlvr", (), "step_s", higher_is_faster=False),
               "rollout": Bench("rollout", (), "stage_tok_per_s")}
    results = {"train": {"old": {"stage_tok_per_s": 100.0, "ratio": 0.9}, "new": {"stage_tok_per_s": 110.0,
                                                                                    "ratio": 0.92}},
               "rlvr": {"old": {"step_s": 40.0, "steps": 2.0}, "new": {"step_s": 30.0, "steps": 2.0}},
               "rollout": {"new": {"stage_tok_per_s": 160.0}}}  # failed at the old commit: left out
    assert compare_line(results, benches) == (
        "RESULT train_stage_tok_per_s_old=100 train_stage_tok_per_s_new=110 train_ratio_old=0.9 train_ratio_new=0.92 "
        "train_ratio=1.1 rlvr_step_s_old=40 rlvr_step_s_new=30 rlvr_steps_old=2 rlvr_steps_new=2 rlvr_ratio=0.75")


def test_runs_alternate_old_and_new_and_a_failure_is_reported_with_its_stderr_and_not_run_again(tmp_path):
    """Two 'checkouts' whose benchmark prints the folder it ran in; one benchmark fails in the old one only."""
    old, new, logs = tmp_path / "old", tmp_path / "new", tmp_path / "logs"
    for folder, rate in ((old, 10), (new, 12)):
        folder.mkdir()
        (folder / "fast.py").write_text("import os\nopen('../order', 'a').write(os.path.basename(os.getcwd()) + ' ')\n"
                                        f"print('RESULT rows_per_s={rate} peak_rss_mb=5')\n")
    (old / "flaky.py").write_text("import sys\nsys.stderr.write('Traceback: the old code broke\\n')\nsys.exit(3)\n")
    (new / "flaky.py").write_text("print('RESULT rows_per_s=1')\n")
    logs.mkdir()
    benches = {"fast": Bench("fast", ("fast.py",), "rows_per_s"), "flaky": Bench("flaky", ("flaky.py",), "rows_per_s")}
    results, failures = compare(benches, {"old": old, "new": new}, 2, tmp_path, logs, 60)
    assert (tmp_path / "order").read_text() == "old new old new "
    assert results["fast"] == {"old": {"rows_per_s": 10.0, "peak_rss_mb": 5.0},
                               "new": {"rows_per_s": 12.0, "peak_rss_mb": 5.0}}
    assert results["flaky"] == {} and len(failures) == 1
    assert "flaky at old, round 1" in failures[0] and "exited 3" in failures[0]
    assert "the old code broke" in failures[0]
    assert compare_line(results, benches) == ("RESULT fast_rows_per_s_old=10 fast_rows_per_s_new=12 "
                                              "fast_peak_rss_mb_old=5 fast_peak_rss_mb_new=5 fast_ratio=1.2")


def test_a_run_past_its_time_is_stopped_and_reported(tmp_path):
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(Failed, match="ran past 1 s"):
        run_once(Bench("slow", ("slow.py",), "x"), tmp_path, tmp_path, tmp_path / "slow", 1.0)


def test_a_run_sees_its_checkout_no_ray_address_and_a_temporary_folder_removed_after_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # someone's cluster: each benchmark starts its own
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    (tmp_path / "env.py").write_text(
        "import os, tempfile\nopen(os.path.join(tempfile.gettempdir(), 'left-behind'), 'w').write('x')\n"
        "open('seen', 'w').write('\\n'.join([tempfile.gettempdir(), os.environ['PYTHONPATH'], "
        "os.environ.get('RAY_ADDRESS', 'none'), os.environ['RAY_TMPDIR']]))\nprint('RESULT x=1')\n")
    assert run_once(Bench("env", ("env.py",), "x"), tmp_path, tmp_path, tmp_path / "env", 60) == {"x": 1.0}
    tmp, pythonpath, ray_address, ray_tmp = (tmp_path / "seen").read_text().split("\n")
    assert (pythonpath, ray_address, ray_tmp) == (str(tmp_path), "none", tempfile.gettempdir())
    assert tmp != tempfile.gettempdir() and not Path(tmp).exists()


def test_a_rollflow_runs_figures_are_its_steps_stage_seconds_from_its_metrics(tmp_path):
    """Steps that trained count (an iteration without a train stage, such as one cut short, does not); validation
    is not part of a step; each stage's seconds and the step's sum are means over the steps."""
    log = MetricsLog(tmp_path, tensorboard=False)
    for iteration, (generate, train) in enumerate(((30.0, 50.0), (10.0, 40.0))):
        log.log(iteration, "generate", {"n": 1}, generate)
        log.log(iteration, "train", {"actor/pg_loss": 0.1}, train)
    log.log(1, "validation", {"score": 0.5}, 99.0)
    log.log(2, "generate", {"n": 1}, 12.0)
    assert run_figures(tmp_path, 200.0) == {"wall_s": 200.0, "steps": 2.0, "step_s": 65.0, "generate_s": 20.0,
                                            "train_s": 45.0}
    with pytest.raises(Failed, match="logged no training step"):
        run_figures(tmp_path / "nothing", 1.0)
