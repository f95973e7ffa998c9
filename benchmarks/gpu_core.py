"""GPU throughput of the training core and the log-prob core, without Ray, on a Qwen2.5-0.5B-shaped model (issue 13).

The model is built from Qwen2.5-0.5B's published shape (24 layers, hidden 896, 14 query / 2 key-value heads, MLP
4864, vocab 151936, tied embeddings) with random weights: nothing is downloaded. The table holds random tokens of
random lengths (a prompt, then a response whose tokens carry a +-1 advantage), as in the CPU benchmarks.

1. Log-prob pass: ``stages.train.forward.forward_rows`` on ``cuda`` in bf16 over the table, token-budget
   micro-batches of ``--infer-budget`` padded tokens; its log-probs become the table's ``old_log_probs``.
2. Training: ``stages.train.step.train_step`` with the actor under a DeepSpeed engine (bf16, ZeRO ``--zero``, nccl,
   one rank), PPO loss ``agentic``, length-bucketed micro-batches of at most ``--budget`` tokens (the plan sorts
   rows by length, so padding stays small), one optimizer step per training step. One warm-up step, then
   ``--steps`` timed steps.

``--packing`` packs both passes' micro-batches (``use_sequence_packing``: each micro-batch one row of real tokens,
the budgets counting real tokens) and runs them through ``--attn`` (``model_args.attn_implementation``; ``auto`` on
CUDA: torch's variable-length flash kernel, stages/train/packed_attention.py; ``sdpa``: Hugging Face's block-diagonal
mask over each packed row).

Model FLOPs per trained token: ``6 * N`` (N: every parameter in a matrix product; the tied head counts once, the
embedding lookup none) plus causal attention ``6 * layers * hidden * (t + 1) / 2`` summed over positions ``t``.
Utilisation is against the GPU's dense bf16 peak (``--peak-tflops``; 989.4 for H100/H200 SXM).

    python benchmarks/gpu_core.py --rows 256 --min-len 256 --max-len 2048 --budget 16384

Last line: ``RESULT train_tok_per_s=... train_mfu=... logprob_tok_per_s=... peak_gib=... packing=on|off attention=...``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import make_table  # noqa: E402

QWEN25_05B = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
              "hidden_act": "silu", "attention_dropout": 0.0}
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def build_model(folder: Path, layers: int | None) -> int:
    """Save a random-weight Qwen2.5-0.5B-shaped causal LM (bf16) to ``folder``; return its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(QWEN25_05B, **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def attention_flops(lengths: np.ndarray, layers: int, hidden: int) -> float:
    """Causal attention matmul FLOPs of training (forward + backward) over rows of ``lengths``."""
    lengths = lengths.astype(np.float64)
    return float(6.0 * layers * hidden * (lengths * (lengths + 1) / 2).sum())


def synced(fn):
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def logprob_pass(model_dir: str, table: pa.Table, budget: int, packed: bool = False,
                 attention: str = "auto") -> tuple[pa.Table, int, float]:
    """old_log_probs under the bf16 model on cuda (micro-batches ``packed`` under ``attention``) → (table with the
    column, tokens, seconds of the timed pass)."""
    from schemas.tables import FLOATS
    from schemas.train_config import PassOptions
    from stages.train.batching import TokenRows
    from stages.train.forward import forward_rows, load_forward_model

    model = load_forward_model(model_dir, "log_probs", "bf16", device="cuda")
    rows = TokenRows.from_arrow(table, "bench", columns=())
    run = dict(device="cuda", options=PassOptions(packed=packed, attention=attention))
    forward_rows(model, TokenRows.from_arrow(table.slice(0, 8), "warm-up", columns=()), budget, **run)
    result, seconds = synced(lambda: forward_rows(model, rows, budget, **run))
    lp = result.columns["log_probs"].to_arrow(pa.float32())
    return table.append_column(pa.field("old_log_probs", FLOATS), lp), result.tokens, seconds


def profile_step(step, path: str) -> None:
    """One training step under torch.profiler; the ops by total CUDA time go to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        synced(step)
    Path(path).write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
                          + "\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25,
                                                             max_name_column_width=70))


def train_config(args):
    from schemas.config import validate_config
    from schemas.train_config import TrainSection

    return validate_config(TrainSection, {
        "adv_estimator": "grpo", "ppo_epochs": 1, "compute_entropy_metric": False,
        "actor_train": {
            "model_args": {"dtype": "bf16", "disable_gradient_checkpointing": not args.checkpointing,
                           "attn_implementation": args.attn},
            "training_args": {"learning_rate": 1e-6, "per_device_train_batch_size": args.rows},
            "strategy_args": {"zero_stage": args.zero, "torch_compile": args.compile,
                              "optimizer": "torch_adamw" if args.torch_adam else "fused_adam"},
            "use_dynamic_batching_in_train": True, "max_tokens_per_microbatch_in_train": args.budget,
            "use_sequence_packing": args.packing}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=16384, help="training micro-batch token budget")
    parser.add_argument("--infer-budget", type=int, default=32768, help="log-prob micro-batch token budget")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps (after one warm-up step)")
    parser.add_argument("--zero", type=int, default=2, choices=[0, 1, 2])
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke run); default: 24")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (recomputes)")
    parser.add_argument("--compile", action="store_true", help="strategy_args.torch_compile: compiled decoder layers")
    parser.add_argument("--torch-adam", action="store_true", help="torch's fused AdamW (optimizer: torch_adamw, the "
                        "default of a run) instead of DeepSpeed's FusedAdam")
    parser.add_argument("--packing", action="store_true", help="use_sequence_packing in both passes (budgets count "
                        "real tokens)")
    parser.add_argument("--attn", default="auto", choices=["auto", "sdpa", "fa2"], help="attn_implementation of the "
                        "packed micro-batches (auto: torch's varlen flash kernel on CUDA with --packing; fa2 needs "
                        "--packing)")
    parser.add_argument("--profile", default=None, help="write a torch.profiler table of one more step to this file")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by GPU name)")
    args = parser.parse_args()
    if args.attn == "fa2" and not args.packing:
        parser.error("--attn fa2 runs packed micro-batches: add --packing, or use --attn auto")

    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_core.py needs a CUDA GPU (torch.cuda.is_available() is False); the CPU benchmarks "
                 "are benchmarks/train.py and benchmarks/logprobs.py")
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if peak is None:
        sys.exit(f"no dense bf16 peak known for {name!r}: pass --peak-tflops")
    torch.backends.cuda.matmul.allow_tf32 = True

    work = Path(tempfile.mkdtemp(prefix="rollflow-gpu-bench-"))
    params = build_model(work / "model", args.layers)
    layers = args.layers or QWEN25_05B["num_hidden_layers"]
    table = make_table(args.rows, (args.min_len, args.max_len), seed=0, vocab=QWEN25_05B["vocab_size"])
    table, lp_tokens, lp_s = logprob_pass(str(work / "model"), table, args.infer_budget, args.packing, args.attn)
    torch.cuda.empty_cache()  # the forward model is gone with the call
    torch.cuda.reset_peak_memory_stats()

    from stages.train.distributed import init_distributed
    from stages.train.engine import Engine
    from stages.train.models import load_actor_model
    from stages.train.packed_attention import attention_for
    from stages.train.step import train_step
    from stages.train.train_table import rows_of_table

    dist = init_distributed()
    cfg = train_config(args)
    actor = Engine(load_actor_model(str(work / "model")), cfg.actor_train, dist, "actor")
    rows = rows_of_table(table, "bench")
    _, warm_s = synced(lambda: train_step(rows, actor, None, cfg, dist, 0, pad_token_id=0))
    reports = []
    for step in range(1, args.steps + 1):
        reports.append(synced(lambda: train_step(rows, actor, None, cfg, dist, step, pad_token_id=0)))
    tokens = sum(r.tokens for r, _ in reports)
    padded = sum(r.padded_tokens for r, _ in reports)
    seconds = sum(s for _, s in reports)
    lengths = np.asarray(rows.lengths)
    flops = args.steps * (6.0 * params * lengths.sum() + attention_flops(lengths, layers, QWEN25_05B["hidden_size"]))
    tok_s = tokens / seconds
    mfu = flops / seconds / (peak * 1e12)
    peak_gib = torch.cuda.max_memory_allocated() / 2 ** 30
    reserved_gib = torch.cuda.max_memory_reserved() / 2 ** 30
    finite = all(np.isfinite(r.metrics.get("actor/pg_loss", 0.0)) for r, _ in reports)

    if args.profile:
        profile_step(lambda: train_step(rows, actor, None, cfg, dist, args.steps + 1, pad_token_id=0), args.profile)
    print(f"GPU {name}, torch {torch.__version__}, peak {peak} TFLOP/s; model {params / 1e6:.1f}M params, "
          f"{layers} layers; {args.rows} rows of {args.min_len}-{args.max_len} tokens ({int(lengths.sum())} tokens)")
    attention = attention_for(args.attn, args.packing, "cuda")
    print(f"log-prob pass: {lp_tokens} tokens in {lp_s:.2f} s = {lp_tokens / lp_s:,.0f} tok/s "
          f"(budget {args.infer_budget}; packing {'on' if args.packing else 'off'}, attention {attention})")
    print(f"training: ZeRO-{args.zero}, budget {args.budget}, {'torch AdamW' if args.torch_adam else 'FusedAdam'}, "
          f"checkpointing {'on' if args.checkpointing else 'off'}, compiled layers {args.compile}; warm-up step {warm_s:.2f} s; "
          f"{args.steps} steps {seconds:.2f} s; padding {1 - tokens / max(1, padded):.3f}; losses finite {finite}")
    print(f"training: {tok_s:,.0f} tok/s, {flops / seconds / 1e12:.1f} TFLOP/s, MFU {mfu:.3f}; "
          f"peak allocated {peak_gib:.1f} GiB, reserved {reserved_gib:.1f} GiB")
    print(f"RESULT train_tok_per_s={tok_s:.0f} train_mfu={mfu:.3f} logprob_tok_per_s={lp_tokens / lp_s:.0f} "
          f"peak_gib={peak_gib:.1f} packing={'on' if args.packing else 'off'} attention={attention}")


if __name__ == "__main__":
    main()
