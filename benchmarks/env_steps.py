"""Environment steps per second for FrozenLake and Sokoban alone (target: >= 10k steps/s each).

Two modes: ``live`` steps one env object; ``stateless`` does what the dataflow does per turn — restore the env from
the previous row's state string, step, serialise the new state. Actions are random valid texts
(``<answer>Up</answer>`` ...) with a few invalid ones mixed in; episodes reset on termination or after ``max_steps``
(reset time is included). The table shows wall-clock and process-CPU rates (the CPU rate is what a busy machine
cannot distort); the last line, machine-readable, reports the wall-clock rates:

    RESULT frozenlake_steps_per_s=... sokoban_steps_per_s=... frozenlake_stateless_steps_per_s=...
           sokoban_stateless_steps_per_s=...

Usage: ``python benchmarks/env_steps.py [--steps N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.envs import make_env, restore_env  # noqa: E402

ACTION_TEXTS = ["<answer>Up</answer>", "<answer>Down</answer>", "<answer>Left</answer>", "<answer>Right</answer>",
                "<think>go</think><answer> left </answer><|im_end|>", "<answer>RIGHT</answer>"]
INVALID_TEXTS = ["<answer>fly</answer>", "I will go up"]


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(INVALID_TEXTS) if rng.random() < 0.05 else rng.choice(ACTION_TEXTS) for _ in range(n)]


def run(name: str, steps: int, seed: int, stateless: bool = False) -> tuple[float, float]:
    """``(wall, cpu)`` steps/s of one env (resets included); ``stateless``: every step restores the env from the
    previous step's state string and serialises it again, as the dataflow does per turn."""
    env = make_env(name)
    texts = _texts(steps, seed)
    episode = seed
    env.reset(episode)
    state = env.get_state() if stateless else None
    taken = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for text in texts:
        if stateless:
            env = restore_env(state)
        _, _, terminated, truncated, _ = env.step(text)
        taken += 1
        if terminated or truncated or taken >= env.max_steps:
            episode += 1
            env.reset(episode)
            taken = 0
        if stateless:
            state = env.get_state()
    return steps / (time.perf_counter() - start), steps / max(time.process_time() - cpu_start, 1e-9)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50_000, help="env steps per measurement")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = {
        "frozenlake_steps_per_s": run("FrozenLake", args.steps, args.seed),
        "sokoban_steps_per_s": run("SimpleSokoban", args.steps, args.seed),
        "frozenlake_stateless_steps_per_s": run("FrozenLake", args.steps, args.seed, stateless=True),
        "sokoban_stateless_steps_per_s": run("SimpleSokoban", args.steps, args.seed, stateless=True),
    }
    print(f"{'measurement':<36}{'steps/s (wall)':>16}{'steps/s (cpu)':>16}")
    for key, (wall, cpu) in results.items():
        print(f"{key:<36}{wall:>16,.0f}{cpu:>16,.0f}")
    print("RESULT " + " ".join(f"{k}={wall:.0f}" for k, (wall, _) in results.items()))


if __name__ == "__main__":
    main()
