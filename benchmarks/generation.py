"""Generation engines on the default model: vLLM(-CPU) against HF ``generate``, engine build, reload vs rebuild.

    .venv/bin/python benchmarks/generation.py [--batches 8,32] [--new-tokens 64] [--dtype bfloat16] [--threads 2]
                                              [--mp-rebuild]

Throughput: ``B`` chat prompts (B = each of ``--batches``), one sample each at temperature 1, up to ``--new-tokens``
new tokens; tokens/s = generated tokens (replies may end early at eos) / wall time, best of ``--repeats`` after a
warm-up. Three engines on the same prompts and dtype: ``transformers`` ``model.generate`` (batched, sampling: the
baseline), rollflow's "hf" backend (its own per-sample-seeded loop), and rollflow's "vllm" backend (enforce_eager,
in-process). Both use ``--threads`` torch threads (default 2). The HF runs come first, because an in-process vLLM
engine pins this process's thread count.

Weights: ``reload_s`` = ``engine.load_weights(folder)`` (vLLM reload + tied-layer refresh + prefix-cache reset);
``rebuild_s`` = ``engine.close()`` + ``build_engine(...)`` in-process, which is what the stage would do otherwise;
``--mp-rebuild`` also times a build with vLLM's engine in a spawned process (vLLM's default mode). The last line:

    RESULT vllm_tok_per_s=... hf_tok_per_s=... vllm_over_hf=... reload_s=... rebuild_s=...

(at the largest batch; hf = transformers ``generate``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPICS = ["the sea", "a mountain", "gravity", "photosynthesis", "a train journey", "prime numbers", "the moon",
          "a city at night", "bread baking", "chess openings", "rain", "volcanoes", "honey bees", "the internet",
          "winter", "a lighthouse"]
TASKS = ["Write a short story about {}.", "Explain {} to a child.", "Describe {} in detail."]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    from stages.generation.engines import chat_prompt_token_ids

    texts = [TASKS[i % len(TASKS)].format(TOPICS[i % len(TOPICS)]) for i in range(count)]
    return [chat_prompt_token_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def best_rate(run, repeats: int) -> tuple[float, int, float]:
    """(tokens/s, tokens, seconds) of the fastest of ``repeats`` timed runs after one warm-up run."""
    run()
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        seconds = time.perf_counter() - start
        if best is None or tokens / seconds > best[0]:
            best = (tokens / seconds, tokens, seconds)
    return best


def hf_generate_runner(model, tokenizer, prompts: list[list[int]], new_tokens: int):
    """transformers ``generate`` on a left-padded batch, sampling at temperature 1; returns generated tokens."""
    import torch

    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens, pad_token_id=pad)
        new = out[:, width:]
        # tokens up to and including the first eos of each row
        ends = [(row == tokenizer.eos_token_id).nonzero() for row in new]
        return sum(int(e[0]) + 1 if len(e) else new.shape[1] for e in ends)

    return run


def engine_runner(engine, prompts: list[list[int]], new_tokens: int):
    from stages.generation.engines import GenRequest, SamplingSpec

    counter = iter(range(10**9))

    def run() -> int:
        seed = next(counter)
        requests = [GenRequest(p, SamplingSpec(temperature=1.0, max_new_tokens=new_tokens, seed=seed * 1000 + i))
                    for i, p in enumerate(prompts)]
        return sum(len(r.response_token_ids) for r in engine.generate(requests))

    return run


def note(rows: list, row: tuple) -> None:
    """Keep a result row and show it at once on stderr (long runs on a busy machine)."""
    rows.append(row)
    print(f"[generation benchmark] {row[0]} batch {row[1]}: {row[2]:.1f} tok/s", file=sys.stderr, flush=True)


def timed(call):
    start = time.perf_counter()
    value = call()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of both engines (vLLM in-process "
                        "would otherwise drop to 1); use 1 when other work shares the cores")
    parser.add_argument("--mp-rebuild", action="store_true", help="also time a build with a spawned engine process")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import torch

    from stages.generation.engines import build_engine
    from stages.generation.model_store import default_model_dir

    model_dir = default_model_dir()
    rows = []  # (engine, batch, tok/s, tokens, seconds)

    hf_engine, hf_build_s = timed(lambda: build_engine("hf", model_dir, dtype=args.dtype, num_threads=args.threads,
                                                       max_batch_size=max(batches)))
    for batch in batches:
        prompts = chat_prompts(hf_engine.tokenizer, batch)
        rate = best_rate(hf_generate_runner(hf_engine.model, hf_engine.tokenizer, prompts, args.new_tokens),
                         args.repeats)
        note(rows, ("hf generate", batch, *rate))
        note(rows, ("rollflow hf", batch, *best_rate(engine_runner(hf_engine, prompts, args.new_tokens),
                                                     args.repeats)))
    hf_engine.close()

    options = dict(dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_space_gib=args.kv_cache_gib,
                   enforce_eager=True, in_process=True, num_threads=args.threads)
    engine, vllm_build_s = timed(lambda: build_engine("vllm", model_dir, **options))
    for batch in batches:
        prompts = chat_prompts(engine.tokenizer, batch)
        note(rows, ("rollflow vllm", batch, *best_rate(engine_runner(engine, prompts, args.new_tokens),
                                                       args.repeats)))
    reload_times = [timed(lambda: engine.load_weights(model_dir))[1] for _ in range(3)]
    reload_s = min(reload_times)
    _, close_s = timed(engine.close)
    engine, build_again_s = timed(lambda: build_engine("vllm", model_dir, **options))
    rebuild_s = close_s + build_again_s
    engine.close()
    mp_build_s = None
    if args.mp_rebuild:
        engine, mp_build_s = timed(lambda: build_engine("vllm", model_dir, **{**options, "in_process": False}))
        engine.close()

    print(f"\nmodel {model_dir.name}, dtype {args.dtype}, {args.new_tokens} new tokens, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'engine':<16}{'batch':>6}{'tok/s':>10}{'tokens':>8}{'seconds':>9}")
    for name, batch, rate, tokens, seconds in rows:
        print(f"{name:<16}{batch:>6}{rate:>10.1f}{tokens:>8}{seconds:>9.2f}")
    print(f"\nbuild: hf {hf_build_s:.2f} s, vllm (eager, in-process) {vllm_build_s:.2f} s")
    print(f"new weights: reload {reload_s:.2f} s (runs: {', '.join(f'{t:.2f}' for t in reload_times)}), "
          f"rebuild in-process {rebuild_s:.2f} s (close {close_s:.2f} + build {build_again_s:.2f})"
          + (f", build with a spawned engine process {mp_build_s:.2f} s" if mp_build_s else ""))
    top = max(batches)
    rate_of = {(name, batch): rate for name, batch, rate, _, _ in rows}
    vllm_rate, hf_rate = rate_of[("rollflow vllm", top)], rate_of[("hf generate", top)]
    print(f"RESULT vllm_tok_per_s={vllm_rate:.1f} hf_tok_per_s={hf_rate:.1f} vllm_over_hf={vllm_rate / hf_rate:.2f} "
          f"reload_s={reload_s:.2f} rebuild_s={rebuild_s:.2f}")


if __name__ == "__main__":  # vLLM may spawn processes that re-import this file
    main()
