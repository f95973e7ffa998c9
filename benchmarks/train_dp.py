"""Data-parallel training: one training step on 2 training workers against 1 worker, on the same global batch, in
the same run (issue 14, item 5).

Both runs train one optimizer step (one mini-batch of every row) from the same model through the train-step stage
(Ray actors + DeepSpeed, gloo on CPU), each with its own one-step worker group; the CPUs are the same in both:
``--threads`` torch threads for the one worker, ``--threads / 2`` for each of the two. Throughput is real tokens over
the training loop's time inside the workers (``train_seconds``: first micro-batch to the optimizer step; the slowest
rank's for two); end-to-end adds the workers' start, model loading and the checkpoint write. The weights the two
runs save are compared: data parallelism must not change the step (tests/train/test_done_when.py).

    python benchmarks/train_dp.py --model default --rows 8 --min-len 64 --max-len 128 --budget 512

Prints a table, then the last line ``RESULT one_worker_tok_per_s=... two_worker_tok_per_s=... ratio=...
max_abs_weight_diff=... largest_update=...``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from _common import make_parser, make_table, model_folder, set_up_process
from train import add_old_log_probs


def step_config(args, workers: int):
    from schemas.config import validate_config
    from schemas.train_config import TrainStepConfig

    per_rank = -(-args.rows // workers)  # one mini-batch of every row, whatever the number of workers
    return validate_config(TrainStepConfig, {
        "adv_estimator": "grpo", "compute_entropy_metric": False, "loss_agg_mode": args.loss_agg_mode,
        "actor_train": {"model_args": {"dtype": args.dtype},
                        "training_args": {"learning_rate": 1e-5, "per_device_train_batch_size": per_rank},
                        "strategy_args": {"zero_stage": args.zero_stage},
                        "max_tokens_per_microbatch_in_train": args.budget},
        "runtime": {"num_workers": workers, "cpus_per_worker": args.threads / workers,
                    "threads": max(1, args.threads // workers), "num_cpus": max(2, args.threads)}})


def run(samples: Path, model_dir: str, args, workers: int, out: Path) -> dict:
    from stages.train.stage import run_train_step

    start = time.perf_counter()
    result = run_train_step(str(samples), model_dir, step_config(args, workers), str(out))
    state = json.loads((out / "train_state.json").read_text())
    return {"tokens": state["tokens"], "seconds": state["train_seconds"], "e2e": time.perf_counter() - start,
            "rss": result.metrics.get("system/peak_rss_mb", float("nan")), "world": state["world_size"]}


def largest_difference(a: Path, b: Path) -> float:
    from stages.train.checkpoint import load_weights

    wa, wb = load_weights(str(a)), load_weights(str(b))
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def main() -> None:
    parser = make_parser(__doc__, rows=8, max_len=128, budget=512, budget_field="max_tokens_per_microbatch_in_train",
                         threads_of="all workers together (the one worker gets all, each of two half)")
    parser.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--loss-agg-mode", default="seq-mean-token-mean",
                        choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
    args = parser.parse_args()
    if args.threads < 2:
        parser.error("--threads must be >= 2: the two workers get half each")

    set_up_process()
    from stages.cluster import ensure_ray

    model_dir = model_folder(args.model)
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-train-dp-"))
    table = add_old_log_probs(make_table(args.rows, (args.min_len, args.max_len), seed=0), model_dir, args.threads)
    (work / "adv").mkdir()
    pq.write_table(table, work / "adv" / "part-00000.parquet")
    ensure_ray(None, max(2, args.threads), progress=False)  # outside the timing, as a run does

    try:
        one = run(work / "adv", model_dir, args, 1, work / "one")
        two = run(work / "adv", model_dir, args, 2, work / "two")
        assert one["tokens"] == two["tokens"] and two["world"] == 2, (one, two)
        diff = largest_difference(work / "one", work / "two")
        update = largest_difference(Path(model_dir), work / "one")
    finally:  # two checkpoints with their DeepSpeed state: about 5 GB for the default model
        shutil.rmtree(work, ignore_errors=True)

    print(f"model {args.model} ({args.dtype}, ZeRO-{args.zero_stage}, {args.loss_agg_mode}), {args.rows} rows x "
          f"{args.min_len}-{args.max_len} tokens ({one['tokens']} tokens), budget {args.budget} tokens, "
          f"{args.threads} threads in all")
    print(f"{'':<12}{'tokens/s':>10}{'loop s':>9}{'end-to-end s':>14}{'peak RSS MB/rank':>18}")
    for label, r in (("1 worker", one), ("2 workers", two)):
        print(f"{label:<12}{r['tokens'] / r['seconds']:>10.1f}{r['seconds']:>9.2f}{r['e2e']:>14.1f}{r['rss']:>18.0f}")
    one_tps, two_tps = one["tokens"] / one["seconds"], two["tokens"] / two["seconds"]
    print(f"RESULT one_worker_tok_per_s={one_tps:.1f} two_worker_tok_per_s={two_tps:.1f} ratio={two_tps / one_tps:.3f} "
          f"max_abs_weight_diff={diff:.3g} largest_update={update:.3g}")


if __name__ == "__main__":
    main()
