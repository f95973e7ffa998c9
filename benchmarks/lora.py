"""Full training against LoRA training (model_args.lora_rank), side by side in one run: the seconds of one
training step and the size of the optimizer's state.

Both engines are the training core's (``stages.train.engine.Engine``: DeepSpeed, ZeRO as configured, one process)
on the same advantaged rows of random tokens with ``old_log_probs`` from the model, so the step is a real PPO step.
Each takes ``--steps`` training steps after one warm-up step (the optimizer state is allocated there); the best
step counts. The optimizer size is the bytes of the torch optimizer's state tensors (AdamW's two moments, and the
fp32 master copies that ZeRO keeps in its flat groups are not counted for either).

    python benchmarks/lora.py --model default --rows 8 --rank 8 --dtype bf16

Last line: ``RESULT full_step_s=... lora_step_s=... full_optimizer_mb=... lora_optimizer_mb=...``.
"""

from __future__ import annotations

import gc
import time

from _common import make_parser, make_table, model_folder, set_up_process


def optimizer_mb(engine) -> float:
    inner = engine.engine.optimizer
    base = getattr(inner, "optimizer", inner)
    return sum(t.numel() * t.element_size() for s in base.state.values() for t in s.values()
               if hasattr(t, "numel") and t.dim() > 0) / 2 ** 20


def main() -> None:
    parser = make_parser(__doc__, rows=8, max_len=192, budget=4096, budget_field="max_tokens_per_microbatch_in_train",
                         threads_of="the training process")
    parser.add_argument("--rank", type=int, default=8, help="lora_rank (lora_alpha: 2 x rank)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    args = parser.parse_args()
    set_up_process()

    import torch

    from schemas.config import validate_config
    from schemas.train_config import TrainStepConfig
    from stages.train.checkpoint import read_checkpoint
    from stages.train.distributed import init_distributed
    from stages.train.engine import Engine
    from stages.train.lora import build_actor_model, lora_bases
    from stages.train.step import train_step
    from stages.train.train_table import rows_of_table
    from train import add_old_log_probs

    dist = init_distributed(args.threads)
    folder = model_folder(args.model)
    table = add_old_log_probs(make_table(args.rows, (args.min_len, args.max_len), seed=0), folder, args.threads)
    rows = rows_of_table(table, "bench")
    info = read_checkpoint(folder)
    results = {}
    for name, model_args in (("full", {}), ("lora", {"lora_rank": args.rank})):
        cfg = validate_config(TrainStepConfig, {"adv_estimator": "grpo", "compute_entropy_metric": False,
                                                "actor_train": {"model_args": {"dtype": args.dtype, **model_args},
                                                                "training_args": {"learning_rate": 1e-6,
                                                                                  "per_device_train_batch_size":
                                                                                      args.rows},
                                                                "max_tokens_per_microbatch_in_train": args.budget}})
        engine = Engine(build_actor_model(info, cfg.actor_train, lora_bases(info, cfg).get("actor")),
                        cfg.actor_train, dist, "actor")
        trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        train_step(rows, engine, None, cfg, dist, 0, 0)  # warm-up; allocates the optimizer state
        times = []
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            train_step(rows, engine, None, cfg, dist, step, 0)
            times.append(time.perf_counter() - start)
        results[name] = (min(times), optimizer_mb(engine), trainable)
        print(f"{name:5s} trainable={trainable:>11,d} step_s={min(times):7.2f} optimizer_mb={results[name][1]:8.1f}",
              flush=True)
        del engine
        gc.collect()
    print(f"model={args.model} rows={args.rows} lengths={args.min_len}-{args.max_len} dtype={args.dtype} "
          f"rank={args.rank} threads={args.threads} torch={torch.__version__}")
    print(f"RESULT full_step_s={results['full'][0]:.2f} lora_step_s={results['lora'][0]:.2f} "
          f"full_optimizer_mb={results['full'][1]:.1f} lora_optimizer_mb={results['lora'][1]:.1f}")


if __name__ == "__main__":
    main()
