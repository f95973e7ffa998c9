"""First contact with a GPU: does what a GPU run needs work here, without Ray, vLLM or a package index (issue 45)?

For a GPU machine with torch, transformers, peft and DeepSpeed (the wheels carried in); at most about 8 minutes.
Each check prints one line and ``RESULT`` at the end sums them up:

1. the GPU pre-flight of ``rollflow plan`` (stages/gpu_preflight.py): driver vs torch's CUDA, compute capability,
   free memory, nvcc and the C compiler, and the choices of schemas/toolchain.py (optimizer, torch_compile);
2. a DeepSpeed training step (ZeRO-2, bf16, nccl, one rank) on a small random Qwen2.5-shaped model with the default
   optimizer (``auto``: torch's fused AdamW, nothing compiled), then again with ``torch_compile``: losses finite;
3. log-probs on CUDA (bf16) against the same model's on CPU (fp32): the largest difference;
3b. packed micro-batches through torch's variable-length flash kernel (``attn_implementation: fa2``,
   stages/train/packed_attention.py) against the padded sdpa pass, both bf16 on CUDA: each one's largest distance
   from the fp32 padded log-probs (the kernel's must stay within 2x sdpa's + 0.01), the kernel's calls, and the time
   of each pass;
3c. the log-prob pass with ``logprobs.fused_output_layer`` (``PassOptions(fused=True)``: no (tokens, vocabulary)
   logits) against the logits path on CUDA, fp32 (equal within float32 rounding: 8 ulps of the log-sum-exp's
   magnitude, as tests/train/test_forward.py) and bf16 (reported), and the pass's peak CUDA memory each way;
4. ROLL's loss golden cases on CUDA (tests/losses/test_actor_golden.py's ``test_same_result_on_cuda``);
5. two processes sharing the GPU as the colocated plan does: a second process holds memory while this one trains a
   step; the memory each sees before and after;
6. when Ray and Prefect have been carried in (Ray's wheel is about 78 MB: two pieces over two calls), the whole
   agentic loop on one GPU: ``rollflow train`` of configs/train_frozenlake_grpo_h100.yaml for one iteration with the
   HF engine (no vLLM here), no evaluation, in a run folder of its own (:data:`LOOP_OVERRIDES`); ``loop=ok(<s>)``, or
   ``loop=skipped(no <modules>)`` where they are missing, or the command's exit status.

    python benchmarks/gpu_smoke.py            # on the GPU machine
    python benchmarks/gpu_smoke.py --dry-run  # anywhere: the pre-flight and the plan of checks, nothing on a GPU

Last line: ``RESULT preflight=ok|<n> problems optimizer=... train=ok compiled=ok logprob_max_diff=...
varlen=ok(diff=...,varlen_s=...,padded_sdpa_s=...) fused_logprobs=ok|mismatch(...) fused_max_diff=<fp32>/<bf16>
fused_peak_mib=<logits path>-><fused> golden=5/5 shared_gpu=ok loop=ok(...)|skipped(...)``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SMALL = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048, "rope_theta": 1e6,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu", "attention_dropout": 0.0}


def preflight() -> tuple[str, list[str]]:
    from schemas import toolchain
    from stages.gpu_preflight import GpuNeeds, probe, problems

    host = probe()
    needs = GpuNeeds(gpus=1, memory_gib=2.0, bf16_fields=("smoke dtype bf16",))
    found = problems(host, needs) if host.gpus or host.torch_sees_cuda else ["no GPU: nvidia-smi lists none and "
                                                                               "torch sees no CUDA"]
    optimizer, why = toolchain.choose_optimizer("auto", "cuda", host.fused_adam_built)
    print(f"pre-flight: driver {host.driver}, torch CUDA {host.torch_cuda}, sees CUDA {host.torch_sees_cuda}, "
          f"GPUs {[(g.name, g.capability, round(g.free_gib, 1)) for g in host.gpus]}, nvcc {host.nvcc}, "
          f"compiler {'ok' if host.compile_missing is None else host.compile_missing}")
    print(f"pre-flight: optimizer auto -> {optimizer} ({why}); problems: {found or 'none'}")
    return optimizer, found


def build_model(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(**SMALL), dtype=torch.float32).save_pretrained(folder)


def train_config(compile_layers: bool):
    from schemas.config import validate_config
    from schemas.train_config import TrainSection

    return validate_config(TrainSection, {
        "adv_estimator": "grpo", "ppo_epochs": 1, "compute_entropy_metric": False,
        "actor_train": {"model_args": {"dtype": "bf16"}, "training_args": {"learning_rate": 1e-5,
                                                                             "per_device_train_batch_size": 16},
                        "strategy_args": {"zero_stage": 2, "torch_compile": compile_layers},
                        "max_tokens_per_microbatch_in_train": 4096}})


def train_steps(model_dir: str, table, dist, compile_layers: bool) -> tuple[bool, str, float]:
    """Two training steps; (losses finite, the optimizer DeepSpeed built, seconds)."""
    from stages.train.engine import Engine
    from stages.train.models import load_actor_model
    from stages.train.step import train_step
    from stages.train.train_table import rows_of_table

    cfg = train_config(compile_layers)
    actor = Engine(load_actor_model(model_dir), cfg.actor_train, dist, "actor")
    rows = rows_of_table(table, "smoke")
    start = time.perf_counter()
    reports = [train_step(rows, actor, None, cfg, dist, step, pad_token_id=0) for step in range(2)]
    seconds = time.perf_counter() - start
    finite = all(math.isfinite(r.metrics.get("actor/pg_loss", float("nan"))) for r in reports)
    optimizer = type(getattr(actor.engine, "basic_optimizer", actor.engine.optimizer)).__name__
    del actor
    return finite, optimizer, seconds


def logprob_diff(model_dir: str, table) -> float:
    import numpy as np

    from stages.train.batching import TokenRows
    from stages.train.forward import forward_rows, load_forward_model

    rows = TokenRows.from_arrow(table.slice(0, 8), "smoke", columns=())
    out = {}
    for device, dtype in (("cpu", "fp32"), ("cuda", "bf16")):
        model = load_forward_model(model_dir, "log_probs", dtype, device=device)
        result = forward_rows(model, rows, 4096, device=device)
        out[device] = np.asarray(result.columns["log_probs"].to_arrow().flatten(), dtype=np.float64)
    return float(np.max(np.abs(out["cpu"] - out["cuda"])))


def varlen_vs_padded(model_dir: str, table) -> str:
    """Packed bf16 log-probs through the variable-length kernel against the padded sdpa pass on CUDA; each pass once
    to warm up, then timed."""
    import numpy as np
    import torch

    from schemas.train_config import PassOptions
    from stages.train import packed_attention
    from stages.train.batching import TokenRows
    from stages.train.forward import forward_rows, load_forward_model

    rows = TokenRows.from_arrow(table, "smoke", columns=())
    model = load_forward_model(model_dir, "log_probs", "fp32", device="cuda")
    reference = forward_rows(model, rows, 4096, device="cuda").columns["log_probs"].values.astype(np.float64)
    model = load_forward_model(model_dir, "log_probs", "bf16", device="cuda")
    values, seconds, kernel_calls = {}, {}, 0
    for label, packed, attention in (("padded_sdpa", False, "sdpa"), ("packed_varlen", True, "fa2")):
        options = PassOptions(packed=packed, attention=attention)
        forward_rows(model, rows, 4096, device="cuda", options=options)
        before = packed_attention.calls.copy()
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = forward_rows(model, rows, 4096, device="cuda", options=options)
        torch.cuda.synchronize()
        seconds[label] = time.perf_counter() - start
        kernel_calls += (packed_attention.calls - before)["varlen"]
        values[label] = result.columns["log_probs"].values.astype(np.float64)
    err = {k: float(np.max(np.abs(v - reference))) for k, v in values.items()}
    diff = float(np.max(np.abs(values["packed_varlen"] - values["padded_sdpa"])))
    print(f"varlen: packed bf16 log-probs through torch's varlen kernel ({kernel_calls} calls) vs padded sdpa: max "
          f"diff {diff:.3g}; from fp32: varlen {err['packed_varlen']:.3g}, sdpa {err['padded_sdpa']:.3g}; "
          f"{rows.num_rows} rows, {int(rows.lengths.sum())} tokens: varlen {seconds['packed_varlen'] * 1e3:.1f} ms, "
          f"padded sdpa {seconds['padded_sdpa'] * 1e3:.1f} ms")
    ok = kernel_calls > 0 and err["packed_varlen"] <= 2 * err["padded_sdpa"] + 0.01
    status = "ok" if ok else ("no_kernel_call" if kernel_calls == 0 else "differs")
    return (f"{status}(diff={diff:.3g},varlen_s={seconds['packed_varlen']:.4f},"
            f"padded_sdpa_s={seconds['padded_sdpa']:.4f})")


def fused_logprobs(model_dir: str, table) -> dict[str, str]:
    """The log-prob pass on CUDA with the fused output layer against the logits path (entropy too), fp32 and bf16:
    the largest difference of each, the fp32 one against 8 float32 ulps of the largest log-sum-exp, and the peak
    CUDA memory of the bf16 pass each way (``torch.cuda.max_memory_allocated`` above the model's own). Chunks of
    256 positions: the default (64 Mi logits a chunk) would hold all of this small vocabulary's positions in one
    chunk, where a 150k-vocabulary model gets chunks of about 440."""
    from stages.losses import fused_output
    from stages.train.batching import TokenRows

    rows = TokenRows.from_arrow(table, "smoke", columns=())
    default_chunk, fused_output.FUSED_CHUNK_ELEMENTS = fused_output.FUSED_CHUNK_ELEMENTS, 256 * SMALL["vocab_size"]
    try:
        peaks, diffs, tol = _fused_runs(model_dir, rows)
    finally:
        fused_output.FUSED_CHUNK_ELEMENTS = default_chunk
    print(f"fused log-probs: max |fused - logits path| fp32 {diffs['fp32']:.3g} (bound {tol:.3g}), bf16 "
          f"{diffs['bf16']:.3g}; peak MiB above the model fp32 {peaks['fp32', False]:.1f} -> "
          f"{peaks['fp32', True]:.1f}, bf16 {peaks['bf16', False]:.1f} -> {peaks['bf16', True]:.1f}")
    return {"fused_logprobs": "ok" if diffs["fp32"] <= tol else f"mismatch({diffs['fp32']:.3g}>{tol:.3g})",
            "fused_max_diff": f"{diffs['fp32']:.3g}/{diffs['bf16']:.3g}",
            "fused_peak_mib": f"{peaks['bf16', False]:.0f}->{peaks['bf16', True]:.0f}"}


def _fused_runs(model_dir: str, rows) -> tuple[dict, dict, float]:
    """(peak MiB by (dtype, fused), max difference by dtype, the fp32 bound) of :func:`fused_logprobs`."""
    import numpy as np
    import torch

    from schemas.train_config import PassOptions
    from stages.train.forward import forward_rows, load_forward_model

    diffs, peaks, tol = {}, {}, 0.0
    for dtype in ("fp32", "bf16"):
        model = load_forward_model(model_dir, "log_probs", dtype, device="cuda")
        out = {}
        for fused in (False, True):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            result = forward_rows(model, rows, 16384, entropy=True, device="cuda",
                                  options=PassOptions(fused=fused))
            torch.cuda.synchronize()
            peaks[dtype, fused] = (torch.cuda.max_memory_allocated() - base) / 2**20
            values = [result.columns[c].values for c in ("log_probs", "entropy")]
            out[fused] = np.concatenate(values).astype(np.float64)
        diffs[dtype] = float(np.max(np.abs(out[True] - out[False])))
        if dtype == "fp32":
            scale = float(np.max(np.abs(out[False]))) + math.log(SMALL["vocab_size"])
            tol = 8 * float(np.finfo(np.float32).eps) * scale
        del model
        torch.cuda.empty_cache()
    return peaks, diffs, tol


def golden_on_cuda() -> tuple[int, int]:
    sys.path.insert(0, str(REPO))
    from tests.losses import test_actor_golden as golden

    names = golden._one_per_kind()
    passed = 0
    for name in names:
        try:
            golden.test_same_result_on_cuda(name)
            passed += 1
        except Exception:  # noqa: BLE001 (reported, the smoke goes on)
            print(f"golden {name}: FAILED\n{traceback.format_exc(limit=3)}")
    return passed, len(names)


def _hold_memory(gib: float, ready, done) -> None:
    """The second process of a shared GPU (a colocated engine's stand-in): hold ``gib`` until told."""
    import torch

    block = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    ready.set()
    done.wait(300)
    del block


LOOP_CONFIG = "configs/train_frozenlake_grpo_h100.yaml"
# the GPU quickstart's config for one iteration with the HF engine (vLLM is not on this machine) and no evaluation
LOOP_OVERRIDES = {"run_name": "gpu_smoke_loop", "max_steps": 1, "rollout.engine.backend": "hf",
                  "rollout.engine.options": {}, "eval.eval_steps": 0}
LOOP_MODULES = ("ray", "prefect", "deepspeed")
LOOP_TIMEOUT_S = 300


def loop_command(runs_dir: Path) -> list[str]:
    """``rollflow train`` of :data:`LOOP_CONFIG` with :data:`LOOP_OVERRIDES`, its run folder under ``runs_dir``."""
    sets = {**LOOP_OVERRIDES, "runs_dir": str(runs_dir)}
    args = [a for key, value in sets.items() for a in ("--set", f"{key}={'{}' if value == {} else value}")]
    return [sys.executable, "-m", "flows.cli", "train", "--config", LOOP_CONFIG, *args, "--no-report"]


def whole_loop(work: Path) -> str:
    """Check 6: one iteration of the agentic loop on this GPU, or why it was skipped."""
    missing = [name for name in LOOP_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        return f"skipped(no {'+'.join(missing)})"
    start = time.perf_counter()
    try:
        done = subprocess.run(loop_command(work / "runs"), cwd=REPO, timeout=LOOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"timeout({LOOP_TIMEOUT_S}s)"
    seconds = time.perf_counter() - start
    return f"ok({seconds:.0f}s)" if done.returncode == 0 else f"exit_{done.returncode}({seconds:.0f}s)"


def shared_gpu(model_dir: str, table, dist, gib: float = 4.0) -> str:
    import torch

    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_memory, args=(gib, ready, done))
    other.start()
    try:
        if not ready.wait(120):
            return "the second process did not start"
        free_before, total = torch.cuda.mem_get_info()
        finite, _, _ = train_steps(model_dir, table, dist, compile_layers=False)
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info()
    finally:
        done.set()
        other.join(60)
    print(f"shared GPU: another process holds {gib:g} GiB; free {free_before / 2**30:.1f} GiB before the step, "
          f"{free_after / 2**30:.1f} GiB after (of {total / 2**30:.1f}); losses finite {finite}")
    return "ok" if finite and free_after > 0 else "failed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the pre-flight and the list of checks only")
    args = parser.parse_args()
    optimizer, problems = preflight()
    results = {"preflight": "ok" if not problems else f"{len(problems)}_problems", "optimizer": optimizer}
    import torch

    if args.dry_run or not torch.cuda.is_available():
        why = "dry run" if args.dry_run else "no CUDA device (torch.cuda.is_available() is False)"
        print(f"{why}: would run a DeepSpeed step (default optimizer, then torch_compile), log-probs on CUDA vs CPU, "
              "packed log-probs through torch's varlen kernel vs padded sdpa, the fused-output-layer log-prob pass "
              "vs the logits path on CUDA (values, peak memory), the loss golden cases on CUDA, two processes "
              "sharing the GPU and, where Ray and Prefect were carried in, one iteration of the agentic loop")
        print("RESULT " + " ".join(f"{k}={v}" for k, v in results.items()) + f" gpu_checks=skipped({why.split(':')[0]})")
        return 0 if args.dry_run else 1

    from _common import make_table

    from stages.train.distributed import init_distributed

    work = Path(tempfile.mkdtemp(prefix="rollflow-gpu-smoke-"))
    build_model(work / "model")
    table = make_table(32, (64, 256), seed=0, vocab=SMALL["vocab_size"])
    dist = init_distributed()
    checks = {
        "train": lambda: train_steps(str(work / "model"), table, dist, compile_layers=False),
        "compiled": lambda: train_steps(str(work / "model"), table, dist, compile_layers=True),
        "logprob_max_diff": lambda: logprob_diff(str(work / "model"), table),
        "varlen": lambda: varlen_vs_padded(str(work / "model"), table),
        "fused_logprobs": lambda: fused_logprobs(str(work / "model"), table),
        "golden": golden_on_cuda,
        "shared_gpu": lambda: shared_gpu(str(work / "model"), table, dist),
        "loop": lambda: whole_loop(work),
    }
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            value = check()
        except Exception as err:  # noqa: BLE001 (each check reports; the smoke goes on)
            traceback.print_exc(limit=4)
            results[name] = f"error({type(err).__name__})"
            continue
        if name in ("train", "compiled"):
            finite, built, seconds = value
            print(f"{name}: 2 DeepSpeed steps in {seconds:.1f} s, optimizer {built}, losses finite {finite}")
            results[name] = "ok" if finite else "nonfinite"
        elif name == "golden":
            results[name] = f"{value[0]}/{value[1]}"
        elif name == "logprob_max_diff":
            results[name] = f"{value:.3g}"
        elif name == "fused_logprobs":
            results.update(value)
        else:
            results[name] = value
        print(f"{name}: {results[name]} ({time.perf_counter() - start:.1f} s)")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
