"""Training throughput: the train-step stage (Ray Train + the training core) against a bare DeepSpeed loop on the
same batches, in the same run.

The bare loop is what a hand-written trainer does: the same DeepSpeed config and model, the same micro-batches
(the stage's own plan for one rank), a clipped PPO surrogate written inline (log-softmax gather, ratio, clip,
token mean), backward, step. The stage's training-loop time is measured inside its workers (``time/train_s``: from
the first micro-batch to the last optimizer step, metrics included); its end-to-end time adds Ray Train's start,
model loading and the checkpoint write, fixed costs that do not grow with the batch.

    python benchmarks/train.py --rows 16 --min-len 96 --max-len 192 --epochs 1 --model default

Prints a table, then the last line ``RESULT stage_tok_per_s=... bare_tok_per_s=... ratio=... peak_rss_mb=...``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.tables import ADVANTAGED, FLOATS  # noqa: E402


def make_table(rows: int, lengths: tuple[int, int], seed: int, vocab: int = 49152) -> pa.Table:
    """Advantaged rows of random tokens: a prompt then a response, one advantage (+-1) per row."""
    rng = np.random.default_rng(seed)
    data: dict[str, list] = {k: [] for k in ADVANTAGED.required}
    for i in range(rows):
        n = int(rng.integers(lengths[0], lengths[1] + 1))
        prompt = max(2, n // 4)
        mask = np.r_[np.zeros(prompt, np.int8), np.ones(n - prompt, np.int8)]
        adv = float(rng.choice([-1.0, 1.0]))
        loss_mask = mask[1:].astype(np.float32)
        values = {"row_id": f"r{i:05d}", "group_id": f"g{i // 8}", "traj_id": f"t{i}", "turn_idx": 0,
                  "num_turns": 1, "tag": "bench", "input_ids": rng.integers(0, vocab, n).astype(np.int32),
                  "response_mask": mask, "score": float(adv > 0), "episode_score": float(adv > 0),
                  "response_level_rewards": float(adv > 0), "token_level_rewards": loss_mask * 0,
                  "advantages": loss_mask * adv, "returns": loss_mask * float(adv > 0),
                  "raw_advantages": loss_mask * adv}
        for k, v in values.items():
            data[k].append(v)
    return pa.table({k: pa.array(v, type=ADVANTAGED.required[k]) for k, v in data.items()})


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

    from stages.train.batching import pad_micro_batch, plan_step
    from stages.train.core import (batching_policy, deepspeed_config, init_distributed, load_actor_model,
                                   rows_of_table)

    import deepspeed

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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default (SmolLM2-135M), tiny, or a model folder")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=96)
    parser.add_argument("--max-len", type=int, default=192)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--budget", type=int, default=1024, help="max_tokens_per_microbatch_in_train")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the bare loop and the worker")
    args = parser.parse_args()

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from schemas.config import validate_config
    from schemas.train_config import TrainStepConfig
    from stages.generation.model_store import default_model_dir, tiny_random_model_dir

    model_dir = str({"default": default_model_dir, "tiny": tiny_random_model_dir}.get(args.model,
                                                                                      lambda: args.model)())
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

    bare_tokens, bare_s, bare_cpu = bare_loop(table, model_dir, cfg, args.threads)
    bare_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    from stages.train.stage import run_train_step

    start = time.perf_counter()
    result = run_train_step(str(work / "adv"), model_dir, cfg, str(work / "ckpt"))
    e2e = time.perf_counter() - start
    state = json.loads((work / "ckpt" / "train_state.json").read_text())
    stage_tokens, stage_s, stage_cpu = state["tokens"], state["train_seconds"], state["train_cpu_seconds"]
    stage_rss = result.metrics.get("system/peak_rss_mb", float("nan"))
    assert stage_tokens == bare_tokens, (stage_tokens, bare_tokens)

    stage_tps, bare_tps = stage_tokens / stage_s, bare_tokens / bare_s
    print(f"model {args.model} ({args.dtype}), {args.rows} rows x {args.min_len}-{args.max_len} tokens, "
          f"{args.epochs} epoch(s), budget {args.budget} tokens, {args.threads} threads")
    print(f"{'run':<24}{'tokens':>8}{'wall s':>9}{'tok/s':>9}{'CPU s':>9}{'tok/CPU s':>11}{'peak RSS MB':>13}")
    print(f"{'bare DeepSpeed loop':<24}{bare_tokens:>8}{bare_s:>9.2f}{bare_tps:>9.1f}{bare_cpu:>9.2f}"
          f"{bare_tokens / bare_cpu:>11.1f}{bare_rss:>13.0f}")
    print(f"{'stage: training loop':<24}{stage_tokens:>8}{stage_s:>9.2f}{stage_tps:>9.1f}{stage_cpu:>9.2f}"
          f"{stage_tokens / stage_cpu:>11.1f}{stage_rss:>13.0f}")
    print(f"{'stage: end to end':<24}{stage_tokens:>8}{e2e:>9.2f}{stage_tokens / e2e:>9.1f}"
          f"   (Ray Train start, model load, checkpoint write)")
    print(f"CPU-time ratio (robust to other load on the machine): {(stage_tokens / stage_cpu) / (bare_tokens / bare_cpu):.3f}")
    print(f"RESULT stage_tok_per_s={stage_tps:.1f} bare_tok_per_s={bare_tps:.1f} ratio={stage_tps / bare_tps:.3f} "
          f"peak_rss_mb={max(stage_rss, bare_rss):.0f}")


if __name__ == "__main__":
    main()
