"""Randomised SIGKILL trials (issue 17): kill a rollflow command's whole process group (the CLI, its local Ray
cluster, Prefect's ephemeral server) at a random moment — once or twice in a row — then run it again to the end,
and compare every committed table with an uninterrupted run's.

Commands (each on small inputs it makes itself, nothing downloaded):

* ``score``: ``rollflow score --advantages`` on the shipped RLVR example set (reward workers, the RLVR chain);
* ``recompute``: ``rollflow recompute`` (GiGPO) on a generated step-level set;
* ``rollout``: ``rollflow rollout`` of FrozenLake on the tiny random model (HF engine), killed inside its turns;
* ``train``: ``rollflow train`` on the quickstart config (the default model, vLLM, DeepSpeed; 2 iterations), killed
  anywhere — rollout, log-probs, training, checkpoint writing, evaluation — and resumed with ``--resume``; the tables
  of both iterations, the evaluations and the final checkpoint's weights are compared.

Kill delays are drawn uniformly over the uninterrupted run's wall time (seeded). A trial passes when the rerun exits
0 and every table the reference committed is committed again with the same rows (by row_id) and equal values (floats
within 1e-5). ``make test`` keeps one train trial on the tiny model (tests/trainflow: a SIGKILL after a weights-only
checkpoint); the quickstart trials are here.

    python benchmarks/kill_trials.py --command score --trials 4 --seed 0

Last line: ``RESULT command=... trials=N identical=K double_kills=D``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rollflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


def prepare(command: str, root: Path) -> tuple[list[str], list[str]]:
    """(the command's arguments without --output, the table folders it commits under its output)."""
    if command == "score":
        responses = root / "responses"
        subprocess.run(rollflow("rlvr-example", "--output", str(responses), "--limit", "3"), check=True, cwd=REPO,
                       capture_output=True)
        return (["score", "--input", str(responses), "--config", "configs/rlvr_mixed.yaml", "--advantages"],
                ["scored", "samples", "rewarded", "advantaged"])
    if command == "recompute":
        samples = root / "samples"
        subprocess.run(rollflow("example", "--output", str(samples), "--samples", "4000", "--seed", "1"), check=True,
                       cwd=REPO, capture_output=True)
        return (["recompute", "--input", str(samples), "--config", "configs/recompute_gigpo.yaml", "--set",
                 "runtime.batch_rows=200"], ["rewarded", "advantaged"])
    if command == "rollout":
        from stages.generation.model_store import tiny_random_model_dir

        sets = ["engine.backend=hf", "engine.options={}", "engine.dtype=float32", "env.num_env_groups=2",
                "env.group_size=2", "env.max_steps=3", "generating_args.max_new_tokens=8"]
        args = ["rollout", "--config", "configs/rollout_frozenlake.yaml", "--checkpoint", str(tiny_random_model_dir())]
        for item in sets:
            args += ["--set", item]
        return args, ["episodes", "samples"]
    if command == "train":
        per_iteration = ["rollout/samples", "logprobs", "rewarded", "advantaged", "eval/samples"]
        return (["train", "--config", "configs/train_frozenlake_quickstart.yaml", "--no-report"],
                [f"{RUN}/{t}" for t in ["eval_base/samples"] + [f"iter_{k:04d}/{t}" for k in (0, 1)
                                                                for t in per_iteration]])
    raise SystemExit(f"unknown command {command}")


RUN = "quickstart"  # every trial's run has the same name (it is part of every row id), in its own runs_dir


def command_line(args: list[str], output: Path) -> list[str]:
    """The command writing into ``output``: a training run is ``output/quickstart`` (``runs_dir`` = ``output``; a
    second call resumes it: the same config is the same run), other commands take ``--output``."""
    if args[0] == "train":
        return rollflow(*args, "--set", f"runs_dir={output}", "--set", f"run_name={RUN}")
    return rollflow(*args, "--output", str(output))


def same_weights(a: Path, b: Path) -> bool:
    """The safetensors weights of two checkpoint folders are equal, bit for bit."""
    import torch

    from stages.train.core import load_weights

    x, y = load_weights(str(a)), load_weights(str(b))
    return bool(x) and x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def run(args: list[str], output: Path, env: dict, kill_after: float | None) -> tuple[int, float]:
    """Run ``rollflow ARGS --output OUTPUT``; with ``kill_after`` SIGKILL its process group after that many seconds
    (if it is still running). Returns (exit status, seconds)."""
    start = time.monotonic()
    with open(output.parent / f"{output.name}.log", "a") as log:
        proc = subprocess.Popen(command_line(args, output), cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the group (Ray, Prefect) gone before the next attempt
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
    return proc.returncode, time.monotonic() - start


def read(folder: Path):
    import pyarrow.dataset as pads

    table = pads.dataset(sorted(str(p) for p in folder.glob("*.parquet")), format="parquet").to_table()
    key = "row_id" if "row_id" in table.column_names else table.column_names[0]
    return table.sort_by(key)


def same(a, b) -> bool:
    if a.num_rows != b.num_rows or a.column_names != b.column_names:
        return False
    for name in a.column_names:
        x, y = a.column(name).to_pylist(), b.column(name).to_pylist()
        if x == y:
            continue
        try:
            fx = np.concatenate([np.ravel(np.asarray(v, dtype=float)) for v in x])
            fy = np.concatenate([np.ravel(np.asarray(v, dtype=float)) for v in y])
        except (TypeError, ValueError):
            return False
        if fx.shape != fy.shape or not np.allclose(fx, fy, rtol=1e-5, atol=1e-5, equal_nan=True):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--command", default="score", choices=["score", "recompute", "rollout", "train"])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix=f"rollflow-kill-{args.command}-"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
    env.update({"PREFECT_HOME": str(root / "prefect"), "RAY_USAGE_STATS_ENABLED": "0", "PYTHONHASHSEED": "0"})
    command, tables = prepare(args.command, root)
    rc, wall = run(command, root / "reference", env, None)
    if rc != 0:
        raise SystemExit(f"the uninterrupted run failed (rc {rc}); see {root / 'reference.log'}")
    reference = {t: read(root / "reference" / t) for t in tables}
    print(f"{args.command}: uninterrupted run {wall:.0f} s; tables {', '.join(tables)}; work in {root}")
    print(f"{'trial':>5} {'kills at (s)':>16} {'rerun rc':>9} {'identical':>10}")
    identical = doubles = 0
    for trial in range(args.trials):
        out = root / f"trial{trial}"
        kills = [rng.uniform(0, wall)]
        if rng.random() < 0.5:  # two kills in a row: the rerun itself is killed once more
            kills.append(rng.uniform(0, wall))
            doubles += 1
        for delay in kills:
            run(command, out, env, delay)
        rc, _ = run(command, out, env, None)
        ok = rc == 0 and all((out / t / "manifest.json").exists() and same(read(out / t), reference[t])
                             for t in tables)
        if args.command == "train":  # and the trained policy: the last checkpoint's weights, bit for bit
            last = f"{RUN}/iter_0001/checkpoint"
            ok = ok and same_weights(out / last, root / "reference" / last)
        identical += ok
        print(f"{trial:>5} {' + '.join(f'{k:.1f}' for k in kills):>16} {rc:>9} {str(ok):>10}")
    print(f"RESULT command={args.command} trials={args.trials} identical={identical} double_kills={doubles}")


if __name__ == "__main__":
    main()
