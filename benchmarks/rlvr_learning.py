"""Learning benchmark (issue 47): does the default model learn an RLVR task on the 2-core CPU machine in a budget?

1. ``rollflow eval`` of the untrained model (SmolLM2-135M-Instruct) on the config's held-out validation prompts
   (greedy, one response per prompt, scored by the config's validation reward routes);
2. ``rollflow train`` (the real flow: vLLM-CPU generation, reward workers, DeepSpeed training) with in-run
   validation off, stopped when ``--budget-min`` is spent (SIGTERM to its process group; committed steps stay);
3. ``rollflow eval`` of the run's last committed checkpoint on the same prompts with the same seeds.

The held-out items are paired (the same prompt before and after), so the 95 % interval of the difference
``final - base`` is a paired bootstrap over the items (10 000 resamples, percentile interval); the base and final
scores carry their own Wilson intervals in the table. The evaluations are outside the budget. Last line:

``RESULT base_score=.. final_score=.. ci95_low=.. ci95_high=.. heldout_n=.. iterations=.. s_per_iter=..``

Usage: python benchmarks/rlvr_learning.py [--config configs/rlvr_train_add2.yaml] [--budget-min 60]
       [--heldout 300] [--runs-dir DIR] [--run-name NAME] [--set key=value ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from frozenlake_learning import learning_arguments, run_budgeted  # noqa: E402
from stages.algos.intervals import paired_bootstrap_diff, wilson  # noqa: E402


def rollflow() -> str:
    return str(Path(sys.executable).parent / "rollflow")


def evaluate(config: str, sets: list[str], checkpoint: str | None, output: Path, log: Path) -> dict[str, float]:
    """``rollflow eval`` of ``checkpoint`` (None: the config's initial policy) → {prompt_id: score} (unscored rows,
    which a well-formed task does not have, count as 0)."""
    cmd = [rollflow(), "eval", "--config", config, "--output", str(output)]
    cmd += ["--checkpoint", checkpoint] if checkpoint else []
    for s in sets:
        cmd += ["--set", s]
    wall, rc = run_budgeted(cmd, 3600, log)
    if rc != 0:
        sys.exit(f"rollflow eval exited with {rc} after {wall:.0f}s; see {log}")
    return evaluate_read(output)


def last_checkpoint(run: Path) -> tuple[str | None, int]:
    """(folder of the last committed step checkpoint, number of committed steps)."""
    done = [d for d in sorted(run.glob("step_*")) if (d / "checkpoint" / "manifest.json").exists()]
    return (str(done[-1] / "checkpoint"), len(done)) if done else (None, 0)


def step_seconds(run: Path) -> list[float]:
    """Wall seconds of each committed training step (its stages summed) from the run's metrics table."""
    return [sum(w.values()) for w in stage_seconds(run)]


def stage_seconds(run: Path) -> list[dict[str, float]]:
    """Wall seconds of each stage ({stage: seconds}) of each committed training step, from the run's metrics."""
    from stages.metrics import read_metrics

    walls: dict[int, dict[str, float]] = {}
    for r in read_metrics(run).to_pylist():
        if r["wall_s"] is not None and r["stage"] != "validation":
            walls.setdefault(r["iteration"], {})[r["stage"]] = r["wall_s"]
    return [w for _, w in sorted(walls.items()) if "train" in w]


def main() -> None:
    parser = learning_arguments(__doc__.splitlines()[0], "configs/rlvr_train_add2.yaml", "rlvr-learning", 1000,
                                "no new training or evaluation: report the committed run and evaluations of "
                                "--run-name")
    parser.add_argument("--heldout", type=int, default=300, help="held-out prompts evaluated (the first N)")
    args = parser.parse_args()

    run = Path(args.runs_dir) / args.run_name
    sets = [f"run_name={args.run_name}", f"runs_dir={args.runs_dir}", f"validation.prompts.limit={args.heldout}",
            *args.overrides]
    train_sets = [*sets, f"max_steps={args.max_steps}", "validation.eval_steps=0"]
    evals = run.parent / f"{args.run_name}-evals"
    evals.mkdir(parents=True, exist_ok=True)
    if not args.analyze_only:
        print("evaluating the untrained model", flush=True)
        evaluate(args.config, sets, None, evals / "base", evals / "base.log")
        cmd = [rollflow(), "train", "--config", args.config, "--no-report"]
        for s in train_sets:
            cmd += ["--set", s]
        print("running:", " ".join(cmd), flush=True)
        run.mkdir(parents=True, exist_ok=True)
        wall, rc = run_budgeted(cmd, args.budget_min * 60, evals / "train.log")
        print(f"training {'stopped by the budget' if rc is None else f'exited with {rc}'} after {wall:.0f}s",
              flush=True)
        if rc not in (None, 0):
            print(f"warning: the training run ended early (see {evals / 'train.log'}); reporting its committed steps")
    checkpoint, steps = last_checkpoint(run)
    if checkpoint is None:
        sys.exit(f"no committed training step in {run}; see {evals / 'train.log'} (raise --budget-min)")
    if not args.analyze_only:
        print(f"evaluating {checkpoint}", flush=True)
        evaluate(args.config, sets, checkpoint, evals / "final", evals / "final.log")
    base = evaluate_read(evals / "base")
    final = evaluate_read(evals / "final")
    items = sorted(base)
    if sorted(final) != items:
        sys.exit("the two evaluations scored different prompts; delete the -evals folder and run again")
    b, f = np.array([base[i] for i in items]), np.array([final[i] for i in items])
    diff, low, high = paired_bootstrap_diff(b, f)
    n = len(items)
    walls = step_seconds(run)
    for label, x in (("base", b), ("final", f)):
        lo, hi = wilson(x.sum(), n)
        print(f"{label:>6}: {x.mean():.3f} (Wilson 95 % [{lo:.3f}, {hi:.3f}], n={n})")
    print(f"  diff: {diff:+.3f} (paired bootstrap 95 % [{low:+.3f}, {high:+.3f}]); items improved "
          f"{int(((f - b) > 0).sum())}, worsened {int(((f - b) < 0).sum())}")
    summary = {"base_score": float(b.mean()), "final_score": float(f.mean()), "ci95_low": low, "ci95_high": high,
               "heldout_n": n, "iterations": steps,
               "s_per_iter": round(sum(walls) / len(walls), 1) if walls else 0.0}
    (evals / "learning_summary.json").write_text(json.dumps({**summary, "checkpoint": checkpoint,
                                                             "interval": "paired bootstrap, 10000 resamples"},
                                                            indent=1))
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


def evaluate_read(output: Path) -> dict[str, float]:
    """The scores of a committed evaluation folder by prompt id (as :func:`evaluate` returns them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(folder: str, columns: list[str]) -> list[dict]:
        parts = sorted((output / folder).glob("*.parquet"))
        return pa.concat_tables([pq.read_table(p, columns=columns) for p in parts]).to_pylist()

    responses = table("responses", ["row_id", "prompt_id"])
    scores = {r["row_id"]: r["scores"] for r in table("scored", ["row_id", "scores"])}
    return {r["prompt_id"]: float(scores.get(r["row_id"]) or 0.0) for r in responses}


if __name__ == "__main__":
    main()
