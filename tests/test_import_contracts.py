"""The import rules of pyproject.toml's ``[tool.importlinter]`` (layers flows -> stages -> schemas and inside stages,
pure algorithm code free of ray/prefect/deepspeed/vllm, independent packages) hold, and fail when an import that
breaks them is planted in a copy of the packages (never in the repository). Function-level imports count."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "stages", "schemas")
# import-linter's command line, in this interpreter; no cache folder is written (--no-cache)
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"


def lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the packages under ``root`` with ``root/pyproject.toml``'s contracts."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *inherited])}
    done = subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    if "No module named 'importlinter'" in done.stderr:
        pytest.fail(f"import-linter is not installed in {sys.prefix}; requirements.lock pins it: run `make setup`")
    return done


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    """The three packages (source files only) and pyproject.toml, copied."""
    root = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def test_the_contracts_hold():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(("module", "planted", "broken"), [
    # a lazy import inside a function of the bottom layer, up to stages
    ("schemas/tables.py", "def _planted():\n    from stages.storage import Location\n",
     "flows -> stages -> schemas"),
    # storage (low in stages) reaching up to the generation layer, as it did for cache_root_path
    ("stages/storage.py", "def _planted():\n    from stages.generation.model_store import DEFAULT_MODEL_NAME\n",
     "inside stages"),
    ("stages/algos/ragged.py", "import ray\n", "pure algorithm code imports no engine"),
    ("stages/losses/__init__.py", "def _planted():\n    import deepspeed\n", "pure algorithm code imports no engine"),
    ("stages/envs/frozen_lake.py", "from stages.losses import agg_loss\n", "the data-side math, the losses and"),
    ("stages/envs/registry.py", "def _planted():\n    from stages.envs import sokoban\n",
     "the environment registry imports no environment"),
])
def test_a_planted_import_breaks_its_contract(tree_copy, module, planted, broken):
    path = tree_copy / module
    original = path.read_text()
    path.write_text(original + "\n\n" + planted)
    try:
        done = lint(tree_copy)
    finally:
        path.write_text(original)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    broken_section = done.stdout.split("Broken contracts", 1)[1]
    assert broken in broken_section, done.stdout[-4000:]
