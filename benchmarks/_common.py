"""What the stage-against-a-bare-loop benchmarks (``train.py``, ``logprobs.py``) share: their options, the process
set-up, the model folder, the random advantaged table they run on, and the table of results they print."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.tables import ADVANTAGED  # noqa: E402


def make_parser(doc: str, *, rows: int, max_len: int, budget: int, budget_field: str,
                threads_of: str) -> argparse.ArgumentParser:
    """The shared options with this benchmark's defaults: model, rows and their lengths, the token budget of a
    micro-batch (``budget_field``), dtype, and the torch threads (of ``threads_of``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default (SmolLM2-135M), tiny, or a model folder")
    parser.add_argument("--rows", type=int, default=rows)
    parser.add_argument("--min-len", type=int, default=96)
    parser.add_argument("--max-len", type=int, default=max_len)
    parser.add_argument("--budget", type=int, default=budget, help=budget_field)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2, help=f"torch threads of {threads_of}")
    return parser


def set_up_process() -> None:
    """Ray without usage stats or an auth token, tokenizers without their own threads (before either starts)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def model_folder(name: str) -> str:
    """The folder of ``--model``: ``default`` (SmolLM2-135M), ``tiny`` (random weights), or a model folder."""
    from stages.generation.model_store import default_model_dir, tiny_random_model_dir

    return str({"default": default_model_dir, "tiny": tiny_random_model_dir}.get(name, lambda: name)())


def make_table(rows: int, lengths: tuple[int, int], seed: int, vocab: int = 49152) -> pa.Table:
    """Advantaged rows of random tokens: a prompt then a response, one advantage (+-1) per row."""
    rng = np.random.default_rng(seed)
    data: dict[str, list] = {k: [] for k in ADVANTAGED.required}
    for i in range(rows):
        n = int(rng.integers(lengths[0], lengths[1] + 1))
        prompt = max(2, n // 4)
        mask = np.r_[np.zeros(prompt, np.int8), np.ones(n - prompt, np.int8)]
        adv = float(rng.choice([-1.0, 1.0]))
        loss_mask = mask[1:].astype(np.float32)
        values = {"row_id": f"r{i:05d}", "group_id": f"g{i // 8}", "traj_id": f"t{i}", "turn_idx": 0,
                  "num_turns": 1, "tag": "bench", "input_ids": rng.integers(0, vocab, n).astype(np.int32),
                  "response_mask": mask, "score": float(adv > 0), "episode_score": float(adv > 0),
                  "response_level_rewards": float(adv > 0), "token_level_rewards": loss_mask * 0,
                  "advantages": loss_mask * adv, "returns": loss_mask * float(adv > 0),
                  "raw_advantages": loss_mask * adv}
        for k, v in values.items():
            data[k].append(v)
    return pa.table({k: pa.array(v, type=ADVANTAGED.required[k]) for k, v in data.items()})


@dataclass(frozen=True)
class Run:
    """One measured run: tokens through the model, wall and CPU seconds, peak resident memory (MB)."""

    label: str
    tokens: float  # an int, or a float sum from a stage's metrics
    seconds: float
    cpu_seconds: float
    rss_mb: float

    def row(self) -> str:
        return (f"{self.label:<24}{int(self.tokens):>8}{self.seconds:>9.2f}{self.tokens / self.seconds:>9.1f}"
                f"{self.cpu_seconds:>9.2f}{self.tokens / self.cpu_seconds:>11.1f}{self.rss_mb:>13.0f}")


def print_results(heading: str, bare: Run, stage: Run, end_to_end_s: float, fixed_costs: str) -> None:
    """``heading`` (what ran), the table (the bare loop, the stage's own compute, the stage end to end with its
    ``fixed_costs``), the CPU-time ratio, and the last line ``RESULT stage_tok_per_s=... bare_tok_per_s=... ratio=...
    peak_rss_mb=...``. The bare loop and the stage must have seen the same tokens."""
    assert stage.tokens == bare.tokens, (stage.tokens, bare.tokens)
    print(heading)
    print(f"{'run':<24}{'tokens':>8}{'wall s':>9}{'tok/s':>9}{'CPU s':>9}{'tok/CPU s':>11}{'peak RSS MB':>13}")
    print(bare.row())
    print(stage.row())
    print(f"{'stage: end to end':<24}{int(stage.tokens):>8}{end_to_end_s:>9.2f}{stage.tokens / end_to_end_s:>9.1f}"
          f"   ({fixed_costs})")
    cpu_ratio = (stage.tokens / stage.cpu_seconds) / (bare.tokens / bare.cpu_seconds)
    print(f"CPU-time ratio (robust to other load on the machine): {cpu_ratio:.3f}")
    stage_tps, bare_tps = stage.tokens / stage.seconds, bare.tokens / bare.seconds
    print(f"RESULT stage_tok_per_s={stage_tps:.1f} bare_tok_per_s={bare_tps:.1f} ratio={stage_tps / bare_tps:.3f} "
          f"peak_rss_mb={max(stage.rss_mb, bare.rss_mb):.0f}")
