"""Environments register themselves: the registry module imports no environment (no import circle), and importing
any module of ``stages.envs`` alone fills the registry with every built-in tag."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV_MODULES = ("stages.envs.frozen_lake", "stages.envs.sokoban", "stages.envs.single_turn", "stages.envs.gem_adapter",
               "stages.envs.webshop")


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` / ``from ... import`` anywhere in ``path`` names (function bodies included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_registry_module_imports_no_environment():
    imported = _imported_modules(ROOT / "stages" / "envs" / "registry.py")
    assert not {m for m in imported if m.startswith(ENV_MODULES)}, imported


@pytest.mark.parametrize("module", ("stages.envs.registry",) + ENV_MODULES)
def test_any_module_alone_registers_every_built_in(module):
    from stages.envs import ENVIRONMENTS

    code = (f"import importlib; importlib.import_module({module!r})\n"
            "from stages.envs.registry import ENVIRONMENTS\n"
            "print(' '.join(ENVIRONMENTS.names()))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ENVIRONMENTS.names()
