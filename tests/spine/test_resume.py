"""The issue's "done" criterion: ``rollflow recompute`` killed with SIGKILL mid-way and started again produces output
identical to an uninterrupted run (compared row by row, not by file names)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from stages.example import ExampleSpec, generate
from tests.spine.conftest import SMALL
from tests.spine.helpers import GIGPO, assert_tables_equal, config, read_table, run_recompute, siblings
from tests.processes import rollflow_here, sigkill_when

ROLLFLOW = str(Path(sys.executable).parent / "rollflow")
BATCH_ROWS = 100  # 40 batches a stage: a kill lands mid-stage, as with bigger tables


def _child_env(prefect_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
    env["PREFECT_HOME"] = str(prefect_home)
    return env


def _in_progress(out: Path) -> bool:
    """The advantages stage has written at least one batch into its temporary folder."""
    if not (out / "rewarded" / "manifest.json").exists():
        return False
    for tmp in out.glob(".advantaged.tmp-*"):
        if any((tmp / "_partials").glob("*.json")):
            return True
    return False


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_gives_the_uninterrupted_output(data_root, tmp_path, ray_cluster, prefect_server):
    samples = str(data_root / "big")
    generate(ExampleSpec(samples=4000, seed=11, rows_per_file=500, **SMALL), samples)
    out = tmp_path / "out"
    cmd = [ROLLFLOW, "recompute", "--input", samples, "--config", GIGPO, "--output", str(out),
           "--set", f"runtime.batch_rows={BATCH_ROWS}", "--set", "runtime.num_cpus=2"]
    env = _child_env(tmp_path / "prefect")
    # the CLI process alone, mid-way through the advantages stage; its Ray cluster and Prefect server die with it
    sigkill_when(cmd, lambda: _in_progress(out), tmp_path / "killed.log", env=env, timeout_s=500,
                 what="the advantages stage")
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

    reference = tmp_path / "reference"
    run_recompute(samples, str(reference), config(GIGPO, runtime={"batch_rows": BATCH_ROWS}))
    for name in ("rewarded", "advantaged"):
        assert_tables_equal(read_table(out / name), read_table(reference / name), name)
        resumed = json.loads((out / name / "manifest.json").read_text())
        fresh = json.loads((reference / name / "manifest.json").read_text())
        assert resumed["fingerprint"] == fresh["fingerprint"]
        assert resumed["rows"] == fresh["rows"] >= 4000
        assert resumed["metrics"] == pytest.approx(fresh["metrics"], rel=1e-12, abs=1e-15)
