"""The issue's "done" criterion: ``rollflow recompute`` killed with SIGKILL mid-way, or interrupted with Ctrl-C (SIGINT
to its whole process group, as a terminal sends it), and started again produces output identical to an
uninterrupted run (compared row by row, not by file names)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.example import ExampleSpec, generate
from tests.prefect_template import seeded
from tests.processes import group_members, ray_jobs, rollflow_here, sigkill_when, wait_gone, wait_ray_jobs_gone
from tests.spine.conftest import SMALL
from tests.spine.helpers import GIGPO, assert_tables_equal, config, read_table, run_recompute, siblings

ROLLFLOW = str(Path(sys.executable).parent / "rollflow")
BATCH_ROWS = 100  # 40 batches a stage: a kill lands mid-stage, as with bigger tables


def _child_env(prefect_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
    env["PREFECT_HOME"] = str(seeded(prefect_home))  # the child's ephemeral server starts on a migrated database
    return env


def _in_progress(out: Path) -> bool:
    """The advantages stage has written at least one batch into its temporary folder."""
    if not (out / "rewarded" / "manifest.json").exists():
        return False
    for tmp in out.glob(".advantaged.tmp-*"):
        if any((tmp / "_partials").glob("*.json")):
            return True
    return False


@pytest.fixture(scope="module")
def big_set(data_root) -> str:
    """4000 step-level rows in 8 files: 40 batches a stage."""
    samples = str(data_root / "big")
    generate(ExampleSpec(samples=4000, seed=11, rows_per_file=500, **SMALL), samples)
    return samples


@pytest.fixture(scope="module")
def big_reference(big_set, data_root, ray_cluster) -> Path:
    """The uninterrupted recompute of ``big_set`` (rewarded/ and advantaged/ under the returned folder)."""
    reference = data_root / "big_reference"
    run_recompute(big_set, str(reference), config(GIGPO, runtime={"batch_rows": BATCH_ROWS}))
    return reference


def _assert_resumed_identical(out: Path, reference: Path) -> None:
    for name in ("rewarded", "advantaged"):
        assert_tables_equal(read_table(out / name), read_table(reference / name), name)
        resumed = json.loads((out / name / "manifest.json").read_text())
        fresh = json.loads((reference / name / "manifest.json").read_text())
        assert resumed["fingerprint"] == fresh["fingerprint"]
        assert resumed["rows"] == fresh["rows"] >= 4000
        assert resumed["metrics"] == pytest.approx(fresh["metrics"], rel=1e-12, abs=1e-15)


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_gives_the_uninterrupted_output(big_set, big_reference, tmp_path, ray_cluster,
                                                                   prefect_server):
    """SIGKILL of the command alone (not its process group) mid-way through the advantages stage: nothing of the
    stage is committed, its temporary folder is left, and the same command again skips the committed first stage and
    gives the uninterrupted tables. The child joins the session's Ray cluster (RAY_ADDRESS: Ray ends its job's tasks
    with its driver) and starts Prefect's ephemeral server, which its watchdog (stages/watchdog.py) kills with it:
    no process of its group is left (``sigkill_when``). That the watchdog also takes down a local Ray cluster the
    killed command started itself is tests/spine/test_cluster.py's test_a_sigkilled_driver_leaves_no_ray_process_behind
    (a cluster of its own here started its daemons and Ray Data's helper actors again)."""
    import ray

    samples = big_set
    out = tmp_path / "out"
    cmd = [ROLLFLOW, "recompute", "--input", samples, "--config", GIGPO, "--output", str(out),
           "--set", f"runtime.batch_rows={BATCH_ROWS}"]
    env = {**_child_env(tmp_path / "prefect"), "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    jobs = ray_jobs()
    # the CLI process alone, mid-way through the advantages stage; its Prefect server dies with it
    sigkill_when(cmd, lambda: _in_progress(out), tmp_path / "killed.log", env=env, timeout_s=500,
                 what="the advantages stage")
    wait_ray_jobs_gone(jobs)  # the killed driver's tasks too, before the rerun cleans their temporary folder
    assert (out / "rewarded" / "manifest.json").exists(), "the first stage was committed before the kill"
    assert not (out / "advantaged").exists(), "nothing of the interrupted stage is committed"
    assert any(n.startswith(".advantaged.tmp-") for n in siblings(out / "advantaged")), "the crash left its tmp"

    # the same command again, in this process: on the session's Ray cluster and Prefect server, as a user's command
    # joins a running one
    rerun = rollflow_here(*cmd[1:], api_url=prefect_server.api_url)
    assert rerun.exit_code == 0, rerun.output[-3000:]
    assert "up to date, skipped" in rerun.stdout.splitlines()[0], "the committed first stage is not redone"
    assert "computed in" in rerun.stdout.splitlines()[1]
    assert siblings(out / "advantaged") == ["advantaged"] and siblings(out / "rewarded") == ["rewarded"]

    _assert_resumed_identical(out, big_reference)


@pytest.mark.slow
def test_ctrl_c_mid_run_stops_with_one_line_and_a_rerun_resumes(big_set, big_reference, tmp_path, ray_cluster,
                                                                 prefect_server):
    """SIGINT to the command's whole process group mid-way through the advantages stage: the command, not Prefect's
    ephemeral server in the same group, decides what it means. Exit 130, one line on the console (what is committed,
    how to resume), no traceback, no log record; the flow run is marked Cancelled on the server, which outlived the
    interrupt; nothing of the group is left; the same command resumes to the uninterrupted tables. The child joins
    the session's Ray cluster (RAY_ADDRESS: its tasks end with its driver) and starts its own ephemeral Prefect
    server, the service a terminal's Ctrl-C killed (issue 48)."""
    import ray

    out, cache = tmp_path / "out", tmp_path / "cache"
    cmd = [ROLLFLOW, "recompute", "--input", big_set, "--config", GIGPO, "--output", str(out),
           "--set", f"runtime.batch_rows={BATCH_ROWS}"]
    env = {**_child_env(tmp_path / "prefect"), "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "ROLLFLOW_CACHE": str(cache)}  # the command's log: cache/logs/recompute.log
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 500
        while not _in_progress(out):
            assert proc.poll() is None, f"finished (rc {proc.returncode}) before the advantages stage"
            assert time.monotonic() < deadline, "the advantages stage never came"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)  # a safety bound; benchmarks/kill_trials.py measures the time
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stdout + stderr
    resume = "rollflow " + " ".join(cmd[1:])
    assert stderr.splitlines() == [f"interrupted: 1 output(s) committed (the last: {out / 'rewarded'}); resume with "
                                   f"{resume}"], stderr
    assert "Traceback" not in stdout + stderr and "ERROR" not in stdout + stderr
    assert wait_gone(proc.pid, 30), f"left behind: {group_members(proc.pid)}"
    log = (cache / "logs" / "recompute.log").read_text()
    # the runs are marked Cancelled within flows/interrupt.py's PREFECT_WAIT_S; on a loaded machine that call may time
    # out (logged, the command ends all the same), but it never finds the server gone (ConnectError: connection
    # refused), as it did when a terminal's Ctrl-C killed the server first
    cancelled = "Prefect flow run" in log and "marked Cancelled" in log
    timed_out = "could not mark the Prefect runs Cancelled" in log and "Timeout" in log
    assert cancelled or timed_out, f"Prefect's server died before the command: {log[-2000:]}"
    assert "ConnectError" not in log, "Prefect's server died before the command"
    assert (out / "rewarded" / "manifest.json").exists() and not (out / "advantaged").exists()

    rerun = rollflow_here(*cmd[1:], api_url=prefect_server.api_url)
    assert rerun.exit_code == 0, rerun.output[-3000:]
    assert "up to date, skipped" in rerun.stdout.splitlines()[0], "the committed first stage is not redone"
    _assert_resumed_identical(out, big_reference)
