"""The log-prob pass of a LoRA checkpoint: one model (the base plus the adapter; the reference under peft's
``disable_adapter()``) against two (the merged checkpoint and the reference base loaded apart, as before).

A LoRA checkpoint of ``--model`` is made once in a temporary folder, as training writes one: the base wrapped with
rank ``--rank`` adapters on the default targets, ``B`` drawn at random (seeded; a trained adapter is not zero),
the merged weights in ``--dtype`` beside the adapter, and ``train_state.json`` recording the base. Each mode then
runs in a fresh process (peak RSS is per process) through the log-prob stage's own pieces — the jobs of
``LogProbStage``, the models of a forward actor, ``forward_batch`` — on the same rows: ``old_log_probs``,
``ref_log_probs`` and ``entropy``. Per mode: seconds to load the models, seconds of the forward passes, and the
process's peak RSS (VmHWM) before any model was loaded (Python, torch, transformers, peft imported), after the load,
and at the end of the pass (activations added). An fp32 model keeps its weights memory-mapped from the safetensors
file, so they count when the pass reads them, not at the load. The one-model mode also times the stage's check that
the reference is the adapter's base: the recorded fingerprint (what a run does), and, after the pass, the fallback
that compares base + adapter with the merged weights (it reads both models' files: the check of a checkpoint
written before the fingerprint was recorded, or of a base folder touched since). With ``--dtype bf16`` the
two-model pass also runs in float32, to show bf16's own rounding on this model beside the one/two difference.

    python benchmarks/lora_logprobs.py --model default --rows 8 --dtype bf16

Last line: ``RESULT one_model_peak_rss_mb=... two_model_peak_rss_mb=... one_model_loaded_mb=... two_model_loaded_mb=...
one_model_load_s=... two_model_load_s=... max_abs_diff_old=... max_abs_diff_ref=...`` (one_model_load_s includes the
check).
"""

from __future__ import annotations

import importlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from _common import make_parser, make_table, model_folder, set_up_process


def rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the parent across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def make_checkpoint(base: str, folder: Path, rank: int, dtype: str) -> None:
    """A LoRA checkpoint of ``base`` as training writes one (merged weights, adapter, base recorded)."""
    import torch

    from schemas.config import validate_config
    from schemas.train_config import TrainStepConfig
    from stages.train.checkpoint import ACTOR_ADAPTER, checkpoint_fingerprint, copy_tokenizer, write_train_state
    from stages.train.lora import merged_state_dict, save_adapter, wrap
    from stages.train.models import load_actor_model

    args = validate_config(TrainStepConfig, {"actor_train": {"model_args": {"lora_rank": rank}}}).actor_train.model_args
    model = wrap(load_actor_model(base), args, "actor", seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    model = model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])  # as DeepSpeed casts a trained one
    model.get_base_model().save_pretrained(folder, state_dict=merged_state_dict(model), safe_serialization=True)
    save_adapter(model, str(folder / ACTOR_ADAPTER))
    copy_tokenizer(base, str(folder))
    write_train_state(str(folder), {"global_step": 1, "optimizer_steps": 1,
                                    "lora": {"actor": {"options": args.lora_options(), "base": base,
                                                       "base_fingerprint": checkpoint_fingerprint(base)}}})


def child(mode: str, checkpoint: str, base: str, samples: str, out: str, dtype: str, budget: int,
          threads: int) -> None:
    """One mode in this process: load its models, run the pass, write the table and a JSON line of numbers."""
    import torch

    from schemas.train_config import ForwardConfig, LogProbSection
    from stages.storage import Location
    from stages.train.checkpoint import checkpoint_fingerprint
    from stages.train.forward import forward_batch, load_forward_model
    from stages.train.stage import LOGPROBS, ForwardJob, LogProbStage

    torch.set_num_threads(threads)
    for module in ("peft", "transformers.models.llama.modeling_llama", "stages.train.core"):
        importlib.import_module(module)  # before the clock and the RSS baseline start, in both modes

    table = pq.read_table(samples)
    before = rss_mb()
    check_s = content_check_s = 0.0
    if mode == "one":
        section = LogProbSection(checkpoint=checkpoint, reference=base, compute_entropy=True, dtype=dtype,
                                 max_tokens_per_microbatch_in_infer=budget)
        start = time.perf_counter()
        jobs = LogProbStage(ForwardConfig(), fingerprints={"checkpoint": checkpoint_fingerprint(checkpoint),
                                                           "reference": checkpoint_fingerprint(base)}).jobs(section)
        check_s = time.perf_counter() - start
        assert len(jobs) == 1 and jobs[0].adapter, jobs
    else:  # the jobs of the log-prob stage before one model served a LoRA checkpoint
        jobs = [ForwardJob("log_probs", checkpoint, "old_log_probs", entropy=True),
                ForwardJob("log_probs", base, "ref_log_probs")]
    after_check = rss_mb()
    start = time.perf_counter()
    models = [load_forward_model(j.path, j.kind, dtype, adapter=j.adapter) for j in jobs]
    load_s = time.perf_counter() - start
    loaded = rss_mb()
    start = time.perf_counter()
    result = forward_batch(models, jobs, table, budget, Location.of(out + ".side"), LOGPROBS, "bench")
    forward_s = time.perf_counter() - start
    pq.write_table(result, out)
    peak = rss_mb()
    if mode == "one":  # after the peak is taken: it reads both models' files
        from stages.train.checkpoint import read_checkpoint
        from stages.train.adapter_base import why_not_adapter_base

        start = time.perf_counter()
        assert why_not_adapter_base(read_checkpoint(checkpoint), base) is None  # no fingerprint: the weights compared
        content_check_s = time.perf_counter() - start
    print(json.dumps({"mode": mode, "models": len(models), "rss_before_mb": before, "rss_after_check_mb": after_check,
                      "loaded_rss_mb": loaded, "peak_rss_mb": peak, "check_s": check_s,
                      "content_check_s": content_check_s, "load_s": load_s, "forward_s": forward_s}))


def main() -> None:
    parser = make_parser(__doc__, rows=8, max_len=192, budget=4096, budget_field="max_tokens_per_microbatch_in_infer",
                         threads_of="each mode's process")
    parser.add_argument("--rank", type=int, default=8, help="lora_rank of the made checkpoint (alpha: 2 x rank)")
    parser.add_argument("--child", nargs=6, help=argparse_hidden())
    args = parser.parse_args()
    set_up_process()
    if args.child:
        mode, checkpoint, base, samples, out, _ = args.child
        child(mode, checkpoint, base, samples, out, args.dtype, args.budget, args.threads)
        return

    import torch

    base = model_folder(args.model)
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-lora-logprobs-"))
    start = time.perf_counter()
    make_checkpoint(base, work / "checkpoint", args.rank, args.dtype)
    print(f"made the LoRA checkpoint in {time.perf_counter() - start:.1f} s", flush=True)
    samples = str(work / "samples.parquet")
    pq.write_table(make_table(args.rows, (args.min_len, args.max_len), seed=0), samples)
    numbers, tables = {}, {}
    # bf16: the two-model pass in float32 too, whose distance to the bf16 one is bf16's own rounding on this model
    runs = [("two", args.dtype), ("one", args.dtype)] + ([("two", "fp32")] if args.dtype != "fp32" else [])
    for mode, dtype in runs:
        out = str(work / f"{mode}-{dtype}.parquet")
        command = [sys.executable, __file__, "--model", args.model, "--dtype", dtype, "--budget",
                   str(args.budget), "--threads", str(args.threads),
                   "--child", mode, str(work / "checkpoint"), base, samples, out, "-"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{mode}-model process failed:\n{done.stderr[-3000:]}")
        if dtype == args.dtype:
            numbers[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        tables[mode if dtype == args.dtype else "two-fp32"] = pq.read_table(out)

    def max_diff(x: str, y: str, name: str) -> float:
        a, b = (np.concatenate(tables[m].column(name).to_pylist()) for m in (x, y))
        return float(np.abs(a - b).max())
    diffs = {name: max_diff("one", "two", name) for name in ("old_log_probs", "ref_log_probs", "entropy")}
    if "two-fp32" in tables:
        print(f"bf16's own rounding here, max |two-model {args.dtype} - two-model fp32|: old_log_probs "
              f"{max_diff('two', 'two-fp32', 'old_log_probs'):.3g}, "
              f"entropy {max_diff('two', 'two-fp32', 'entropy'):.3g}")
    print(f"model={args.model} rows={args.rows} lengths={args.min_len}-{args.max_len} dtype={args.dtype} "
          f"rank={args.rank} threads={args.threads} torch={torch.__version__}")
    print(f"{'mode':<10}{'models':>7}{'RSS before MB':>15}{'after load MB':>15}{'peak RSS MB':>13}{'check s':>9}"
          f"{'load s':>8}{'forward s':>11}")
    for mode in ("one", "two"):
        n = numbers[mode]
        print(f"{mode + ' model':<10}{n['models']:>7}{n['rss_before_mb']:>15.0f}{n['loaded_rss_mb']:>15.0f}"
              f"{n['peak_rss_mb']:>13.0f}{n['check_s']:>9.2f}{n['load_s']:>8.2f}{n['forward_s']:>11.2f}")
    print(f"max |one - two|: old_log_probs {diffs['old_log_probs']:.3g}, ref_log_probs {diffs['ref_log_probs']:.3g}, "
          f"entropy {diffs['entropy']:.3g}")
    one, two = numbers["one"], numbers["two"]
    print(f"weights compared instead of the fingerprint (the fallback check): {one['content_check_s']:.2f} s")
    print(f"RESULT one_model_peak_rss_mb={one['peak_rss_mb']:.0f} two_model_peak_rss_mb={two['peak_rss_mb']:.0f} "
          f"one_model_loaded_mb={one['loaded_rss_mb'] - one['rss_before_mb']:.0f} "
          f"two_model_loaded_mb={two['loaded_rss_mb'] - two['rss_before_mb']:.0f} "
          f"one_model_load_s={one['load_s'] + one['check_s']:.2f} two_model_load_s={two['load_s']:.2f} "
          f"max_abs_diff_old={diffs['old_log_probs']:.3g} max_abs_diff_ref={diffs['ref_log_probs']:.3g}")


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
