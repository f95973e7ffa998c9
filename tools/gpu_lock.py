"""The locked CUDA set: what ``requirements-gpu.lock`` holds and how it is checked.

    python tools/gpu_lock.py requirements          # the resolver's input, one requirement a line
    python tools/gpu_lock.py write REPORT          # requirements-gpu.lock from pip's --report of that input
    python tools/gpu_lock.py check REPORT          # the report against the lock, pyproject.toml and the CPU lock

The input is the project's gpu and test extras (the CUDA vllm, which pins torch) plus GEM's runtime packages at the
CPU lock's versions (reasoning_gym, nltk, datasets: gem-llm itself is installed without dependencies, as on CPU).
The report must come from the package index alone (``pip --isolated``: no configured find-links or extra indexes,
whose local CPU wheels would stand in for the CUDA ones): a ``+cpu`` build, or a file not downloaded from an index,
is refused. Pure Python and ``packaging``; no network.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements-gpu.lock"
CPU_LOCK = REPO / "requirements.lock"
GEM_RUNTIME = ("reasoning_gym", "nltk", "datasets")  # gem-llm's imports on the environments rollflow uses
SHARED_WITH_CPU = ("torch", "deepspeed", "ray", "transformers", "pyarrow", "prefect")  # the same release on both
HEADER = ("# The CUDA set of `make setup-gpu`: pip's resolution of .[gpu,test] and GEM's runtime packages from the\n"
          "# package index alone (tools/gpu_lock.py; re-lock: tools/lock_gpu.sh; checked by .ci/check_gpu_extra).\n")
CUDA_RUNTIME = "nvidia-cuda-runtime"  # a requirement of torch's CUDA builds on the index (Linux x86_64), of no other
_PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)")


def read_pins(path: Path) -> dict[str, str]:
    """``name -> version`` of a ``name==version`` lock file (names canonical)."""
    pins = {}
    for line in path.read_text().splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def requirements() -> list[str]:
    """The resolver's input: the project's gpu and test extras and GEM's runtime packages at the CPU lock's pins."""
    cpu = read_pins(CPU_LOCK)
    return [".[gpu,test]"] + [f"{name}=={cpu[canonicalize_name(name)]}" for name in GEM_RUNTIME]


def installs(report: dict) -> dict[str, tuple[str, str]]:
    """``name -> (version, download url)`` of a pip ``--report`` (rollflow itself left out)."""
    out = {}
    for item in report["install"]:
        name = canonicalize_name(item["metadata"]["name"])
        if name != "rollflow":
            out[name] = (item["metadata"]["version"], item.get("download_info", {}).get("url", ""))
    return out


def lock_text(resolved: dict[str, tuple[str, str]]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, (version, _) in sorted(resolved.items()))


def problems(resolved: dict[str, tuple[str, str]], lock: dict[str, str], cpu_lock: dict[str, str],
             pyproject: dict) -> list[str]:
    """Why the resolved CUDA set is not the locked one, each with the fix (empty: it is)."""
    out = []
    cpu_builds = sorted(f"{n} {v}" for n, (v, _) in resolved.items() if "+cpu" in v)
    if cpu_builds:
        out.append(f"CPU builds in the CUDA set: {', '.join(cpu_builds)}; resolve from the package index alone (pip "
                   "--isolated: no find-links folder of CPU wheels)")
    local = sorted(n for n, (_, url) in resolved.items() if url and not url.startswith("https://"))
    if local:
        out.append(f"not from a package index: {', '.join(local)} (a local file or folder); resolve with pip "
                   "--isolated")
    torch = resolved.get("torch", ("missing", ""))[0]
    if torch == "missing" or "+" in torch:
        out.append(f"torch {torch}: the CUDA set needs the index's torch (a CUDA build, no local tag)")
    elif CUDA_RUNTIME not in resolved:
        out.append(f"torch {torch} resolved without {CUDA_RUNTIME}, the CUDA runtime every CUDA build of torch "
                   "requires: the index served a CPU build for this platform; resolve on Linux x86_64")
    got = {n: v for n, (v, _) in resolved.items()}
    changed = sorted(set(got) ^ set(lock)) + sorted(n for n in set(got) & set(lock) if got[n] != lock[n])
    if changed:
        shown = ", ".join(f"{n} {lock.get(n, '-')} -> {got.get(n, '-')}" for n in changed[:8])
        out.append(f"requirements-gpu.lock differs from the resolution in {len(changed)} package(s) ({shown}); "
                   "re-lock with tools/lock_gpu.sh and commit it")
    project = pyproject["project"]
    for text in project["dependencies"] + project["optional-dependencies"]["gpu"]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in lock and not req.specifier.contains(lock[name], prereleases=True):
            out.append(f"pyproject.toml asks for {text}, requirements-gpu.lock has {name}=={lock[name]}; re-lock with "
                       "tools/lock_gpu.sh")
        elif name not in lock:
            out.append(f"pyproject.toml's {text} is not in requirements-gpu.lock; re-lock with tools/lock_gpu.sh")
    for name in SHARED_WITH_CPU:
        if lock.get(name, "missing").split("+")[0] != cpu_lock.get(name, "missing").split("+")[0]:
            out.append(f"{name} {lock.get(name, 'missing')} in requirements-gpu.lock, {cpu_lock.get(name)} in "
                       "requirements.lock: pin the gpu extra's vllm to the release whose torch pin equals the lock's")
    for name in GEM_RUNTIME:
        if canonicalize_name(name) not in lock:
            out.append(f"GEM's runtime package {name} is missing from requirements-gpu.lock; re-lock")
    return out


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "requirements":
        print("\n".join(requirements()))
        return 0
    if command not in ("write", "check") or len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    resolved = installs(json.loads(Path(argv[1]).read_text()))
    if command == "write":
        found = problems(resolved, {n: v for n, (v, _) in resolved.items()}, read_pins(CPU_LOCK),
                         tomllib.loads((REPO / "pyproject.toml").read_text()))
        if found:
            print("gpu lock: not written: " + "; ".join(found), file=sys.stderr)
            return 1
        LOCK.write_text(lock_text(resolved))
        print(f"wrote {LOCK.name}: {len(resolved)} packages, torch {resolved['torch'][0]}")
        return 0
    found = problems(resolved, read_pins(LOCK), read_pins(CPU_LOCK), tomllib.loads((REPO / "pyproject.toml")
                                                                                  .read_text()))
    if found:
        print("gpu set: " + "\n  ".join(["problems:"] + found), file=sys.stderr)
        return 1
    print(f"gpu set resolves from the index alone and equals requirements-gpu.lock: {len(resolved)} packages, torch "
          f"{resolved['torch'][0]} (CUDA build), vllm {resolved.get('vllm', ('-',))[0]}, deepspeed "
          f"{resolved.get('deepspeed', ('-',))[0]}; dry run, nothing downloaded")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
