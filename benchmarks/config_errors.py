"""How long a config error takes to report (issue 48: "No config error takes more than 5 s to report on the 2-core
machine"): the bad-input catalogue's config cases (tests/spine/test_bad_input_catalogue.py: every CONFIG_FILES case,
and the TRAIN and PLAN cases about the config file or ``--set``), each run as a real ``rollflow`` subprocess in the
catalogue's working folder, timed from start to exit. Every case must exit with status 2 (a case that does not is
printed and counted as a failure). Prints one line per case, then
``RESULT median_config_error_s=.. max_config_error_s=.. cases=.. failures=..``.

    flock /tmp/rollflow-heavy.lock python benchmarks/config_errors.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pytest  # noqa: E402  (the catalogue's fixtures build its working folder and inputs)

from tests.spine import test_bad_input_catalogue as catalogue  # noqa: E402


def config_cases() -> dict[str, tuple[list[str], list[str]]]:
    """The catalogue's config cases: CONFIG_FILES, and TRAIN and PLAN cases about the config file or --set."""
    about_config = {k: v for k, v in {**catalogue.TRAIN, **catalogue.PLAN}.items() if "config" in k or "set" in k}
    return {**catalogue.CONFIG_FILES, **about_config}


class _Factory:
    """What the catalogue's module fixtures take from pytest's tmp_path_factory."""

    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))
        return path


def prepare(root: Path) -> tuple[Path, dict[str, str]]:
    """The catalogue's working folder and shared inputs under ``root``."""
    from stages.generation.model_store import tiny_random_model_dir

    factory = _Factory(root)
    shared = catalogue.shared._get_wrapped_function()(factory, factory.mktemp("data"), tiny_random_model_dir())
    work = root / "work"
    work.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        catalogue.work._get_wrapped_function()(work, mp, None)
    return work, shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case (the median over all counts)")
    args = parser.parse_args()
    exe = str(Path(sys.executable).parent / "rollflow")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    times: list[float] = []
    failures = 0
    with tempfile.TemporaryDirectory(prefix="rollflow-config-errors-") as tmp:
        work, shared = prepare(Path(tmp))
        for name, (argv, _) in sorted(config_cases().items()):
            values = {**shared, "port": "4999"}
            command = [exe, *[values[a[1:]] if a.startswith("@") else a for a in argv]]
            for _ in range(args.repeat):
                start = time.perf_counter()
                done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
                seconds = time.perf_counter() - start
                times.append(seconds)
                ok = done.returncode == 2 and "Traceback" not in done.stderr
                failures += not ok
                print(f"{name:<44} {seconds:6.2f} s  exit {done.returncode}{'' if ok else '  FAILED'}", flush=True)
                if not ok:
                    print(done.stderr[-2000:])
    print(f"RESULT median_config_error_s={statistics.median(times):.2f} max_config_error_s={max(times):.2f} "
          f"cases={len(times)} failures={failures}")


if __name__ == "__main__":
    main()
