"""The local cluster's read settings (stages/cluster.py) take effect in Ray Data's Parquet reader."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stages.cluster import READ_UNIT_MB


def test_each_file_over_the_read_unit_is_its_own_read_task(tmp_path, ray_cluster):
    """Three files of ~0.6 read units each: Ray's default 128 MiB unit would read them as one task on one CPU;
    ours reads them as three (both CPUs busy, a third of the memory per task)."""
    import ray.data

    rows = int(0.6 * READ_UNIT_MB * 2**20 / 8)
    rng = np.random.default_rng(0)
    files = [str(tmp_path / f"part-{i}.parquet") for i in range(3)]
    for f in files:
        pq.write_table(pa.table({"x": rng.random(rows)}), f, compression="none", use_dictionary=False,
                       row_group_size=rows)
    assert all(0.5 * READ_UNIT_MB * 2**20 < pq.read_metadata(f).row_group(0).total_byte_size for f in files)
    ds = ray.data.read_parquet(files).materialize()
    assert ds.num_blocks() == 3
    assert ds.count() == 3 * rows


CHILD = """
import os, sys, time
from stages.cluster import ensure_ray
ensure_ray(num_cpus=1)
import ray

@ray.remote
def pid():
    return os.getpid()

worker = ray.get(pid.remote())
print(worker, flush=True)
time.sleep(600)
"""


def _descendants(root: int) -> list[int]:
    from stages.watchdog import tree

    return [p for p in tree([root]) if p != root]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def test_a_sigkilled_driver_leaves_no_ray_process_behind(tmp_path):
    """The local cluster a process started (GCS, raylet, agents, workers) is gone within seconds of a SIGKILL of
    that process alone — the watchdog's doing, not Ray's: nothing else stops them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from stages.watchdog import start_time
    from tests.spine.test_resume import _child_env

    env = _child_env(tmp_path / "prefect")
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        worker = int(proc.stdout.readline())
        family = {p: start_time(p) for p in _descendants(proc.pid)}
        assert worker in family and len(family) >= 3, family  # gcs_server, raylet, ..., the worker
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while (alive := [p for p, t in family.items() if start_time(p) == t]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, f"left behind: {[(p, _cmdline(p)) for p in alive]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
