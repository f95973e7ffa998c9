"""Reward-worker throughput (responses scored per second) and the code sandbox's per-sample overhead.

    .venv/bin/python benchmarks/rewards.py [--scale 1.0] [--processes 2]

Rule workers are measured on ``--processes`` worker processes (default 2: the 2-core target machine), each scoring
its share of the batch with its own worker; the rate is total responses / wall time of the slowest process,
measured after a warm-up. The code sandbox worker runs its sandboxes with ``concurrency=2``. The sandbox overhead is
the wall time of a sandboxed ``pass`` minus that of a plain ``python -I -S -c pass``. Inputs are built from the
shipped data sets (data/rlvr/). The last line is machine-readable:

    RESULT math_rule_per_s=... mcq_per_s=... ifeval_per_s=... code_sandbox_per_s=... sandbox_overhead_ms=...
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT / "data" / "rlvr"


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines() if line.strip()]


def math_batch(n: int) -> dict[str, list]:
    """Mixed responses: boxed right/wrong answers, answers without a box, malformed think tags, fractions."""
    rng = random.Random(0)
    rows = load("math")
    responses, golds = [], []
    for i in range(n):
        row = rows[i % len(rows)]
        gold = row["ground_truth"]
        kind = rng.random()
        if kind < 0.4:
            text = f"<think>Let me compute step by step.</think>\nThe result is \\boxed{{{gold}}}."
        elif kind < 0.7:
            text = f"<think>Quick estimate.</think>\nSo the answer is \\boxed{{{rng.randint(-50, 5000)}}}."
        elif kind < 0.85:
            text = f"First I add.\n\nThen I check.\n\nThe answer is {gold}"
        elif kind < 0.95:
            text = "<think>I am still thinking about \\boxed{3}"
        else:
            text = f"\\boxed{{\\frac{{{rng.randint(1, 9)}}}{{{rng.randint(2, 9)}}}}}"
        responses.append(text)
        golds.append(gold)
    return {"response": responses, "ground_truth": golds}


def mcq_batch(n: int) -> dict[str, list]:
    rng = random.Random(1)
    rows = load("mcq")
    picks = [rows[i % len(rows)] for i in range(n)]
    responses = [f"<think>Option {rng.choice('ABCD')} looks plausible.</think>\nFinal: \\boxed{{{rng.choice('ABCD')}}}"
                 for _ in picks]
    return {"response": responses, "ground_truth": [r["ground_truth"] for r in picks]}


def ifeval_batch(n: int) -> dict[str, list]:
    rows = load("ifeval")
    picks = [rows[i % len(rows)] for i in range(n)]
    responses = [r["compliant_response"] if i % 2 else r["violating_response"] for i, r in enumerate(picks)]
    return {"response": responses, "ground_truth": [r["ground_truth"] for r in picks]}


def code_batch(n: int) -> dict[str, list]:
    rows = load("code")
    picks = [rows[i % len(rows)] for i in range(n)]
    solution = lambda i, r: r["reference_solution"] if i % 2 == 0 else r["wrong_solution"]  # noqa: E731
    return {"response": [f"```python\n{solution(i, r)}```" for i, r in enumerate(picks)],
            "ground_truth": [r["ground_truth"] for r in picks]}


def _score_share(args: tuple[str, dict, dict]) -> float:
    """In a worker process: build the worker, warm up, score the share; returns the scoring seconds."""
    import stages.rewards  # noqa: F401
    from stages.rewards.registry import build_worker

    name, kwargs, rows = args
    worker = build_worker(name, kwargs)
    warm = {k: v[:20] for k, v in rows.items()}
    worker.score_batch(warm)
    start = time.perf_counter()
    worker.score_batch(rows)
    return time.perf_counter() - start


def rule_rate(name: str, rows: dict[str, list], processes: int, kwargs: dict | None = None) -> float:
    n = len(next(iter(rows.values())))
    shares = [{k: v[p::processes] for k, v in rows.items()} for p in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        seconds = pool.map(_score_share, [(name, kwargs or {}, share) for share in shares])
    return n / max(seconds)


def code_rate(n: int) -> float:
    import stages.rewards  # noqa: F401
    from stages.rewards.registry import build_worker

    worker = build_worker("code_sandbox", {"concurrency": 2})
    rows = code_batch(n)
    worker.score_batch({k: v[:2] for k, v in rows.items()})  # probe + warm-up
    start = time.perf_counter()
    worker.score_batch(rows)
    return n / (time.perf_counter() - start)


def sandbox_overhead_ms(runs: int) -> tuple[float, float, str]:
    from stages.rewards.sandbox import default_sandbox

    sandbox = default_sandbox()
    info = sandbox.info()
    sandbox.run_python("pass")
    start = time.perf_counter()
    for _ in range(runs):
        assert sandbox.run_python("pass").ok
    sandboxed = (time.perf_counter() - start) / runs * 1000
    start = time.perf_counter()
    for _ in range(runs):
        subprocess.run([info.python, "-I", "-S", "-c", "pass"], check=True, env={})
    plain = (time.perf_counter() - start) / runs * 1000
    return sandboxed, plain, info.mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the batch sizes")
    parser.add_argument("--processes", type=int, default=2, help="worker processes for the rule workers")
    args = parser.parse_args()
    size = lambda n: max(10, int(n * args.scale))  # noqa: E731
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {os.cpu_count()} cpus, load average {load}, python {sys.version.split()[0]}, "
          f"{args.processes} processes")
    rates = {
        "math_rule": rule_rate("math_rule", math_batch(size(8000)), args.processes),
        "mcq": rule_rate("multiple_choice_boxed", mcq_batch(size(40000)), args.processes),
        "ifeval": rule_rate("ifeval", ifeval_batch(size(20000)), args.processes),
    }
    rates["code_sandbox"] = code_rate(size(40))
    sandboxed, plain, mode = sandbox_overhead_ms(size(30))
    print(f"{'worker':<16}{'responses/s':>14}")
    for name, rate in rates.items():
        print(f"{name:<16}{rate:>14.1f}")
    print(f"sandbox ({mode}): {sandboxed:.1f} ms per trivial run, plain python {plain:.1f} ms, "
          f"overhead {sandboxed - plain:.1f} ms")
    print(f"RESULT math_rule_per_s={rates['math_rule']:.0f} mcq_per_s={rates['mcq']:.0f} "
          f"ifeval_per_s={rates['ifeval']:.0f} code_sandbox_per_s={rates['code_sandbox']:.2f} "
          f"sandbox_overhead_ms={sandboxed - plain:.1f}")


if __name__ == "__main__":
    main()
