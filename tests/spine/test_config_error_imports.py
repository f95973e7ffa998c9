"""A config error is reported before the heavy libraries load (issue 48: "no config error takes more than 5 s to
report on the 2-core machine"). Importing torch takes 1-3 s there and Prefect 1-4 s; a command refusing its config
loads neither (torch only where a GPU driver's device node exists: schemas/precision.py looks for a GPU through it).
Each case runs the real command in a process of its own and lists the heavy modules it had loaded when it exited: one
child interpreter imports the command line (flows/cli.py, which must load none of them either) and forks a process per
case, so the cases share that import instead of paying it once each."""

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
# one interpreter for every case: the command line imported once (it must load no heavy library itself), then per
# case a forked process with its stderr in a file of its own runs ``rollflow ARGV`` as the console script would (an
# uncaught error printed with its traceback, SystemExit's code as the exit status) and lists the heavy modules loaded.
# The modules a case's process imported without loading a heavy library are imported by the interpreter before the
# next fork (a module's import runs the same in either; the commands import theirs on first use, most of a case's
# time), so each case still starts from what its command imports and nothing heavy.
_CHILD = """
import importlib, json, os, sys, traceback
heavy, cases, folder = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
from flows.cli import main
print("IMPORTED " + json.dumps([m for m in heavy if m in sys.modules]))
for name, argv in cases.items():
    sys.stdout.flush()
    modules, done = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(modules)
        err = os.open(os.path.join(folder, name + ".stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(err, 2)
        code = 1
        try:
            sys.argv = ["rollflow", *argv]
            main()
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
            if not isinstance(exit.code, (int, type(None))):
                print(exit.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            loaded = [m for m in heavy if m in sys.modules]
            print("LOADED " + json.dumps(loaded), file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            with os.fdopen(done, "w") as pipe:
                pipe.write(json.dumps([] if loaded else [m for m in sys.modules if not m.startswith("__")]))
            os._exit(code)
    os.close(done)
    with os.fdopen(modules) as pipe:
        imported = json.loads(pipe.read() or "[]")
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    for module in imported:
        if module not in sys.modules:
            try:
                importlib.import_module(module)
            except Exception:
                pass  # a name a package puts in sys.modules by hand: its package made it
    print("\\nEXIT " + json.dumps([name, status]))  # on a line of its own after what the case printed
"""


def _without_gpu_probe(loaded: list[str]) -> list[str]:
    """The heavy modules a process loaded, less torch on a GPU host (the dtype fields' auto asks torch which GPU)."""
    return [m for m in loaded if m != "torch"] if gpu_device_nodes() else loaded


def _run_all(cases: dict[str, list[str]], folder: Path) -> dict[str, tuple[int, str]]:
    """``rollflow ARGV`` of each case (name -> ARGV) in a process of its own (see _CHILD): name -> (exit status,
    stderr); the command line's own import must have loaded no heavy library."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(HEAVY), json.dumps(cases), str(folder)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    imported = json.loads(next(line for line in lines if line.startswith("IMPORTED "))[len("IMPORTED "):])
    assert _without_gpu_probe(imported) == [], f"importing flows.cli loaded {imported}"
    status = dict(json.loads(line[len("EXIT "):]) for line in lines if line.startswith("EXIT "))
    assert sorted(status) == sorted(cases), done.stdout[-3000:]
    return {name: (status[name], (folder / f"{name}.stderr").read_text()) for name in cases}


def _check(argv: list[str], status: int, stderr: str) -> None:
    """``rollflow ARGV`` must have exited 2 without a traceback and without having loaded a heavy library."""
    assert status == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    loaded = json.loads(stderr.rsplit("LOADED ", 1)[1].splitlines()[0])
    assert _without_gpu_probe(loaded) == [], f"{argv}: the config error was reported after loading {loaded}"


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


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> dict[str, tuple[list[str], int, str]]:
    """Every case of CASES and RUN_CASES (each against a run folder of its own) run in one child (see _run_all):
    name -> (ARGV, exit status, stderr)."""
    root = tmp_path_factory.mktemp("config-errors")
    cases = dict(CASES)
    for name, (argv, text, _) in RUN_CASES.items():
        _frozen_run(root / name / "runs", text)
        cases[name] = [a.format(runs=root / name / "runs") for a in argv]
    done = _run_all(cases, root)
    return {name: (cases[name], *done[name]) for name in cases}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_config_error_loads_no_heavy_library(case, errors):
    _check(*errors[case])


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_a_run_folder_error_loads_no_heavy_library(case, errors):
    argv, status, stderr = errors[case]
    _check(argv, status, stderr)
    assert RUN_CASES[case][2] in stderr, stderr[-3000:]
