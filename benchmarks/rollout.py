"""Benchmark of the rollout (issue 3): 64 FrozenLake episodes with the default model through vLLM on CPU.

1. Wall time of the whole rollout split by stage: engine build, reset, turns (generate / environment step / stage
   overhead), samples. The engine pool is built first and timed on its own.
2. Generation throughput through the turn stage against the same engine called directly with the same prompts in
   the same run. After the rollout, each turn is replayed both ways from its committed input table: the turn stage
   (Ray Data → engine actor → env step → Parquet, committed into a scratch folder) and a direct call of the same
   actor with the same requests (same prompts, same seeds). Both replays see the same warm prefix cache; the order
   alternates from turn to turn so that drifting machine load hits both. tokens/s = response tokens / wall seconds.

Usage: python benchmarks/rollout.py [--config configs/rollout_frozenlake.yaml] [--set key=value ...]
       [--compare-turns N] [--output DIR]
Last line: RESULT stage_tok_per_s=… direct_tok_per_s=… ratio=… episodes=64 wall_s=… generate_s=… env_s=… samples_s=…
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _turn_requests(section, previous_dir: str):
    """The requests the turn stage sent for the active rows of ``previous_dir``, in stage order."""
    import pyarrow.compute as pc

    from stages.rollout.episode import turn_request
    from stages.rollout.stages import read_table
    from stages.storage import Location

    rows = read_table(Location.of(previous_dir), where=pc.field("done") == False).to_pylist()  # noqa: E712
    return [turn_request(section, row) for row in rows]


def _replay_stage(section, pool, turn: int, previous: str, active: int, scratch: Path) -> tuple[float, int, float]:
    from stages.rollout.stages import TurnStage
    from stages.runner import run_stage

    out = scratch / f"turn_{turn:03d}"
    start = time.time()
    result = run_stage(TurnStage(turn, pool, active), section, {"previous": previous}, str(out), force=True,
                       state_in={"replay": turn})
    return (time.time() - start, int(result.metrics.get("response_tokens", 0)),
            float(result.metrics.get("generate_seconds", 0.0)))


def _replay_direct(pool, requests) -> tuple[float, int, float]:
    start = time.time()
    results, engine_seconds = pool.generate(requests)
    return time.time() - start, sum(len(r.response_token_ids) for r in results), engine_seconds


def main() -> None:
    from flows import settings

    settings.configure()
    from schemas.config import load_config, parse_overrides
    from schemas.rollout_config import RolloutConfig, turn_section
    from stages.cluster import ensure_ray
    from stages.generation.engines import GenRequest, SamplingSpec
    from stages.rollout.driver import resolve_model_dir, run_rollout
    from stages.rollout.engine_pool import EnginePool

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs/rollout_frozenlake.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--compare-turns", type=int, default=None, help="Replay only the first N turns.")
    parser.add_argument("--output", default=None, help="Rollout folder (default: a temporary one, removed).")
    args = parser.parse_args()

    config = load_config(RolloutConfig, args.config, parse_overrides(args.overrides))
    section = turn_section(config)
    work = Path(args.output) if args.output else Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    out = work / "rollout"
    if out.exists():
        shutil.rmtree(out)
    model_dir = resolve_model_dir(None)
    start = time.time()
    ensure_ray(config.runtime.ray_address, config.runtime.num_cpus, progress=False)
    ray_s = time.time() - start

    pool = EnginePool(config.engine, model_dir, section.engine.max_model_len)
    try:
        start = time.time()
        pool.handles()
        build_s = time.time() - start
        warm = GenRequest([1, 2, 3, 4], SamplingSpec(max_new_tokens=8, seed=0))
        start = time.time()
        pool.generate([warm] * 4)
        warmup_s = time.time() - start

        result = run_rollout(config, str(out), None, pool=pool)
        t = result.timings
        turn_s = t["turn_seconds"]
        overhead_s = turn_s - t["generate_seconds"] - t["env_seconds"]
        wall_s = build_s + result.seconds

        # generation throughput: the stage vs the same engine called directly, same requests, per turn
        compare = len(result.turns) if args.compare_turns is None else min(args.compare_turns, len(result.turns))
        scratch = work / "replay"
        previous = [result.episodes] + result.turns
        stage_s = stage_tok = direct_s = direct_tok = 0.0
        rows = []
        for turn in range(compare):
            prev = previous[turn]
            requests = _turn_requests(section, prev.output)
            active = len(requests)
            order = ("direct", "stage") if turn % 2 == 0 else ("stage", "direct")
            got = {}
            for how in order:
                got[how] = (_replay_direct(pool, requests) if how == "direct"
                            else _replay_stage(section, pool, turn, prev.output, active, scratch))
            stage_s += got["stage"][0]  # wall seconds, tokens, engine seconds
            stage_tok += got["stage"][1]
            direct_s += got["direct"][0]
            direct_tok += got["direct"][1]
            rows.append((turn, active, got["stage"], got["direct"]))
    finally:
        pool.close()

    m = result.metrics
    print(f"\nrollout of {config.num_episodes} {'+'.join(config.env.tag_list)} episodes ({config.engine.backend}, "
          f"{config.generating_args.max_new_tokens} max new tokens, up to {config.env.max_steps} turns) in {out}")
    print(f"  ray start {ray_s:.1f}s, engine build {build_s:.1f}s, engine warm-up {warmup_s:.1f}s")
    print(f"  {'stage':<24}{'seconds':>10}")
    for name, seconds in (("engine build", build_s), ("reset (episodes)", t["reset_seconds"]),
                          ("turns: generate", t["generate_seconds"]), ("turns: environment", t["env_seconds"]),
                          ("turns: stage overhead", overhead_s), ("samples", t["samples_seconds"]),
                          ("total", wall_s)):
        print(f"  {name:<24}{seconds:>10.1f}")
    print(f"  turns played {int(m['rollout/turns'])}, response tokens {int(m['rollout/response_tokens'])}, "
          f"success {m['rollout/success_rate']:.3f}, valid actions {m['rollout/valid_action_rate']:.3f}, "
          f"mean episode length {m['rollout/mean_episode_length']:.2f}")
    print(f"\n  replay per turn: {'turn':>4} {'episodes':>9} {'stage s':>9} {'(engine s)':>11} {'stage tok':>10} "
          f"{'direct s':>9} {'(engine s)':>11} {'direct tok':>10}")
    for turn, active, (ss, st, se), (ds, dt, de) in rows:
        print(f"  {'':<17}{turn:>4} {active:>9} {ss:>9.2f} {se:>11.2f} {st:>10} {ds:>9.2f} {de:>11.2f} {dt:>10}")
    print("  (engine s: time inside the engine's generate call; stage s - engine s is the stage's own cost)")
    stage_rate = stage_tok / stage_s if stage_s else 0.0
    direct_rate = direct_tok / direct_s if direct_s else 0.0
    ratio = stage_rate / direct_rate if direct_rate else 0.0
    if not args.output:
        shutil.rmtree(work, ignore_errors=True)
    print(f"RESULT stage_tok_per_s={stage_rate:.1f} direct_tok_per_s={direct_rate:.1f} ratio={ratio:.3f} "
          f"episodes={config.num_episodes} wall_s={wall_s:.1f} generate_s={t['generate_seconds']:.1f} "
          f"env_s={t['env_seconds']:.2f} samples_s={t['samples_seconds']:.2f}")


if __name__ == "__main__":
    main()
