"""The recompute chain on a two-node Ray cluster against one node, on the same machine (issue 14, item 5).

Both clusters are real ``ray start`` clusters on this machine with the same CPUs in all (tests/ray_nodes.py): one
node of 2 CPUs, or two nodes of 1 CPU each; the chain (benchmarks/recompute.py's ``run_chain``: both stages through
the runner, as ``rollflow recompute`` runs them) joins each through its address, as a user's RAY_ADDRESS would. On
one machine two nodes cannot be faster than one: the ratio is what distribution costs (blocks crossing object stores,
scheduling across raylets), not a speed-up. Ray's record of the two-node run gives the tasks each node ran.

Usage: python benchmarks/recompute_nodes.py --samples 200000 [--rounds 1]
Last line: RESULT one_node_rows_per_s=… two_node_rows_per_s=… ratio=… (ratio = two-node / one-node rows/s)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from recompute import CONFIG, dataset, run_chain, total_tokens  # noqa: E402
from schemas.config import RecomputeConfig, load_config  # noqa: E402
from tests.ray_nodes import NodeSpec, RayNodes, ray_record  # noqa: E402

LAYOUTS = {"one node": [NodeSpec(2, object_store_mb=1600)],
           "two nodes": [NodeSpec(1, object_store_mb=800), NodeSpec(1, object_store_mb=800)]}


def timed_chain(layout: str, samples: Path, out: Path, cfg: RecomputeConfig) -> tuple[float, Counter]:
    """Start the layout's cluster, run the chain on it from this process, and return (seconds, map tasks per
    node); the cluster is stopped after."""
    import ray

    from stages.cluster import ensure_ray

    with RayNodes(LAYOUTS[layout]) as nodes:
        ensure_ray(nodes.address, progress=False, data_memory_mb=cfg.runtime.data_memory_mb)
        try:
            seconds = run_chain(samples, out, cfg)
        finally:
            ray.shutdown()
        record = ray_record(nodes.address, nodes.env)
    names = {node: f"node {i}" for i, node in enumerate(record["nodes"])}
    per_node = Counter(names.get(t["node"], "?") for t in record["tasks"] if "MapBatches" in t["name"])
    return seconds, per_node


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two layouts this many times (best of)")
    ap.add_argument("--cache", type=Path, default=REPO / ".cache/bench/recompute")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cfg = load_config(RecomputeConfig, CONFIG)
    samples = dataset(args.samples, args.cache)
    tokens = total_tokens(samples)
    best: dict[str, float] = {}
    tasks: dict[str, Counter] = {}
    for r in range(args.rounds):
        for layout in LAYOUTS:
            start = time.time()
            seconds, per_node = timed_chain(layout, samples, args.cache / "out_nodes", cfg)
            print(f"round {r + 1} {layout}: chain {seconds:.1f}s (with cluster start/stop {time.time() - start:.1f}s); "
                  f"map tasks per node {dict(sorted(per_node.items()))}", flush=True)
            best[layout] = min(best.get(layout, float("inf")), seconds)
            tasks[layout] = per_node
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; config {CONFIG.name}; "
          f"{args.samples} rows, {tokens} tokens")
    print(f"{'cluster':<34}{'seconds':>10}{'rows/s':>12}{'tokens/s':>14}  map tasks per node")
    for layout, spec in LAYOUTS.items():
        what = f"{layout} ({' + '.join(f'{s.num_cpus} CPU' for s in spec)})"
        print(f"{what:<34}{best[layout]:>10.1f}{args.samples / best[layout]:>12.0f}{tokens / best[layout]:>14.0f}"
              f"  {dict(sorted(tasks[layout].items()))}")
    one, two = args.samples / best["one node"], args.samples / best["two nodes"]
    print(f"RESULT one_node_rows_per_s={one:.0f} two_node_rows_per_s={two:.0f} ratio={two / one:.2f}")


if __name__ == "__main__":
    main()
