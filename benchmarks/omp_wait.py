"""OpenMP's wait policy when two torch processes share the cores (issue 11): GNU libgomp's default (torch's OpenMP
on Linux x86: a thread that reaches a barrier spins before it sleeps) against ``OMP_WAIT_POLICY=PASSIVE`` (it sleeps
at once; what the test suite sets, tests/conftest.py) and a short spin (``GOMP_SPINCOUNT=10000``).

Each measurement is a fresh process that loads the model (``--model``, default SmolLM2-135M) in fp32 with
``--threads`` torch threads and times its work (loading is not timed). Side by side in one run: one process alone
and two at once (the mean of the two), under each policy. The work (``--work``):
  * ``train``: ``--passes`` forward+backward passes on ``--tokens`` random tokens (large parallel regions);
  * ``generate``: rollflow's vLLM engine (in-process, eager, fp32) sampling ``--prompts`` chat prompts of up to
    ``--tokens`` new tokens each, after one warm-up batch (decode steps: many small parallel regions, where a
    thread that sleeps at once pays its wake-up on every region).

Usage: python benchmarks/omp_wait.py [--work train|generate] [--threads 2] [--passes 3] [--tokens 300]
Last line: RESULT alone_default_s=… pair_default_s=… alone_passive_s=… pair_passive_s=… pair_slowdown_default=…
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

# the environment of each policy; default: libgomp's own (neither variable set, so it spins 300,000 rounds)
POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin10k": {"GOMP_SPINCOUNT": "10000"}}


def _train(model: str, threads: int, passes: int, tokens: int) -> None:
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


def _generate(model: str, threads: int, prompts: int, tokens: int) -> None:
    """The timed part of ``--work generate``, in a child process: prints the seconds of one batch."""
    from benchmarks.generation import best_rate, chat_prompts, engine_runner
    from stages.generation.engines import build_engine

    engine = build_engine("vllm", model, dtype="float32", max_model_len=1024, kv_cache_space_gib=1,
                          enforce_eager=True, in_process=True, num_threads=threads)
    _, _, seconds = best_rate(engine_runner(engine, chat_prompts(engine.tokenizer, prompts), tokens), repeats=1)
    print(f"{seconds:.3f}")
    engine.close()


def _run(count: int, policy: dict[str, str], args, model: str) -> float:
    """Start ``count`` children at once under ``policy`` (environment variables); the mean of their timed seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(policy)
    cmd = [sys.executable, __file__, "--child", model, "--work", args.work, "--threads", str(args.threads),
           "--passes", str(args.passes), "--tokens", str(args.tokens), "--prompts", str(args.prompts)]
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
    parser.add_argument("--work", default="train", choices=["train", "generate"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each process")
    parser.add_argument("--passes", type=int, default=3, help="train: forward+backward passes")
    parser.add_argument("--tokens", type=int, default=None, help="train: tokens per pass (300); generate: new "
                        "tokens per prompt (64)")
    parser.add_argument("--prompts", type=int, default=8, help="generate: prompts in the batch")
    parser.add_argument("--policies", default="default,passive",
                        help=f"comma-separated, of {', '.join(POLICIES)} (spin10k: GOMP_SPINCOUNT=10000)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.tokens = args.tokens or {"train": 300, "generate": 64}[args.work]
    if args.child:
        if args.work == "train":
            _train(args.child, args.threads, args.passes, args.tokens)
        else:
            _generate(args.child, args.threads, args.prompts, args.tokens)
        return
    set_up_process()
    model = model_folder(args.model)
    result = {}
    chosen = args.policies.split(",")
    for name, policy in ((n, POLICIES[n]) for n in chosen):
        result[f"alone_{name}_s"] = _run(1, policy, args, model)
        result[f"pair_{name}_s"] = _run(2, policy, args, model)
        print(f"{name}: alone {result[f'alone_{name}_s']:.1f} s, two at once {result[f'pair_{name}_s']:.1f} s each",
              flush=True)
    for name in chosen:
        result[f"pair_slowdown_{name}"] = result[f"pair_{name}_s"] / result[f"alone_{name}_s"]
    print(f"work: {args.work}, cpus: {os.cpu_count()}, threads per process: {args.threads}, passes: {args.passes}, "
          f"prompts: {args.prompts}, tokens: {args.tokens}")
    print("RESULT " + " ".join(f"{k}={v:.3g}" for k, v in result.items()))


if __name__ == "__main__":
    main()
