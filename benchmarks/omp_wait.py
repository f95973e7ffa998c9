"""OpenMP's wait policy when two torch processes share the cores (issue 11): what rollflow sets
(``OMP_WAIT_POLICY=PASSIVE``, stages/cluster.py ``passive_omp_wait``) against GNU libgomp's default (torch's OpenMP
on Linux x86: threads that reach a barrier spin before they sleep).

Each measurement is a fresh process that loads the model (``--model``, default SmolLM2-135M) in fp32 with
``--threads`` torch threads and times ``--passes`` forward+backward passes on ``--tokens`` random tokens (loading is
not timed). Side by side in one run: one process alone and two at once (the mean of the two), under each policy.

Usage: python benchmarks/omp_wait.py [--threads 2] [--passes 3] [--tokens 300] [--model default]
Last line: RESULT alone_default_s=… alone_passive_s=… pair_default_s=… pair_passive_s=… pair_slowdown_default=…
pair_slowdown_passive=…
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._common import model_folder, set_up_process  # noqa: E402

POLICIES = {"default": None, "passive": "PASSIVE"}  # None: libgomp's own default (no OMP_WAIT_POLICY at all)


def _work(model: str, threads: int, passes: int, tokens: int) -> None:
    """The timed part, in a child process: prints the seconds of the passes."""
    import time

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = torch.randint(0, net.config.vocab_size, (1, tokens))
    start = time.perf_counter()
    for _ in range(passes):
        net(input_ids=ids).logits.logsumexp(-1).sum().backward()
    print(f"{time.perf_counter() - start:.3f}")


def _run(count: int, policy: str | None, args, model: str) -> float:
    """Start ``count`` children at once under ``policy``; the mean of their timed seconds."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, __file__, "--child", model, "--threads", str(args.threads), "--passes", str(args.passes),
           "--tokens", str(args.tokens)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    seconds = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a benchmark child failed (exit {proc.returncode})")
        seconds.append(float(out.strip().splitlines()[-1]))
    return sum(seconds) / len(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default (SmolLM2-135M), tiny, or a model folder")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each process")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _work(args.child, args.threads, args.passes, args.tokens)
        return
    set_up_process()
    model = model_folder(args.model)
    result = {}
    for name, policy in POLICIES.items():
        result[f"alone_{name}_s"] = _run(1, policy, args, model)
        result[f"pair_{name}_s"] = _run(2, policy, args, model)
        print(f"{name}: alone {result[f'alone_{name}_s']:.1f} s, two at once {result[f'pair_{name}_s']:.1f} s each",
              flush=True)
    for name in POLICIES:
        result[f"pair_slowdown_{name}"] = result[f"pair_{name}_s"] / result[f"alone_{name}_s"]
    print(f"cpus: {os.cpu_count()}, threads per process: {args.threads}, passes: {args.passes}, tokens: {args.tokens}")
    print("RESULT " + " ".join(f"{k}={v:.3g}" for k, v in result.items()))


if __name__ == "__main__":
    main()
