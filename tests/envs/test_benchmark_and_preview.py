"""Smoke tests: the env benchmark script's output format and the text preview (no timing assertions)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from stages.envs import ENVIRONMENTS, preview

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "env_steps.py"


def test_benchmark_prints_result_line(capsys):
    spec = importlib.util.spec_from_file_location("env_steps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--steps", "60"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    keys = ["frozenlake_steps_per_s", "sokoban_steps_per_s", "frozenlake_stateless_steps_per_s",
            "sokoban_stateless_steps_per_s"]
    assert re.fullmatch("RESULT " + " ".join(f"{k}=\\d+" for k in keys), last)


def test_preview_every_env():
    for name in ENVIRONMENTS:
        text = preview(name, seed=3)
        instruction, observation = text.split("\n\n", 1)
        assert instruction and observation
