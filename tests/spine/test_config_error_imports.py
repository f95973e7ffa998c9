"""A config error is reported before the heavy libraries load (issue 48: "no config error takes more than 5 s to
report on the 2-core machine"). Importing torch takes 1-3 s there and Prefect 1-4 s; a command refusing its config
loads neither (torch only where a GPU driver's device node exists: schemas/precision.py looks for a GPU through it).
Each case runs the real command in a child process and lists the heavy modules it had loaded when it exited."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from schemas.precision import gpu_device_nodes
from tests.spine.helpers import REPO

HEAVY = ("torch", "prefect", "ray", "vllm", "transformers", "deepspeed")
QUICK = "configs/train_frozenlake_quickstart.yaml"
# what each command is given: a config with an unknown option, a config of another command, a value of the wrong type
CASES = {
    "train-unknown-option": ["train", "--config", QUICK, "--set", "max_stepz=3"],
    "plan-unknown-option": ["plan", "--config", QUICK, "--set", "max_stepz=3", "--cpus", "2", "--gpus", "0"],
    "train-wrong-type": ["train", "--config", QUICK, "--set", "train.ppo_epochs=many"],
    "rollout-config-of-train": ["rollout", "--config", QUICK, "--output", "out"],
    "eval-config-of-score": ["eval", "--config", "configs/rlvr_math.yaml", "--output", "out"],
}
_CHILD = ("import atexit, json, sys\n"
          "atexit.register(lambda: print('LOADED ' + json.dumps([m for m in {heavy!r} if m in sys.modules]), "
          "file=sys.stderr))\n"
          "sys.argv = ['rollflow', *{argv!r}]\n"
          "from flows.cli import main\n"
          "main()\n")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_config_error_loads_no_heavy_library(case, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _CHILD.format(heavy=HEAVY, argv=CASES[case])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    loaded = json.loads(done.stderr.rsplit("LOADED ", 1)[1].splitlines()[0])
    if gpu_device_nodes():  # a GPU host: the dtype fields' auto asks torch which GPU
        loaded = [m for m in loaded if m != "torch"]
    assert loaded == [], f"{case}: the config error was reported after loading {loaded}"


def test_a_run_folder_started_with_another_config_is_refused_before_the_engines_checks(tmp_path):
    """The run folder against the config comes before the pre-flight of the engines and models (which loads torch to
    read the engine's options). Its check lives with the run kit, which loads Prefect (allowed here)."""
    from schemas.config import load_config
    from schemas.train_flow_config import TrainFlowConfig

    other = load_config(TrainFlowConfig, REPO / QUICK, {"rollout.seed": 99, "runs_dir": str(tmp_path)})
    (tmp_path / other.run_name).mkdir()
    (tmp_path / other.run_name / "config.json").write_text(json.dumps(other.model_dump(mode="json")))
    argv = ["train", "--config", QUICK, "--set", f"runs_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _CHILD.format(heavy=HEAVY, argv=argv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "was started with another config" in done.stderr, done.stderr[-3000:]
    loaded = json.loads(done.stderr.rsplit("LOADED ", 1)[1].splitlines()[0])
    assert [m for m in loaded if m != "prefect"] == [] or gpu_device_nodes(), loaded
