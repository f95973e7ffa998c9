"""Benchmark of the recompute chain (issue 2): rows/s, tokens/s and peak RSS of the whole chain, against

(a) the I/O floor: pyarrow reading the columns the chain reads and writing the columns it writes, no compute;
(b) a single-process padded-tensor implementation of the same chain that pads every batch to its longest row and
    runs ROLL's per-position loops in torch, as ROLL does.

Usage: python benchmarks/recompute.py --samples 200000 [--scale 10] [--data-memory-mb MB] [--skip-padded]
       [--skip-default-floor]
With --scale K the chain also runs on K× fewer rows first, to report the peak-RSS growth of K× more rows.
Last line: RESULT rows_per_s=… tokens_per_s=… peak_rss_mb=… peak_pss_mb=… io_floor_ratio=… io_floor_default_ratio=…
padded_speedup=…
[rss_growth_10x=… pss_growth_10x=…]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from schemas.config import AdvantageSection, RecomputeConfig, ResponseRewardSection, load_config, section  # noqa: E402
from stages.example import ExampleSpec, generate  # noqa: E402

CONFIG = REPO / "configs/recompute_grpo.yaml"


class PeakMemory:
    """Samples the memory of this process and all its descendants (Ray's raylet and workers) every 0.2 s.

    ``rss``: the summed resident sets, which count a page shared by k processes (Ray's object store, mapped by every
    worker that reads a block) k times; ``pss``: the summed proportional sets, each shared page split among its
    sharers, i.e. the memory the chain really holds. Both peaks are kept."""

    def __init__(self) -> None:
        self.rss = self.pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> tuple[int, int]:
        me = psutil.Process()
        rss = pss = 0
        for p in [me] + me.children(recursive=True):
            try:
                m = p.memory_full_info()
            except psutil.Error:
                continue
            rss, pss = rss + m.rss, pss + m.pss
        return rss, pss

    def _update(self) -> None:
        rss, pss = self._sample()
        self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._update()
            time.sleep(0.2)

    def __enter__(self):
        self._update()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def dataset(samples: int, cache: Path) -> Path:
    path = cache / f"samples_{samples}"
    if not path.exists():
        t = time.time()
        generate(ExampleSpec(samples=samples, seed=1, with_values=False), str(path))
        print(f"generated {samples} rows in {time.time() - t:.1f}s -> {path}")
    return path


def total_tokens(path: Path) -> int:
    """Tokens of the set, one file at a time: the whole input_ids column of the 2M-row set is ~3 GB, which the
    driver's memory pool still held when the first chain's memory was sampled (its 200k chain peaked at twice the
    standalone 200k run's RSS, BENCHMARKS.md issue 49)."""
    total = 0
    for f in sorted(path.glob("*.parquet")):
        total += int(pc.sum(pc.list_value_length(pq.read_table(f, columns=["input_ids"]).column(0))).as_py() or 0)
    pa.default_memory_pool().release_unused()
    return total


def run_chain(samples: Path, out: Path, cfg: RecomputeConfig) -> float:
    from stages.advantages import AdvantagesStage
    from stages.response_rewards import ResponseRewardsStage
    from stages.runner import run_stage

    shutil.rmtree(out, ignore_errors=True)
    t = time.time()
    run_stage(ResponseRewardsStage(), section(cfg, ResponseRewardSection), {"samples": str(samples)},
              str(out / "rewarded"), batch_rows=cfg.runtime.batch_rows)
    run_stage(AdvantagesStage(), section(cfg, AdvantageSection),
              {"samples": str(samples), "rewarded": str(out / "rewarded")}, str(out / "advantaged"),
              batch_rows=cfg.runtime.batch_rows)
    return time.time() - t


def io_floor(samples: Path, out: Path, defaults: bool = False) -> float:
    """Read every input file with pyarrow and write a table with the output's columns (the four new list columns
    copied from an input list column of the same shape) — the chain's bytes in and out, no compute. The files are
    written with the options the chain's writer uses (stages/runner.py ``parquet_write_options``); ``defaults``:
    with pyarrow's default options instead (the floor of the runs before issue 49, which dictionary-encoded every
    column)."""
    from stages.parquet_parts import parquet_write_options

    def write(table: pa.Table, where: Path) -> None:
        pq.write_table(table, where, **({} if defaults else parquet_write_options(table.schema)))

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t = time.time()
    for i, f in enumerate(sorted(samples.glob("*.parquet"))):
        table = pq.read_table(f)
        narrow = table.select(["row_id", "score"])
        write(narrow, out / f"rewarded-{i}.parquet")
        like = table.column("old_log_probs")
        for name in ("token_level_rewards", "advantages", "returns", "raw_advantages"):
            table = table.append_column(name, like)
        table = table.append_column("response_level_rewards", table.column("score"))
        write(table, out / f"part-{i}.parquet")
    return time.time() - t


def padded_chain(samples: Path, out: Path, cfg: RecomputeConfig, batch_rows: int = 1024) -> float:
    """ROLL's way: pad each batch to its longest row, run the token-level chain on (B, S-1) torch tensors with
    ROLL's per-position loop, unpad and write. The narrow response-level part is shared with rollflow (it has no
    padding); only the token-level part differs."""
    import torch

    from stages.response_rewards import NARROW, response_rewards_table

    torch.set_num_threads(1)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t = time.time()
    files = sorted(map(str, samples.glob("*.parquet")))
    narrow = pads.dataset(files).to_table(columns=NARROW + ["state_hash"])
    rewarded, _ = response_rewards_table(narrow, section(cfg, ResponseRewardSection), str(samples))
    lookup = dict(zip(rewarded.column("row_id").to_pylist(), rewarded.column("response_level_rewards").to_pylist()))
    beta = cfg.init_kl_coef if cfg.add_token_level_kl else 0.0
    part = 0
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_rows):
            b = pa.Table.from_batches([batch])
            ids = b.column("input_ids").to_pylist()
            S = max(map(len, ids))
            B = len(ids)
            attn = torch.zeros(B, S, dtype=torch.long)
            resp = torch.zeros(B, S, dtype=torch.long)
            old = torch.zeros(B, S - 1)
            ref = torch.zeros(B, S - 1)
            for i, (m, o, r) in enumerate(zip(b.column("response_mask").to_pylist(),
                                              b.column("old_log_probs").to_pylist(),
                                              b.column("ref_log_probs").to_pylist())):
                L = len(m)
                attn[i, :L] = 1
                resp[i, :L] = torch.tensor(m)
                old[i, : L - 1] = torch.tensor(o)
                ref[i, : L - 1] = torch.tensor(r)
            mask = resp[:, 1:].float()
            R = torch.tensor([lookup[x] for x in b.column("row_id").to_pylist()])
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            last = (pos * attn).argmax(-1)
            scores = torch.zeros(B, S)
            scores[torch.arange(B), last] = R
            token_rewards = scores[:, 1:]
            k = ref - old
            kl = torch.clamp(torch.exp(k) - k - 1, -10, 10) * mask
            token_rewards = token_rewards - beta * kl
            token_rewards = token_rewards * mask
            returns = torch.zeros_like(token_rewards)
            running = torch.zeros(B)
            for col in reversed(range(S - 1)):
                running = token_rewards[:, col] + cfg.gamma * running
                returns[:, col] = running
            adv = returns * mask
            lengths = (attn.sum(-1) - 1).tolist()
            unpad = lambda x: pa.array([row[:n] for row, n in zip(x.tolist(), lengths)], pa.list_(pa.float32()))  # noqa: E731
            b = b.append_column("response_level_rewards", pa.array(R.numpy(), pa.float32()))
            for name, x in (("token_level_rewards", token_rewards), ("advantages", adv), ("returns", returns),
                            ("raw_advantages", returns)):
                b = b.append_column(name, unpad(x))
            pq.write_table(b, out / f"part-{part:05d}.parquet")
            part += 1
    return time.time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--scale", type=int, default=0, help="also run on samples/scale rows to measure RSS growth")
    ap.add_argument("--cache", type=Path, default=REPO / ".cache/bench/recompute")
    ap.add_argument("--skip-padded", action="store_true")
    ap.add_argument("--skip-default-floor", action="store_true",
                    help="do not also time the I/O floor with pyarrow's default writer options")
    ap.add_argument("--data-memory-mb", type=float, default=None,
                    help="runtime.data_memory_mb of the chain (default: the config's)")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from stages.cluster import ensure_ray

    cfg = load_config(RecomputeConfig, CONFIG)
    samples = dataset(args.samples, args.cache)
    tokens = total_tokens(samples)
    ensure_ray(num_cpus=os.cpu_count(), progress=False,
               data_memory_mb=args.data_memory_mb or cfg.runtime.data_memory_mb)
    small_mem = None
    if args.scale:
        small = dataset(args.samples // args.scale, args.cache)
        with PeakMemory() as small_mem:
            run_chain(small, args.cache / "out_small", cfg)
    with PeakMemory() as mem:
        chain_s = run_chain(samples, args.cache / "out_chain", cfg)
    floor_s = io_floor(samples, args.cache / "out_floor")
    floor_default_s = None if args.skip_default_floor else io_floor(samples, args.cache / "out_floor", defaults=True)
    shutil.rmtree(args.cache / "out_floor", ignore_errors=True)
    padded_s = None if args.skip_padded else padded_chain(samples, args.cache / "out_padded", cfg)
    print(f"\nmachine: {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB; config {CONFIG.name}")
    print(f"{'what':<34}{'seconds':>10}{'rows/s':>12}{'tokens/s':>14}")
    for name, s in (("rollflow recompute chain (Ray)", chain_s), ("I/O floor (pyarrow read+write)", floor_s),
                    ("I/O floor, pyarrow default writer", floor_default_s),
                    ("padded single-process (ROLL-style)", padded_s)):
        if s is not None:
            print(f"{name:<34}{s:>10.1f}{args.samples / s:>12.0f}{tokens / s:>14.0f}")
    mb = 2**20
    print(f"peak memory of the chain (driver + Ray processes): summed RSS {mem.rss / mb:.0f} MB, summed PSS "
          f"{mem.pss / mb:.0f} MB" + (f"; with {args.samples // args.scale} rows: RSS {small_mem.rss / mb:.0f} MB, "
                                      f"PSS {small_mem.pss / mb:.0f} MB" if small_mem else ""))
    result = (f"RESULT rows_per_s={args.samples / chain_s:.0f} tokens_per_s={tokens / chain_s:.0f} "
              f"peak_rss_mb={mem.rss / mb:.0f} peak_pss_mb={mem.pss / mb:.0f} io_floor_ratio={chain_s / floor_s:.2f}")
    result += f" io_floor_default_ratio={chain_s / floor_default_s:.2f}" if floor_default_s else ""
    result += f" padded_speedup={padded_s / chain_s:.2f}" if padded_s else ""
    if small_mem:
        result += (f" rss_growth_{args.scale}x={mem.rss / small_mem.rss:.2f}"
                   f" pss_growth_{args.scale}x={mem.pss / small_mem.pss:.2f}")
    print(result)


if __name__ == "__main__":
    main()
