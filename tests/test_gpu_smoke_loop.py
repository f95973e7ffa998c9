"""benchmarks/gpu_smoke.py's whole-loop check (issue 45, check 6), the part a CPU machine can run: the command it
starts is a valid ``rollflow train`` of the GPU quickstart config (its overrides pass the real CLI's ``rollflow plan``,
which fits one GPU), and the check says which modules are missing instead of failing where Ray was not carried in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    import gpu_smoke
finally:
    sys.path.remove(str(BENCHMARKS))


def test_the_loop_command_is_a_valid_run_that_fits_one_gpu(tmp_path):
    command = gpu_smoke.loop_command(tmp_path / "runs")
    assert command[command.index("train") - 2:command.index("train") + 1] == ["-m", "flows.cli", "train"]
    plan = [arg for arg in command if arg != "--no-report"]
    plan[plan.index("train")] = "plan"
    done = subprocess.run(plan + ["--gpus", "1", "--cpus", "16"], cwd=gpu_smoke.REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "run gpu_smoke_loop" in done.stdout and "fits: yes" in done.stdout
    assert "policy copies on the GPUs: 2" in done.stdout
    assert not (tmp_path / "runs").exists()  # a plan writes nothing


def test_the_loop_is_skipped_with_the_missing_modules_named(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_smoke, "LOOP_MODULES", ("ray", "no_such_module_here", "also_missing"))
    assert gpu_smoke.whole_loop(tmp_path) == "skipped(no no_such_module_here+also_missing)"
    assert not (tmp_path / "runs").exists()
