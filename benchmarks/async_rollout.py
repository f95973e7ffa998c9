"""Generation overlapped with training (issue 46): the same run in turn (``async_generation_ratio: 0``) and with
the rollouts played ahead (``async_generation_ratio: r``, ``--ratio``, default 1: one iteration ahead; 2: two rollouts
in flight), one after the other in one command, and what the overlap saves.

    python benchmarks/async_rollout.py                       # the tiny FrozenLake run of the tests, 4 iterations
    python benchmarks/async_rollout.py --max-steps 4 --ratio 2
    python benchmarks/async_rollout.py --max-steps 6 --config configs/train_frozenlake_quickstart.yaml

Each run is a real ``rollflow train`` (Prefect, Ray, the engine, DeepSpeed) without evaluations. From each run's
metrics table (``runs/<run>/metrics``):

* iteration seconds = (end of the last training step - end of the first) / (iterations - 1): the steady state, without
  the first iteration's start-up (engines and workers built, nothing to overlap yet);
* overlap share = the seconds a rollout played ahead while the flow's thread ran the previous iteration's later
  steps (``rollout/overlap_seconds`` of the rollouts played during that span), over the same span;
* mean staleness = the mean of ``rollout/staleness`` over the iterations after the first (1 with r = 1; 5/3 with
  r = 2 and 4 iterations: 1, 2, 2).

What the overlap would give with **the engines and the actor on devices of their own** (the disaggregated GPU layout,
which this machine cannot show: here both halves share two cores), predicted from the run in turn, whose stages do not
compete for the cores:

* ``gen_s`` = the generation stage's seconds per iteration (``time/rollout``, RLVR's ``time/generate``: playing the
  rollout, the checkpoint's load into the engines included), ``rest_s`` = the seconds of the later stages of the
  iteration (``time/<stage>`` of log-probs, values, response rewards, advantages, the training step; RLVR's scoring
  too), each the mean over the iterations after the first (the first builds the engines and the workers);
* in turn an iteration takes ``gen_s + rest_s``; with r >= 1 the rollout of k + 1 starts when k's ends, at the same
  moment as k's later steps (its checkpoint, the one after k - 1, is committed by then), so in the steady state an
  iteration takes ``max(gen_s, rest_s)``: ``predicted_disaggregated_speedup = (gen_s + rest_s) / max(gen_s,
  rest_s)``, at most 2, reached when the halves take equally long;
* assumed: each half runs as fast beside the other as alone (devices of their own, no shared host bottleneck); the
  weights' transfer to the engines costs what loading the checkpoint costs here (it is inside ``gen_s``); the loop's
  own seconds between the stages (``loop_s`` = the measured iteration in turn - ``gen_s`` - ``rest_s``: Prefect's
  task bookkeeping, the metrics writes) are left out, as small against the stages of a real model; the importance
  weight's cost is inside the training step. On a GPU the figures must be measured again (none was lent here).

The engine has one thread of its own (``rollout.engine.threads=1``) and the training worker one CPU
(``train.runtime.num_workers=1``): on two cores each half has a core. The engines never sleep in either run
(``sleep_level: 0``; an asynchronous run's engines have devices of their own and never do). The last line is
``RESULT ratio=.. sync_iter_s=.. async_iter_s=.. speedup=.. overlap_share=.. mean_staleness=.. gen_s=.. rest_s=..
loop_s=.. predicted_disaggregated_speedup=..``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GENERATION = ("rollout", "generate")  # the generation stage of an agentic / RLVR iteration
NOT_AN_ITERATION_STAGE = ("engine", "eval", "validation")  # engine sleep (none here), evaluations (none here)


def tiny_args(config: str, runs_dir: Path, name: str, max_steps: int, ratio: float, tiny: bool) -> list[str]:
    """``rollflow train`` of ``config`` with the tiny sizes of tests/trainflow (with ``tiny``) or as it is."""
    args = ["train", "--config", config, "--set", f"run_name={name}", "--set", f"runs_dir={runs_dir}",
            "--set", f"max_steps={max_steps}", "--set", f"async_generation_ratio={ratio}", "--set", "eval.eval_steps=0",
            "--set", "rollout.engine.threads=1", "--set", "rollout.engine.sleep_level=0",
            "--set", "train.runtime.num_workers=1", "--no-report"]
    if tiny:
        from stages.generation.model_store import tiny_random_model_dir

        args += ["--set", f"pretrain={tiny_random_model_dir()}", "--set", "rollout.engine.backend=hf",
                 "--set", "rollout.engine.options={}", "--set", "rollout.engine.dtype=float32",
                 "--set", "rollout.env.num_env_groups=2", "--set", "rollout.env.group_size=2",
                 "--set", "rollout_batch_size=4", "--set", "rollout.env.max_steps=3",
                 "--set", "rollout.generating_args.max_new_tokens=16",
                 "--set", "train.actor_train.model_args.dtype=fp32", "--set", "reward_normalization.method=identity",
                 "--set", "reward_normalization.grouping=batch"]
    return args


def run_times(run: Path) -> dict[str, float]:
    """Steady iteration seconds, overlap share and mean staleness of a finished run (module docstring)."""
    import pyarrow.dataset as pads

    rows = pads.dataset(str(run / "metrics")).to_table().to_pylist()
    ends = sorted(r["timestamp"].timestamp() for r in rows if r["stage"] == "train" and r["name"] == "time/train_s")
    if len(ends) < 2:
        sys.exit(f"error: {run} logged {len(ends)} training steps; run at least 2 iterations (--max-steps)")
    span = ends[-1] - ends[0]
    # the rollout of k + 1 plays during iteration k: those of iterations 2.. overlap the span after the first step
    overlap = sum(r["value"] for r in rows if r["name"] == "rollout/overlap_seconds" and r["iteration"] > 1)
    stale = [r["value"] for r in rows if r["name"] == "rollout/staleness" and r["iteration"] > 0]
    return {"iter_s": span / (len(ends) - 1), "overlap_share": overlap / span if span else 0.0,
            "mean_staleness": sum(stale) / len(stale) if stale else 0.0}


def stage_times(run: Path) -> dict[str, float]:
    """Generation and later-stage seconds per iteration of a finished run (``gen_s``, ``rest_s``): each stage's
    ``time/<stage>``, summed per iteration, the mean over the iterations after the first (module docstring)."""
    import pyarrow.dataset as pads

    gen: dict[int, float] = {}
    rest: dict[int, float] = {}
    for r in pads.dataset(str(run / "metrics")).to_table().to_pylist():
        if r["iteration"] == 0 or r["name"] != f"time/{r['stage']}" or r["stage"] in NOT_AN_ITERATION_STAGE:
            continue
        side = gen if r["stage"] in GENERATION else rest
        side[r["iteration"]] = side.get(r["iteration"], 0.0) + r["value"]
    if not gen or gen.keys() != rest.keys():
        sys.exit(f"error: {run}: generation logged at iterations {sorted(gen)}, the later stages at {sorted(rest)}; "
                 "run at least 2 iterations (--max-steps) to the end")
    return {"gen_s": sum(gen.values()) / len(gen), "rest_s": sum(rest.values()) / len(rest)}


def predicted_speedup(gen_s: float, rest_s: float) -> float:
    """Iteration in turn over iteration with the halves on devices of their own: (gen + rest) / max(gen, rest)."""
    return (gen_s + rest_s) / max(gen_s, rest_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/train_frozenlake_grpo.yaml", help="an agentic training config")
    parser.add_argument("--max-steps", type=int, default=4, help="iterations of each run (>= 2)")
    parser.add_argument("--ratio", type=float, default=1.0,
                        help="async_generation_ratio of the second run (> 0; 2: two rollouts in flight)")
    parser.add_argument("--as-is", action="store_true", help="the config's own sizes, not the tiny ones")
    parser.add_argument("--runs-dir", type=Path, help="where the two runs go (default: a temporary folder)")
    args = parser.parse_args()
    if args.ratio <= 0:
        parser.error(f"--ratio {args.ratio:g}: the second run plays ahead, so it must be > 0 (1: one iteration ahead)")
    runs = args.runs_dir or Path(tempfile.mkdtemp(prefix="bench-async-"))
    out = {}
    for label, ratio in (("sync", 0.0), ("async", args.ratio)):
        name = f"{label}-{int(time.time())}"
        cmd = [sys.executable, "-m", "flows.cli",
               *tiny_args(args.config, runs, name, args.max_steps, ratio, not args.as_is)]
        started = time.time()
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        out[label] = {**run_times(runs / name), **stage_times(runs / name)}
        print(f"{label:>5}: {out[label]['iter_s']:.1f} s per iteration (steady), run {time.time() - started:.0f} s, "
              f"{runs / name}", flush=True)
    sync, asy = out["sync"], out["async"]
    gen, rest = sync["gen_s"], sync["rest_s"]
    print(f"RESULT ratio={args.ratio:g} sync_iter_s={sync['iter_s']:.2f} async_iter_s={asy['iter_s']:.2f} "
          f"speedup={sync['iter_s'] / asy['iter_s']:.2f} overlap_share={asy['overlap_share']:.2f} "
          f"mean_staleness={asy['mean_staleness']:.2f} gen_s={gen:.2f} rest_s={rest:.2f} "
          f"loop_s={sync['iter_s'] - gen - rest:.2f} "
          f"predicted_disaggregated_speedup={predicted_speedup(gen, rest):.2f}")


if __name__ == "__main__":
    main()
