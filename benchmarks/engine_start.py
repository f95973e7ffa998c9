"""The CPU an in-process vLLM engine start costs, each repeat in a fresh process (as an engine actor pays it).

    .venv/bin/python benchmarks/engine_start.py [--model default|tiny|FOLDER] [--repeats 3] [--threads 2]

One repeat = a fresh Python process that imports rollflow, builds the "vllm" engine (bf16, enforce_eager,
max_model_len 512, 1 GiB KV cache), generates twice (two seeded top-p/top-k samples and one greedy reply, 12 new
tokens) and closes it. CPU-s are the process's and its children's (Inductor's compiler probes are children), per
phase: ``build`` (vLLM's import included), ``first_gen``, ``second_gen``, ``close``. ``digest`` hashes the tokens and
the log-probs' exact bits: equal digests across commits mean equal outputs. The last line:

    RESULT build_cpu_s=... first_gen_cpu_s=... total_cpu_s=... digest=...   (means over the repeats)

Measured on 2 cores, default model (stages/generation/vllm_backend.py ``compile_stance``): total 16.5 -> 14.5 CPU-s,
the first ``generate`` 2.9 -> 0.8 CPU-s, digests equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import model_folder, set_up_process  # noqa: E402
from stages.generation.engines import GenRequest, SamplingSpec, build_engine  # noqa: E402


def cpu_seconds() -> float:
    """CPU-s of this process and its finished children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def one_start(model: str, threads: int) -> dict:
    """Build, generate twice, close; the CPU-s of each phase (rollflow's own imports, a few tenths of a CPU-s,
    before the clock starts) and the outputs' digest."""
    start = cpu_seconds()
    engine = build_engine("vllm", model_folder(model), dtype="bfloat16", max_model_len=512, kv_cache_space_gib=1,
                          enforce_eager=True, in_process=True, num_threads=threads)
    marks = {"build": cpu_seconds() - start}
    requests = [GenRequest([1, 2, 3, 4, 5, 6], SamplingSpec(seed=1, n=2, max_new_tokens=12, top_p=0.9, top_k=50)),
                GenRequest([7, 8, 9], SamplingSpec(temperature=0, max_new_tokens=12))]
    results = []
    for phase in ("first_gen", "second_gen"):
        before = cpu_seconds()
        results += engine.generate(requests)
        marks[phase] = cpu_seconds() - before
    before = cpu_seconds()
    engine.close()
    marks["close"] = cpu_seconds() - before
    marks["total"] = cpu_seconds() - start
    outputs = [(r.response_token_ids, [float(v).hex() for v in r.logprobs]) for r in results]
    marks["digest"] = hashlib.sha256(repr(outputs).encode()).hexdigest()[:16]
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default (SmolLM2-135M), tiny, or a model folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a repeat's own process
    args = parser.parse_args()
    set_up_process()
    if args.one:
        print("ONE " + json.dumps(one_start(args.model, args.threads)), flush=True)
        return
    runs = []
    for _ in range(args.repeats):
        command = [sys.executable, __file__, "--one", "--model", args.model, "--threads", str(args.threads)]
        out = subprocess.run(command, capture_output=True, text=True, check=True, env=dict(os.environ)).stdout
        runs.append(json.loads(next(line for line in out.splitlines() if line.startswith("ONE "))[4:]))
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in runs[-1].items()))
    means = {k: sum(r[k] for r in runs) / len(runs) for k in ("build", "first_gen", "total")}
    digests = sorted({r["digest"] for r in runs})
    print(f"RESULT build_cpu_s={means['build']:.2f} first_gen_cpu_s={means['first_gen']:.2f} "
          f"total_cpu_s={means['total']:.2f} digest={','.join(digests)}")


if __name__ == "__main__":
    main()
