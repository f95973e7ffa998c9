"""What an idle local Ray cluster or Prefect server costs, per process, in CPU-seconds a minute (issue 44).

Starts the thing as rollflow starts it, lets it do its first work and settle, then reads the CPU time of every
process of this one's tree from /proc (Linux) at the start and end of ``--seconds`` and prints each process's use
scaled to a minute, by kind (benchmarks/suite_cpu.py's kinds and command lines).

    python benchmarks/idle_cpu.py ray              # ensure_ray(num_cpus=2) after one Ray Data job
    python benchmarks/idle_cpu.py prefect          # flows.serving.start_server, the tests' shared server
    python benchmarks/idle_cpu.py ephemeral        # a flow run in Prefect's ephemeral mode, its server kept

The last line: ``RESULT what=... idle_cpu_s_per_min=... processes=...``.

The machine should be otherwise idle: run it under the heavy lock.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.suite_cpu import kind_of  # noqa: E402
from stages.watchdog import cmdline, stat_fields, tree  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def cpu_of(pids: list[int]) -> dict[int, tuple[float, str]]:
    """pid -> (user + system CPU seconds, command line) of the processes still alive."""
    out = {}
    for pid in pids:
        fields = stat_fields(pid)
        if fields:
            out[pid] = ((int(fields[11]) + int(fields[12])) / HZ, cmdline(pid))
    return out


def sample(seconds: float) -> list[tuple[str, str, float]]:
    """(kind, command line, CPU-s a minute) of each process below this one that lived through ``seconds``."""
    start = cpu_of(tree([os.getpid()])[1:])
    time.sleep(seconds)
    end = cpu_of(list(start))
    return sorted(((kind_of(cmd), cmd, (cpu - start[pid][0]) * 60 / seconds) for pid, (cpu, cmd) in end.items()),
                  key=lambda row: -row[2])


def start_ray() -> None:
    """A local cluster as the commands start it, after one small Ray Data job (its helper actors and workers)."""
    import ray.data

    from stages.cluster import ensure_ray

    ensure_ray(num_cpus=2, progress=False)
    ray.data.range(64).map_batches(lambda b: b).materialize()


def start_prefect() -> object:
    """The tests' shared server: ``prefect server start`` through flows.serving.start_server."""
    from flows.serving import start_server
    from stages.ports import free_port

    return start_server("127.0.0.1", free_port(), tempfile.mkdtemp(prefix="idle-prefect-"), timeout_s=300)


def start_ephemeral() -> object:
    """One flow run in Prefect's ephemeral mode (its server subprocess stays up with this process)."""
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="idle-ephemeral-")
    os.environ.pop("PREFECT_API_URL", None)
    from prefect import flow

    flow(lambda: 1, name="idle-probe")()
    from prefect.server.api.server import SubprocessASGIServer

    return SubprocessASGIServer()  # the server the flow started (one per port): its stop() before the RESULT line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["ray", "prefect", "ephemeral"])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=40.0, help="seconds between the start and the sample")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    t0 = time.monotonic()
    handle = {"ray": start_ray, "prefect": start_prefect, "ephemeral": start_ephemeral}[args.what]()
    print(f"started in {time.monotonic() - t0:.1f} s; settling {args.settle:.0f} s", flush=True)
    time.sleep(args.settle)
    rows = sample(args.seconds)
    total = sum(r[2] for r in rows)
    print(f"{'CPU-s/min':>9}  kind / command line  (idle {args.seconds:.0f} s, {len(rows)} processes)")
    for kind, cmd, per_min in rows:
        print(f"{per_min:9.2f}  {kind}: {cmd[:100]}")
    print(f"{total:9.2f}  total")
    if handle is not None:
        handle.stop()
    print(f"RESULT what={args.what} idle_cpu_s_per_min={total:.2f} processes={len(rows)}")


if __name__ == "__main__":
    main()
