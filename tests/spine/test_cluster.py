"""The local Ray cluster a process starts (stages/cluster.py): its read settings take effect in Ray Data's Parquet
reader, it is stopped when its driver is SIGKILLed, and a start that times out is cleaned up and tried again."""

from __future__ import annotations

import os

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


def test_a_sigkilled_driver_leaves_no_ray_process_behind(tmp_path):
    """The local cluster a process started (GCS, raylet, agents, workers) is gone within seconds of a SIGKILL of
    that process alone — the watchdog's doing, not Ray's: nothing else stops them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from stages.watchdog import cmdline, start_time
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
        assert not alive, f"left behind: {[(p, cmdline(p)[:200]) for p in alive]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# A sitecustomize that holds Ray's dashboard agent at interpreter start, the first time only: the raylet's fixed 15 s
# wait for the agent's port file runs out, as on a machine too busy to start the agent in time.
SLOW_AGENT = """
import os, time
with open("/proc/self/cmdline", "rb") as f:
    _argv = f.read().split(b"\\0")
if any(a.endswith(b"dashboard/agent.py") for a in _argv):
    _marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "held")
    if not os.path.exists(_marker):
        open(_marker, "w").close()
        time.sleep(25)
"""

RETRY_CHILD = """
import os, ray
from stages.cluster import ensure_ray
from stages.watchdog import cmdline, tree
ensure_ray(num_cpus=1)
print("worker", ray.get(ray.remote(lambda: os.getpid()).remote()) > 0, flush=True)
print("gcs", sum("gcs_server" in cmdline(p) for p in tree([os.getpid()])[1:]), flush=True)
"""


def test_a_local_start_that_times_out_is_stopped_and_tried_again(tmp_path):
    """Ray's raylet gives its dashboard agent a fixed 15 s to start (ray-project/ray#65983); on a busy machine the
    agent can miss it and ``ray.init`` fails with "timed out during startup". Here the real agent is held back on
    its first start: ensure_ray says so, stops what the failed start left running (its GCS server), and the second
    start gives a working cluster with one GCS."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.spine.test_resume import _child_env

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_AGENT)
    repo = Path(__file__).resolve().parents[2]
    env = {**_child_env(tmp_path / "prefect"), "PYTHONPATH": f"{site}{os.pathsep}{repo}"}
    done = subprocess.run([sys.executable, "-c", RETRY_CHILD], env=env, capture_output=True, text=True, timeout=300,
                          cwd=repo, start_new_session=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (site / "held").exists(), "the agent was held back"
    assert "the local Ray cluster did not start (try 1 of 3" in done.stderr, done.stderr[-3000:]
    assert "worker True" in done.stdout and "gcs 1" in done.stdout, done.stdout
