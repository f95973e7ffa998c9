"""The set-up of ``make setup`` (tools/setup_venv.sh) with pip against uv, each into a new venv with empty caches.

    python3 benchmarks/venv_setup.py [--installers pip,uv] [--python python3]

Run from the repository root with any Python 3.11 (it needs nothing installed). For each installer: a new venv in a
temporary folder, pip's and uv's caches empty (their own folders there), ``ROLLFLOW_INSTALLER`` set, then the venv
is checked: it imports torch, transformers, vllm and rollflow's flows, and every installer gave the same packages at
the same versions from the same files (their wheel tags; pip and uv themselves aside). Last line: ``RESULT pip_s=.. pip_cpu_s=.. uv_s=.. uv_cpu_s=..
same_packages=0|1``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_INSTALLERS_THEMSELVES = {"pip", "uv"}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def set_up(installer: str, python: str, folder: Path) -> tuple[float, float, dict[str, str]]:
    """(wall s, CPU s of every process it ran, name -> version in the venv) of one set-up into ``folder``/venv."""
    env = {**os.environ, "ROLLFLOW_INSTALLER": installer, "UV_CACHE_DIR": str(folder / "uv-cache"),
           "PIP_CACHE_DIR": str(folder / "pip-cache")}
    venv = folder / "venv"
    cpu, start = _children_cpu_s(), time.perf_counter()
    subprocess.run(["bash", "tools/setup_venv.sh", str(venv), python], cwd=REPO, env=env, check=True)
    wall, cpu = time.perf_counter() - start, _children_cpu_s() - cpu
    subprocess.run([str(venv / "bin/python"), "-c", "import torch, transformers, vllm, flows.cli"], cwd=REPO,
                   check=True)
    listed = subprocess.run([str(venv / "bin/python"), "-c", _LIST_WHEELS], check=True, capture_output=True,
                            text=True).stdout
    packages = dict(line.split(" ", 1) for line in listed.splitlines())
    return wall, cpu, {k: v for k, v in packages.items() if k not in _INSTALLERS_THEMSELVES}


# every installed distribution: "name version wheel-tags" (the tags say which of a version's files was installed)
_LIST_WHEELS = """
import importlib.metadata as md
for d in md.distributions():
    tags = sorted(l.split(":", 1)[1].strip() for l in (d.read_text("WHEEL") or "").splitlines() if l.startswith("Tag:"))
    print(d.metadata["Name"].lower(), d.version, ",".join(tags))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--installers", default="pip,uv")
    parser.add_argument("--python", default="python3")
    args = parser.parse_args()
    results, sets = {}, []
    for installer in args.installers.split(","):
        folder = Path(tempfile.mkdtemp(prefix=f"venv-setup-{installer}-"))
        try:
            wall, cpu, packages = set_up(installer, args.python, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        results[installer] = (wall, cpu)
        sets.append(packages)
        print(f"{installer:>4}: {wall:7.1f} s wall, {cpu:7.1f} CPU-s, {len(packages)} packages", flush=True)
    same = int(all(s == sets[0] for s in sets))
    if not same:
        for name in sorted(set().union(*sets)):
            versions = [s.get(name) for s in sets]
            if len(set(versions)) > 1:
                print(f"  differs: {name} {versions}")
    figures = " ".join(f"{k}_s={w:.1f} {k}_cpu_s={c:.1f}" for k, (w, c) in results.items())
    print(f"RESULT {figures} same_packages={same}")


if __name__ == "__main__":
    main()
