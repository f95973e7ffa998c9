"""Ray Data's two Parquet readers under the stages' fixed cost (issue 11): Ray 2.60's default reader (V2, a file
listing and footer-reading step in Ray tasks before the first block) against the first one (V1), which the runner
uses (stages/cluster.py ``PARQUET_DATASOURCE_V2``, set by ``ensure_ray``).

Side by side on one local Ray cluster of ``--cpus`` CPUs, warm workers, each reader in turn:
  * ``read_parquet(files).take_all()`` of one 4-row file, and of 8 files of 500 example rows (the median of
    ``--repeat`` reads);
  * the recompute chain through the runner (response rewards, then advantages: the stages of every iteration) on
    ``--samples`` example rows (the median of ``--repeat`` runs, each into a new folder).

Usage: python benchmarks/parquet_read.py [--cpus 2] [--repeat 5] [--samples 400]
Last line: RESULT v1_read_small_s=… v2_read_small_s=… v1_read_8files_s=… v2_read_8files_s=… v1_chain_s=…
v2_chain_s=… chain_speedup=…
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._common import set_up_process  # noqa: E402


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--samples", type=int, default=400)
    args = parser.parse_args()
    set_up_process()

    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data

    from schemas.config import AdvantageSection, RecomputeConfig, ResponseRewardSection, load_config, section
    from stages import runner
    from stages.advantages import AdvantagesStage
    from stages.cluster import ensure_ray
    from stages.example import ExampleSpec, generate
    from stages.response_rewards import ResponseRewardsStage

    ensure_ray(num_cpus=args.cpus)
    root = Path(tempfile.mkdtemp(prefix="parquet-read-"))
    small = root / "small.parquet"
    pq.write_table(pa.table({"x": list(range(4))}), small)
    samples = root / "samples"
    generate(ExampleSpec(samples=4000, seed=1, rows_per_file=500, response_len=(8, 32), prompt_len=(4, 12)),
             str(samples))
    eight = sorted(str(p) for p in samples.glob("*.parquet"))
    chain_in = root / "chain_in"
    generate(ExampleSpec(samples=args.samples, seed=2, rows_per_file=120, response_len=(8, 32),
                         prompt_len=(4, 12)), str(chain_in))
    cfg = load_config(RecomputeConfig, str(REPO / "configs/recompute_gigpo.yaml"), {})
    runs = iter(range(10**6))

    def chain() -> None:
        out = root / f"chain_{next(runs)}"
        runner.run_stage(ResponseRewardsStage(), section(cfg, ResponseRewardSection), {"samples": str(chain_in)},
                         str(out / "rewarded"), batch_rows=cfg.runtime.batch_rows)
        runner.run_stage(AdvantagesStage(), section(cfg, AdvantageSection),
                         {"samples": str(chain_in), "rewarded": str(out / "rewarded")}, str(out / "advantaged"),
                         batch_rows=cfg.runtime.batch_rows)

    got: dict[str, float] = {}
    for name, v2 in (("v2", True), ("v1", False)):
        ray.data.DataContext.get_current().use_datasource_v2 = v2  # what ensure_ray sets from PARQUET_DATASOURCE_V2
        ray.data.read_parquet([str(small)]).take_all()  # warm the workers for this reader
        chain()
        got[f"{name}_read_small_s"] = _median_seconds(lambda: ray.data.read_parquet([str(small)]).take_all(),
                                                      args.repeat)
        got[f"{name}_read_8files_s"] = _median_seconds(lambda: ray.data.read_parquet(eight).take_all(), args.repeat)
        got[f"{name}_chain_s"] = _median_seconds(chain, args.repeat)
        print(f"{name}: " + "  ".join(f"{k}={v:.3f}" for k, v in got.items() if k.startswith(name)), flush=True)
    got["chain_speedup"] = got["v2_chain_s"] / got["v1_chain_s"]
    order = ("v1_read_small_s", "v2_read_small_s", "v1_read_8files_s", "v2_read_8files_s", "v1_chain_s",
             "v2_chain_s", "chain_speedup")
    print("RESULT " + " ".join(f"{k}={got[k]:.3f}" for k in order))


if __name__ == "__main__":
    main()
