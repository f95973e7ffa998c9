"""Training throughput: the train-step stage (the training workers + the training core) against a bare DeepSpeed
loop on the same batches, in the same run.

The bare loop is what a hand-written trainer does: the same DeepSpeed config and model, the same micro-batches
(the stage's own plan for one rank), a clipped PPO surrogate written inline (log-softmax gather, ratio, clip,
token mean), backward, step. The stage's training-loop time is measured inside its workers (``time/train_s``: from
the first micro-batch to the last optimizer step, metrics included); its end-to-end time adds the workers' start,
model loading and the checkpoint write, fixed costs that do not grow with the batch.

    python benchmarks/train.py --rows 16 --min-len 96 --max-len 192 --epochs 1 --model default

Prints a table, then the last line ``RESULT stage_tok_per_s=... bare_tok_per_s=... ratio=... peak_rss_mb=...``.
"""

from __future__ import annotations

import gc
import json
import resource
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from _common import Run, make_parser, make_table, model_folder, print_results, set_up_process
from schemas.tables import FLOATS


def add_old_log_probs(table: pa.Table, model_dir: str, threads: int) -> pa.Table:
    import torch

    from stages.train.batching import TokenRows
    from stages.train.forward import forward_rows, load_forward_model

    torch.set_num_threads(threads)
    model = load_forward_model(model_dir, "log_probs")
    lp = forward_rows(model, TokenRows.from_arrow(table, "bench", columns=()), 4096).columns["log_probs"]
    return table.append_column(pa.field("old_log_probs", FLOATS), lp.to_arrow(pa.float32()))


def bare_loop(table: pa.Table, model_dir: str, cfg, threads: int) -> tuple[int, float, float]:
    """The same micro-batches through plain DeepSpeed with an inline PPO loss; returns (tokens, wall seconds, CPU
    seconds of this process)."""
    import torch

    from stages.train.batching import batching_policy, pad_micro_batch, plan_step
    from stages.train.distributed import import_deepspeed, init_distributed
    from stages.train.engine_config import deepspeed_config
    from stages.train.models import load_actor_model
    from stages.train.train_table import rows_of_table

    deepspeed = import_deepspeed()
    dist = init_distributed(threads)
    model = load_actor_model(model_dir)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=deepspeed_config(cfg.actor_train, on_gpu=torch.cuda.is_available()))
    rows = rows_of_table(table, "bench")
    plans = plan_step(rows.lengths, rows.loss_tokens(), policy=batching_policy(cfg.actor_train), world_size=1,
                      rank=0, ppo_epochs=cfg.ppo_epochs, seed=cfg.actor_train.training_args.seed, step=0)
    tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for plan in plans:
        for k, index in enumerate(plan.micro_batches):
            mb = pad_micro_batch(rows, index).to(dist.device)
            logits = engine(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
            lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
            mask = mb.loss_mask.float()
            ratio = torch.exp(lp - mb.next_token["old_log_probs"])
            adv = mb.next_token["advantages"]
            loss = -(torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / plan.num_tokens
            engine.set_gradient_accumulation_boundary(k == len(plan.micro_batches) - 1)
            engine.backward(loss)
            tokens += mb.real_tokens
        engine.step()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    del engine, model
    gc.collect()
    return tokens, seconds, cpu_seconds


def main() -> None:
    parser = make_parser(__doc__, rows=16, max_len=192, budget=1024, budget_field="max_tokens_per_microbatch_in_train",
                         threads_of="the bare loop and the worker")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    set_up_process()
    from schemas.config import validate_config
    from schemas.train_config import TrainStepConfig

    model_dir = model_folder(args.model)
    cfg = validate_config(TrainStepConfig, {
        "adv_estimator": "grpo", "ppo_epochs": args.epochs, "compute_entropy_metric": True,
        "actor_train": {"model_args": {"dtype": args.dtype},
                        "training_args": {"learning_rate": 1e-6, "per_device_train_batch_size": args.rows},
                        "max_tokens_per_microbatch_in_train": args.budget},
        "runtime": {"num_workers": 1, "cpus_per_worker": args.threads, "num_cpus": max(2, args.threads)}})
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-train-"))
    table = add_old_log_probs(make_table(args.rows, (args.min_len, args.max_len), seed=0), model_dir, args.threads)
    (work / "adv").mkdir()
    pq.write_table(table, work / "adv" / "part-00000.parquet")

    bare = Run("bare DeepSpeed loop", *bare_loop(table, model_dir, cfg, args.threads),
               resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    from stages.cluster import ensure_ray
    from stages.train.stage import run_train_step

    ensure_ray(cfg.runtime.ray_address, cfg.runtime.num_cpus, progress=False)  # outside the timing, as a run does
    start = time.perf_counter()
    result = run_train_step(str(work / "adv"), model_dir, cfg, str(work / "ckpt"))
    e2e = time.perf_counter() - start
    state = json.loads((work / "ckpt" / "train_state.json").read_text())
    stage = Run("stage: training loop", state["tokens"], state["train_seconds"], state["train_cpu_seconds"],
                result.metrics.get("system/peak_rss_mb", float("nan")))
    print_results(f"model {args.model} ({args.dtype}), {args.rows} rows x {args.min_len}-{args.max_len} tokens, "
                  f"{args.epochs} epoch(s), budget {args.budget} tokens, {args.threads} threads", bare, stage, e2e,
                  "workers' start, model load, checkpoint write")


if __name__ == "__main__":
    main()
