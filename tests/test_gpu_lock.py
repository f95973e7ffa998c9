"""tools/gpu_lock.py: the CUDA set is locked, from the package index alone, and matches pyproject.toml."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_lock", REPO / "tools" / "gpu_lock.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
LOCK = tool.read_pins(REPO / "requirements-gpu.lock")
CPU_LOCK = tool.read_pins(REPO / "requirements.lock")
INDEX = "https://files.example/"


def _resolved(**changes) -> dict[str, tuple[str, str]]:
    """The lock as pip's resolution would report it from an index, with ``changes`` (name -> version)."""
    out = {name: (version, f"{INDEX}{name}-{version}.whl") for name, version in LOCK.items()}
    out.update({name.replace("_", "-"): (version, f"{INDEX}{name}.whl") for name, version in changes.items()})
    return out


def test_the_committed_lock_is_a_cuda_set_with_gems_packages():
    assert len(LOCK) > 290  # the CPU-wheel resolution had 261
    assert "+" not in LOCK["torch"] and LOCK["torch"] == CPU_LOCK["torch"]
    assert LOCK["vllm"] == "0.32.0" and any(name.startswith("nvidia-") for name in LOCK)
    assert {"reasoning-gym", "nltk", "datasets"} <= set(LOCK)


def test_the_resolution_of_the_lock_has_no_problem():
    assert tool.problems(_resolved(), LOCK, CPU_LOCK, PYPROJECT) == []


def test_a_cpu_torch_from_a_find_links_folder_is_refused():
    found = tool.problems({**_resolved(), "torch": (f"{LOCK['torch']}+cpu", "file:///opt/wheels/torch.whl")}, LOCK,
                          CPU_LOCK, PYPROJECT)
    assert any("CPU builds in the CUDA set: torch" in p for p in found)
    assert any("not from a package index: torch" in p for p in found)


def test_drift_from_the_lock_names_the_package_and_the_fix():
    found = tool.problems(_resolved(nltk="3.9.2"), LOCK, CPU_LOCK, PYPROJECT)
    assert len(found) == 1 and "nltk 3.9.1 -> 3.9.2" in found[0] and "tools/lock_gpu.sh" in found[0]


def test_a_lock_that_pyproject_no_longer_allows_is_refused():
    project = {"project": {**PYPROJECT["project"], "optional-dependencies": {
        **PYPROJECT["project"]["optional-dependencies"], "gpu": ["vllm==0.33.0"]}}}
    found = tool.problems(_resolved(), LOCK, CPU_LOCK, project)
    assert any("vllm==0.33.0" in p and "vllm==0.32.0" in p for p in found)


def test_a_torch_without_its_cuda_runtime_is_refused():
    """An untagged torch from the index is a CPU build where the platform has no CUDA wheels (macOS, aarch64): the
    resolution then lacks the CUDA runtime that torch's CUDA builds require."""
    resolved = {name: item for name, item in _resolved().items() if name != tool.CUDA_RUNTIME}
    found = tool.problems(resolved, LOCK, CPU_LOCK, PYPROJECT)
    assert any(f"torch {LOCK['torch']} resolved without nvidia-cuda-runtime" in p for p in found)
