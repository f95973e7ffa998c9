"""Environments register themselves: importing any module of ``stages.envs`` alone fills the registry with every
built-in tag. That the registry module imports no environment (no import circle) is a contract of pyproject.toml's
``[tool.importlinter]`` (tests/test_import_contracts.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV_MODULES = ("stages.envs.frozen_lake", "stages.envs.sokoban", "stages.envs.single_turn", "stages.envs.gem_adapter",
               "stages.envs.webshop")


@pytest.mark.parametrize("module", ("stages.envs.registry",) + ENV_MODULES)
def test_any_module_alone_registers_every_built_in(module):
    from stages.envs import ENVIRONMENTS

    code = (f"import importlib; importlib.import_module({module!r})\n"
            "from stages.envs.registry import ENVIRONMENTS\n"
            "print(' '.join(ENVIRONMENTS.names()))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ENVIRONMENTS.names()
