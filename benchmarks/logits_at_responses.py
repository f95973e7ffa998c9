"""The output layer at the response tokens only, against every position (issue 16: iteration speed), side by side in
one run: the log-prob pass and one training step of the real training core, with the code of this tree and with the
code of a base commit (``--base``, checked out into a temporary git worktree), each measurement in a fresh process.

Since this change the actor's logits are computed only where a loss token needs them (``TokenLogits``; the output
layer sees the loss tokens' hidden states only): a step sample of the FrozenLake configs is a ~400-token prompt and a ~10-token
reply, and the vocabulary projection (576 x 49,152 for the default model) and its log-softmax ran at every position.

Rows: the first ``--rows`` rows of ``--samples`` (a run's table; default: FrozenLake-shaped step samples from
``stages.example``, whose replies are longer than a trained model's), seeded random advantages; the default model
in fp32 on ``--threads`` threads. Per code version and variant (``full``: every weight trains; ``lora``: rank 8 on the
default targets), one log-prob pass (``forward_rows``, budget ``--budget``) and one training step (DeepSpeed engine,
world of one, one mini-batch of all rows, budget ``--budget``), each after a warm-up, the best of ``--repeats``.

    python benchmarks/logits_at_responses.py --base HEAD --rows 24

Last line: ``RESULT base_logprob_tok_per_s=... logprob_tok_per_s=... logprob_speedup=... base_train_tok_per_s=...
train_tok_per_s=... train_speedup=... lora_train_tok_per_s=... max_abs_diff=... grad_norm_rel_diff=...``
(``*_tok_per_s``: real tokens per second; the differences compare this tree's log-probs and first-step gradient norm
with the base's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(args) -> dict:
    """One process: the log-prob pass and a training step with the code under ``args.code``."""
    sys.path.insert(0, args.code)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import numpy as np
    import pyarrow as pa
    import pyarrow.dataset as pads
    import torch

    from schemas.config import validate_config
    from schemas.tables import FLOATS
    from schemas.train_config import TrainStepConfig
    from stages.example import ExampleSpec, generate
    from stages.generation.model_store import default_model_dir
    from stages.train.batching import TokenRows
    from stages.train.checkpoint import read_checkpoint
    from stages.train.distributed import init_distributed
    from stages.train.engine import Engine
    from stages.train.forward import forward_rows, load_forward_model
    from stages.train.lora import build_actor_model, lora_bases
    from stages.train.step import train_step

    torch.set_num_threads(args.threads)
    folder = args.samples
    if folder is None:
        folder = tempfile.mkdtemp(prefix="rollflow-bench-logits-") + "/samples"
        generate(ExampleSpec(samples=args.rows, seed=0, env="frozenlake", level="step"), folder)
    files = sorted(str(f) for f in Path(folder).glob("*.parquet"))
    table = pads.dataset(files, format="parquet").to_table(columns=["row_id", "input_ids", "response_mask"])
    table = table.slice(0, args.rows)
    model_dir = str(default_model_dir())
    rows = TokenRows.from_arrow(table, folder, columns=())
    out = {"tokens": int(rows.lengths.sum()), "response_tokens": int(rows.loss_tokens().sum())}

    model = load_forward_model(model_dir, "log_probs", "fp32")
    forward_rows(model, rows.take(np.arange(min(4, rows.num_rows))), args.budget)  # warm-up
    best = None
    for _ in range(args.repeats):
        start = time.perf_counter()
        result = forward_rows(model, rows, args.budget)
        best = min(best or 1e9, time.perf_counter() - start)
    out["logprob_s"] = best
    out["log_probs"] = result.columns["log_probs"].values.tolist()
    del model

    rng = np.random.default_rng(0)
    advantages = pa.array([rng.normal(size=n - 1).astype(np.float32).tolist() for n in rows.lengths], FLOATS)
    train_rows = TokenRows.from_arrow(table.append_column("advantages", advantages), folder)
    dist = init_distributed(threads=args.threads)
    model_args = {"dtype": "fp32", **({"lora_rank": 8} if args.variant == "lora" else {})}
    cfg = validate_config(TrainStepConfig, {"adv_estimator": "grpo", "compute_entropy_metric": False, "actor_train": {
        "model_args": model_args, "max_tokens_per_microbatch_in_train": args.budget,
        "training_args": {"learning_rate": 1e-6, "per_device_train_batch_size": rows.num_rows}}})
    seconds, norm = [], None
    info = read_checkpoint(model_dir)
    for _ in range(args.repeats + 1):  # the first step warms up; fresh engine each time, same initial weights
        model = build_actor_model(info, cfg.actor_train, lora_bases(info, cfg).get("actor"))
        engine = Engine(model, cfg.actor_train, dist, "actor")
        report = train_step(train_rows, engine, None, cfg, dist, step=0, pad_token_id=0)
        seconds.append(report.seconds)
        norm = report.metrics["actor/grad_norm"]
        del engine
    out["train_s"] = min(seconds[1:])
    out["grad_norm"] = norm
    return out


def run_one(code: Path, variant: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--code", str(code), "--variant", variant,
           "--rows", str(args.rows), "--budget", str(args.budget), "--threads", str(args.threads),
           "--repeats", str(args.repeats)] + (["--samples", str(Path(args.samples).resolve())] if args.samples else [])
    cache = os.environ.get("ROLLFLOW_CACHE") or str(REPO / ".cache")  # the worktree shares this tree's model folder
    done = subprocess.run(cmd, cwd=code, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(code), "ROLLFLOW_CACHE": cache})
    if done.returncode != 0:
        sys.exit(f"error: {variant} with the code of {code} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the commit to compare with (its code: every position)")
    parser.add_argument("--rows", type=int, default=24, help="rows (the first ones of --samples)")
    parser.add_argument("--samples", default=None, help="a samples table folder, e.g. a run's "
                        "iter_0000/advantaged (default: generated FrozenLake step rows)")
    parser.add_argument("--budget", type=int, default=3072)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--code", default=str(REPO), help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="full", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args)))
        return

    import numpy as np

    worktree = Path(tempfile.mkdtemp(prefix="rollflow-bench-base-")) / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), args.base], check=True,
                   capture_output=True)
    try:
        results = {"base full": run_one(worktree, "full", args), "this full": run_one(REPO, "full", args),
                   "this lora": run_one(REPO, "lora", args)}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=False)
    first = next(iter(results.values()))
    print(f"{args.rows} rows of {args.samples or 'generated FrozenLake step samples'}, {first['tokens']:,} tokens "
          f"({first['response_tokens']} loss tokens), default model fp32, {args.threads} threads, budget {args.budget}, base {args.base}")
    print(f"{'code / variant':<16} {'logprob_s':>9} {'tok/s':>7} {'train_s':>8} {'tok/s':>7} {'grad norm':>10}")
    for name, r in results.items():
        print(f"{name:<16} {r['logprob_s']:>9.2f} {r['tokens'] / r['logprob_s']:>7.0f} {r['train_s']:>8.2f} "
              f"{r['tokens'] / r['train_s']:>7.0f} {r['grad_norm']:>10.6f}")
    base, this, lora = results["base full"], results["this full"], results["this lora"]
    tok = base["tokens"]
    diff = float(np.abs(np.asarray(this["log_probs"]) - np.asarray(base["log_probs"])).max())
    print(f"RESULT base_logprob_tok_per_s={tok / base['logprob_s']:.0f} logprob_tok_per_s={tok / this['logprob_s']:.0f} "
          f"logprob_speedup={base['logprob_s'] / this['logprob_s']:.2f} "
          f"base_train_tok_per_s={tok / base['train_s']:.0f} train_tok_per_s={tok / this['train_s']:.0f} "
          f"train_speedup={base['train_s'] / this['train_s']:.2f} lora_train_tok_per_s={tok / lora['train_s']:.0f} "
          f"max_abs_diff={diff:.2e} grad_norm_rel_diff={abs(this['grad_norm'] / base['grad_norm'] - 1):.2e}")


if __name__ == "__main__":
    main()
