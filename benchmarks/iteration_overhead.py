"""Where a training iteration's wall time goes: compute (generation, forward passes, forward+backward) against
everything else (process and engine start-up, model loads, Ray scheduling, table reads and writes, rewards and
advantages, checkpoint writes) — issue 16's fixed-overhead share, from the stage timings a run records.

    python benchmarks/iteration_overhead.py --run runs/quickstart        # a finished run folder
    python benchmarks/iteration_overhead.py --max-steps 3                # runs the CPU quickstart first (minutes)

Per training iteration k, from ``runs/<run>/metrics``:

* wall = the wall seconds of its stages (rollout, logprobs, values, response_rewards, advantages, train; the
  evaluation is reported apart, it is not part of the training iteration);
* compute = ``time/rollout/generate`` (generation calls) + ``logprobs/compute_seconds`` (+ ``values/...``: forward
  passes) + ``time/train_s`` (forward, backward and optimizer steps of the training step);
* overhead = wall - compute.

Iteration 0 pays the run's start-up (engines, workers, first model loads); the steady state is the mean over the
later iterations. The last line is ``RESULT overhead_share=<steady> overhead_share_iter0=... iteration_s=...``.

    python benchmarks/iteration_overhead.py --compare 7f95f65 --max-steps 2   # that commit's layout against this one

``--compare COMMIT`` runs the quickstart twice, one after the other: in a temporary worktree of COMMIT ("before") and
in this checkout ("after"), each on a local Ray cluster of its own (RAY_ADDRESS unset), its process tree sampled
every 0.2 s: the processes the run starts (distinct pids below the command: Ray's own, its workers, the engines, the
training and forward workers), the peak of the tree's summed RSS, and the steady iterations' mean wall time. The
last line is ``RESULT processes_before=.. processes_after=.. iter_s_before=.. iter_s_after=.. rss_gib_before=..
rss_gib_after=..`` (issue 44: the actor group computes the log-probs, no forward workers of their own).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ITERATION_STAGES = ("rollout", "logprobs", "values", "response_rewards", "advantages", "train")
COMPUTE = {"rollout": ("time/rollout/generate",), "logprobs": ("logprobs/compute_seconds",),
           "values": ("values/compute_seconds",), "train": ("time/train_s",)}


def iteration_times(run: Path) -> dict[int, dict[str, float]]:
    """Per training iteration: wall, compute and eval seconds from the run's metrics table. Give a run that was not
    resumed: a resumed run logs its skipped stages again, with the seconds of the skip."""
    import pyarrow.dataset as pads

    rows = pads.dataset(str(run / "metrics")).to_table().to_pylist()
    walls = {(r["iteration"], r["stage"]): float(r["wall_s"] or 0.0) for r in rows}
    values = {(r["iteration"], r["stage"], r["name"]): float(r["value"]) for r in rows}
    out: dict[int, dict[str, float]] = {}
    for k in sorted({i for i, s in walls if s == "train"}):
        wall = sum(walls.get((k, s), 0.0) for s in ITERATION_STAGES)
        compute = sum(values.get((k, s, n), 0.0) for s, names in COMPUTE.items() for n in names)
        out[k] = {"wall_s": wall, "compute_s": compute, "overhead_s": wall - compute,
                  "train_wall_s": walls.get((k, "train"), 0.0),
                  "train_setup_s": values.get((k, "train", "time/engine_setup_s"), float("nan")),
                  "logprobs_wall_s": walls.get((k, "logprobs"), 0.0),
                  "eval_s": walls.get((k + 1, "eval"), 0.0)}
    return out


def steady_share(times: dict[int, dict[str, float]]) -> tuple[float, list[dict[str, float]]]:
    """The fixed-overhead share of the steady iterations (all but iteration 0's start-up, when there are later ones)
    and those iterations' times."""
    steady = [t for k, t in times.items() if k > 0] or list(times.values())
    wall = sum(t["wall_s"] for t in steady)
    return (sum(t["overhead_s"] for t in steady) / wall if wall else float("nan")), steady


def run_quickstart(max_steps: int, repo: Path = REPO, runs: Path | None = None) -> tuple[Path, int, float, Counter]:
    """Run the CPU quickstart for ``max_steps`` iterations from the checkout ``repo`` (its code on PYTHONPATH),
    writing under ``runs`` (default: ``repo/runs``). Returns the run folder, the processes its command started,
    the peak RSS of its process tree (GiB) and the processes by kind."""
    name = f"bench-overhead-{int(time.time())}"
    runs = runs or repo / "runs"
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", "configs/train_frozenlake_quickstart.yaml",
           "--set", f"run_name={name}", "--set", f"max_steps={max_steps}", "--set", f"runs_dir={runs}",
           "--no-report"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(repo)
    processes, peak, kinds = watched(cmd, repo, env)
    return runs / name, processes, peak, kinds


def process_kind(cmdline: list[str], name: str) -> str:
    """What a process is, from its command line: a Ray worker's title without its method or arguments
    (``ray::TrainWorker``, ``ray::MapWorker(MapBatches(...))``, ``ray::IDLE``), a Python program's script or module
    (``dashboard/dashboard.py``, ``-m flows.cli``), else the executable's name (``raylet``, ``gcs_server``)."""
    line = " ".join(cmdline).strip()
    if line.startswith("ray::"):
        title = line.split(" ", 1)[0]
        head, paren, rest = title.partition("(")
        return head.rsplit(".", 1)[0] + paren + rest if "." in head[5:] else title
    for i, arg in enumerate(cmdline):
        if arg == "-m" and i + 1 < len(cmdline):
            return f"-m {cmdline[i + 1]}"
        if arg.endswith(".py"):
            return "/".join(Path(arg).parts[-2:])
    return Path(cmdline[0]).name if cmdline else name


def watched(cmd: list[str], cwd: Path, env: dict) -> tuple[int, float, Counter]:
    """Run ``cmd`` to its end; return the distinct processes seen below it, the peak summed RSS (GiB) and the
    processes by kind (:func:`process_kind`; a Ray worker, which starts as ``workers/setup_worker.py`` and
    ``default_worker.py``, counts as the first thing it ran other than ``ray::IDLE``, so a worker that only ever
    waited counts as ``ray::IDLE``; short-lived helpers such as ``g++``, ``lscpu`` or ``sh`` count when a sample
    catches them, so the total varies by a few between runs)."""
    import psutil

    proc = subprocess.Popen(cmd, cwd=cwd, env=env)
    kinds: dict[tuple[int, float], str] = {}
    peak = 0.0
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        total = 0
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        for p in tree:
            try:
                total += p.memory_info().rss
                if p is root:
                    continue
                key = (p.pid, p.create_time())
                seen = kinds.get(key, "ray::IDLE")
                if seen == "ray::IDLE" or not seen.startswith("ray::"):  # a Ray worker starts as setup_worker.py
                    kinds[key] = process_kind(p.cmdline(), p.name())
            except psutil.Error:
                continue
        peak = max(peak, total / 2**30)
        time.sleep(0.2)
    if proc.wait() != 0:
        sys.exit(f"error: {' '.join(cmd)} exited {proc.returncode}")
    return len(kinds), peak, Counter(kinds.values())  # the command itself is not started by the run


def compare(commit: str, max_steps: int) -> None:
    """The quickstart at ``commit`` (before) and in this checkout (after); prints the RESULT line."""
    results, kinds = {}, {}
    with tempfile.TemporaryDirectory(prefix="rollflow-before-") as tmp:
        old = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), commit], cwd=REPO, check=True,
                       capture_output=True)
        try:
            for label, repo in (("before", old), ("after", REPO)):
                run, processes, peak, kinds[label] = run_quickstart(max_steps, repo, Path(tmp) / f"runs-{label}")
                _, steady = steady_share(iteration_times(run))
                results[label] = (processes, sum(t["wall_s"] for t in steady) / len(steady), peak)
                print(f"{label}: {repo} processes={processes} iter_s={results[label][1]:.1f} "
                      f"rss_gib={peak:.2f}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True)
            shutil.rmtree(old, ignore_errors=True)
    print(f"{'processes by kind':<60} {'before':>6} {'after':>6}")
    for kind in sorted(set(kinds["before"]) | set(kinds["after"])):
        print(f"{kind:<60} {kinds['before'][kind]:>6} {kinds['after'][kind]:>6}")
    (pb, ib, rb), (pa, ia, ra) = results["before"], results["after"]
    print(f"RESULT processes_before={pb} processes_after={pa} iter_s_before={ib:.1f} iter_s_after={ia:.1f} "
          f"rss_gib_before={rb:.2f} rss_gib_after={ra:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a finished training run folder (default: run the quickstart)")
    parser.add_argument("--max-steps", type=int, default=3, help="iterations of the quickstart run")
    parser.add_argument("--compare", metavar="COMMIT", help="the quickstart at COMMIT against this checkout")
    args = parser.parse_args()
    if args.compare:
        compare(args.compare, args.max_steps)
        return
    if args.run:
        run = args.run
    else:
        run, processes, _, kinds = run_quickstart(args.max_steps)
        print(f"processes={processes}: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    times = iteration_times(run)
    if not times:
        sys.exit(f"error: {run} has no training iteration in its metrics; give a run folder that trained")
    print(f"run {run}")
    print(f"{'iteration':>9} {'wall_s':>8} {'compute_s':>9} {'overhead':>8} {'share':>6} {'train_s':>8} "
          f"{'setup_s':>7} {'logprobs_s':>10} {'eval_s':>7}")
    for k, t in times.items():
        print(f"{k:>9} {t['wall_s']:>8.1f} {t['compute_s']:>9.1f} {t['overhead_s']:>8.1f} "
              f"{t['overhead_s'] / t['wall_s']:>6.1%} {t['train_wall_s']:>8.1f} {t['train_setup_s']:>7.1f} "
              f"{t['logprobs_wall_s']:>10.1f} {t['eval_s']:>7.1f}")
    share, steady = steady_share(times)
    first = times[min(times)]
    print(f"RESULT overhead_share={share:.3f} overhead_share_iter0={first['overhead_s'] / first['wall_s']:.3f} "
          f"iteration_s={sum(t['wall_s'] for t in steady) / len(steady):.1f} "
          f"overhead_s={sum(t['overhead_s'] for t in steady) / len(steady):.1f} iterations={len(times)}")


if __name__ == "__main__":
    main()
