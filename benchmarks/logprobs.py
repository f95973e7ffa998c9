"""Log-prob throughput: the log-prob stage (an actor group of one rank started for it, token-budget micro-batches,
ragged in and out) against a bare forward pass over the same rows, in the same run.

The bare pass is a plain loop: the rows sorted by length in padded batches of at most ``--budget`` tokens,
``model(input_ids)``, log-softmax and gather. The stage's compute time is measured inside its actors (forward,
log-probs, cutting rows back to ragged) by its rank; its end-to-end time adds the rank's start (a process, its
imports, the process group), the model load and the Parquet read and write of the runner.

    python benchmarks/logprobs.py --rows 64 --min-len 96 --max-len 256 --model default

Prints a table, then the last line ``RESULT stage_tok_per_s=... bare_tok_per_s=... ratio=... peak_rss_mb=...``.
"""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from _common import Run, make_parser, make_table, model_folder, print_results, set_up_process


def bare_forward(table, model_dir: str, budget: int, threads: int, dtype: str) -> tuple[int, float, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype={"fp32": torch.float32,
                                                                   "bf16": torch.bfloat16}[dtype]).eval()
    ids = [np.asarray(r, dtype=np.int64) for r in table.column("input_ids").to_pylist()]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * len(ids[current[0]]) > budget:
            batches.append(current)
            current = []
        current.append(i)
    batches.append(current)
    tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for batch in batches:
            width = len(ids[batch[0]])
            x = torch.zeros((len(batch), width), dtype=torch.int64)
            for j, i in enumerate(batch):
                x[j, :len(ids[i])] = torch.from_numpy(ids[i])
            logits = model(input_ids=x, use_cache=False).logits
            torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None])
            tokens += sum(len(ids[i]) for i in batch)
    return tokens, time.perf_counter() - start, time.process_time() - cpu_start


def main() -> None:
    parser = make_parser(__doc__, rows=64, max_len=256, budget=4096, budget_field="max_tokens_per_microbatch_in_infer",
                         threads_of="the bare pass and the actor")
    args = parser.parse_args()

    set_up_process()
    from schemas.train_config import ForwardConfig
    from stages.train.stage import run_logprobs

    model_dir = model_folder(args.model)
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-logprobs-"))
    table = make_table(args.rows, (args.min_len, args.max_len), seed=0)
    (work / "samples").mkdir()
    pq.write_table(table, work / "samples" / "part-00000.parquet")

    bare = Run("bare forward", *bare_forward(table, model_dir, args.budget, args.threads, args.dtype),
               resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    cfg = ForwardConfig(enable_reference=False, dtype=args.dtype, max_tokens_per_microbatch_in_infer=args.budget,
                        rows_per_batch=args.rows, num_actors=1, cpus_per_actor=args.threads,
                        runtime={"num_cpus": args.threads + 1})
    from stages.cluster import ensure_ray

    # one logical CPU more than the rank holds, for the Parquet read and write tasks (they do little work)
    ensure_ray(num_cpus=args.threads + 1, progress=False)
    start = time.perf_counter()
    result = run_logprobs(str(work / "samples"), model_dir, cfg, str(work / "out"))
    e2e = time.perf_counter() - start
    m = result.metrics
    stage = Run("stage: actor compute", m["logprobs/tokens"], m["logprobs/compute_seconds"],
                m["logprobs/compute_cpu_seconds"], m["logprobs/peak_rss_mb"])
    print_results(f"model {args.model} ({args.dtype}), {args.rows} rows x {args.min_len}-{args.max_len} tokens, "
                  f"budget {args.budget} tokens, {args.threads} threads", bare, stage, e2e,
                  "rank start, model load, Parquet I/O")


if __name__ == "__main__":
    main()
