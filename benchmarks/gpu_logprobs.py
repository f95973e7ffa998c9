"""The GPU log-prob pass of benchmarks/gpu_core.py, repeated: is a pass slower, or its first pass paying for
compilation and the allocator's warm-up? (issue 16, the output layer at the loss tokens only)

Same model and rows as gpu_core.py (a random-weight Qwen2.5-0.5B shape in bf16; 256 rows of 256-2048 random tokens,
a quarter of each row prompt), ``stages.train.forward.forward_rows`` on ``cuda`` with a ``--budget``-token
micro-batch budget. One warm-up pass over 8 rows, then ``--repeats`` timed passes over the whole table, each with its
peak allocated memory and the number of graphs ``torch.compile`` has built so far (the log-prob chunk math is
compiled on a GPU). To compare two versions of the code, run it from each tree on the same machine.

    python benchmarks/gpu_logprobs.py --repeats 4

Last line: ``RESULT logprob_tok_per_s=... first_pass_tok_per_s=... peak_gib=...`` (the best timed pass).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import make_table  # noqa: E402
from gpu_core import QWEN25_05B, build_model, synced  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--budget", type=int, default=32768, help="log-prob micro-batch token budget")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()

    import torch
    from torch._dynamo.utils import counters

    from stages.train.batching import TokenRows
    from stages.train.forward import forward_rows, load_forward_model

    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_logprobs.py needs a CUDA GPU; the CPU benchmark is benchmarks/logprobs.py")
    work = Path(tempfile.mkdtemp(prefix="rollflow-gpu-logprobs-"))
    build_model(work / "model", None)
    table = make_table(args.rows, (256, 2048), seed=0, vocab=QWEN25_05B["vocab_size"])
    model = load_forward_model(str(work / "model"), "log_probs", "bf16", device="cuda")
    rows = TokenRows.from_arrow(table, "bench", columns=())
    forward_rows(model, TokenRows.from_arrow(table.slice(0, 8), "warm-up", columns=()), args.budget, device="cuda")
    rates, peaks = [], []
    for i in range(args.repeats):
        torch.cuda.reset_peak_memory_stats()
        result, seconds = synced(lambda: forward_rows(model, rows, args.budget, device="cuda"))
        rates.append(result.tokens / seconds)
        peaks.append(torch.cuda.max_memory_allocated() / 2 ** 30)
        print(f"pass {i}: {rates[-1]:,.0f} tok/s ({seconds:.3f} s), peak {peaks[-1]:.1f} GiB, "
              f"compiled graphs {counters['stats'].get('unique_graphs', 0)}", flush=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {result.tokens} tokens, budget {args.budget}")
    print(f"RESULT logprob_tok_per_s={max(rates):.0f} first_pass_tok_per_s={rates[0]:.0f} peak_gib={max(peaks):.1f}")


if __name__ == "__main__":
    main()
