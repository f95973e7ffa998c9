"""A config error is reported before the heavy libraries load (issue 48: "no config error takes more than 5 s to
report on the 2-core machine"). Importing torch takes 1-3 s there and Prefect 1-4 s; a command refusing its config
loads neither (torch only where a GPU driver's device node exists: schemas/precision.py looks for a GPU through it).
Each case runs the real command in a child process and lists the heavy modules it had loaded when it exited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.config import load_config
from schemas.precision import gpu_device_nodes
from schemas.train_flow_config import TrainFlowConfig
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
    "deploy-config-of-rlvr-training": ["deploy", "--interval", "60", "--input", "emptydir", "--output", "out",
                                       "--config", "configs/rlvr_train_math.yaml"],
}
_CHILD = ("import atexit, json, sys\n"
          "atexit.register(lambda: print('LOADED ' + json.dumps([m for m in {heavy!r} if m in sys.modules]), "
          "file=sys.stderr))\n"
          "sys.argv = ['rollflow', *{argv!r}]\n"
          "from flows.cli import main\n"
          "main()\n")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    """``rollflow ARGV`` in a child process; it must exit 2 without a traceback and without having loaded a heavy
    library."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _CHILD.format(heavy=HEAVY, argv=argv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    loaded = json.loads(done.stderr.rsplit("LOADED ", 1)[1].splitlines()[0])
    if gpu_device_nodes():  # a GPU host: the dtype fields' auto asks torch which GPU
        loaded = [m for m in loaded if m != "torch"]
    assert loaded == [], f"{argv}: the config error was reported after loading {loaded}"
    return done


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_config_error_loads_no_heavy_library(case):
    _run(CASES[case])


def _frozen_run(runs: Path, text: str | None = None) -> None:
    """A run folder of the quickstart config under ``runs``, frozen with another config (``text``: config.json's
    text instead)."""
    other = load_config(TrainFlowConfig, REPO / QUICK, {"rollout.seed": 99, "runs_dir": str(runs)})
    (runs / other.run_name).mkdir(parents=True)
    (runs / other.run_name / "config.json").write_text(text or json.dumps(other.model_dump(mode="json")))


# the run folder against the config (stages/run_folder.py): a config error, reported before the run kit
# (flows/runkit.py, which loads Prefect) and the engines' and models' checks (which load torch)
RUN_CASES = {
    "train-run-folder-of-another-config": (["train", "--config", QUICK, "--set", "runs_dir={runs}"], None,
                                           "was started with another config"),
    "train-run-config-not-a-mapping": (["train", "--config", QUICK, "--set", "runs_dir={runs}"], "[1]",
                                       "is not a mapping of options"),
    "train-resume-with-set": (["train", "--resume", "{runs}/quickstart", "--set", "max_steps=3"], None,
                              "--set cannot change a run being resumed"),
    "train-resume-config-not-a-mapping": (["train", "--resume", "{runs}/quickstart"], "[1]",
                                          "is not a mapping of options"),
}


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_a_run_folder_error_loads_no_heavy_library(case, tmp_path):
    argv, text, phrase = RUN_CASES[case]
    _frozen_run(tmp_path / "runs", text)
    done = _run([a.format(runs=tmp_path / "runs") for a in argv])
    assert phrase in done.stderr, done.stderr[-3000:]
