"""The local Ray cluster a process starts (stages/cluster.py): Ray Data's Parquet reader it sets reads each file in its
own task, it is stopped when its driver is SIGKILLed, a start that times out is cleaned up and tried again, its log
monitor and worker pool run with rollflow's settings, and every command applies its runtime section's Ray Data memory
bound."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def test_each_file_is_read_by_its_own_task_in_file_order(tmp_path, ray_cluster):
    """The stages' Parquet reader (stages/cluster.py PARQUET_DATASOURCE_V2: Ray Data's first one): three files are
    read by three read tasks (both CPUs busy), the rows in file order."""
    import re

    import ray.data

    rows = 400_000
    files = [str(tmp_path / f"part-{i}.parquet") for i in range(3)]
    for i, f in enumerate(files):
        pq.write_table(pa.table({"x": np.arange(i * rows, (i + 1) * rows, dtype=np.int64)}), f)
    assert not ray.data.DataContext.get_current().use_datasource_v2
    ds = ray.data.read_parquet(files).materialize()
    assert ds.count() == 3 * rows
    assert np.array_equal(ds.to_pandas()["x"].to_numpy(), np.arange(3 * rows)), "file order, then row order"
    read = re.search(r"ReadParquet\S*: (\d+) tasks executed", ds.stats())
    assert read and int(read.group(1)) == 3, ds.stats()


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
        # a process whose command line reads empty has released its memory and is exiting (seen once under a full
        # test run on a loaded machine: still listed after 30 s, its cmdline empty); it runs nothing any more
        while (alive := [p for p, t in family.items() if start_time(p) == t and cmdline(p)]) \
                and time.monotonic() < deadline:
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


def test_the_log_monitor_of_a_started_cluster_lists_its_folder_every_few_seconds(ray_cluster):
    """The session's cluster was started by ensure_ray (tests/conftest.py): its log monitor, a child process of this
    one, runs with the listing interval of stages/cluster.py LOG_MONITOR_ENV (Ray's default lists the session
    folder ten times a second), unless the environment already set one."""
    import pytest

    from stages.cluster import LOG_MONITOR_ENV
    from stages.watchdog import cmdline

    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("the session joined the Ray cluster at RAY_ADDRESS instead of starting one")
    monitors = [p for p in _descendants(os.getpid()) if "log_monitor.py" in cmdline(p)]
    assert len(monitors) == 1, [cmdline(p) for p in _descendants(os.getpid())]
    with open(f"/proc/{monitors[0]}/environ", "rb") as f:
        env = dict(item.split("=", 1) for item in f.read().decode().split("\0") if "=" in item)
    for name, value in LOG_MONITOR_ENV.items():
        assert env.get(name) == os.environ.get(name, value), name


def test_an_idle_task_worker_of_a_started_cluster_is_kept_while_actors_hold_the_cpus(ray_cluster):
    """The session's cluster runs with stages/cluster.py WORKER_POOL_ENV (its raylet's environment says so, unless the
    environment already set them): while an actor holds both CPUs, as a run's engines and training workers do, a
    task's worker idle for 3 s is still there for the next stage's tasks (Ray's default kills an idle worker beyond
    the free CPUs after 1 s)."""
    import time

    import pytest
    import ray

    from stages.cluster import WORKER_POOL_ENV
    from stages.watchdog import cmdline, start_time

    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("the session joined the Ray cluster at RAY_ADDRESS instead of starting one")
    raylets = [p for p in _descendants(os.getpid()) if cmdline(p).split(" ")[0].endswith("raylet")]
    assert len(raylets) == 1, [cmdline(p) for p in _descendants(os.getpid())]
    with open(f"/proc/{raylets[0]}/environ", "rb") as f:
        env = dict(item.split("=", 1) for item in f.read().decode().split("\0") if "=" in item)
    for name, value in WORKER_POOL_ENV.items():
        assert env.get(name) == os.environ.get(name, value), name

    @ray.remote
    def worker_pid() -> int:
        return os.getpid()

    @ray.remote(num_cpus=2, runtime_env={"env_vars": {"ROLLFLOW_TEST_HOLDER": "1"}})  # not the idle worker's env
    class Holder:
        def pid(self) -> int:
            return os.getpid()

    worker = ray.get(worker_pid.remote())
    born = start_time(worker)
    holder = Holder.remote()
    try:
        assert ray.get(holder.pid.remote()) != worker
        time.sleep(3.0)
        alive = start_time(worker) == born and cmdline(worker).startswith("ray::IDLE")
    finally:
        ray.kill(holder)
    if int(env["RAY_idle_worker_killing_time_threshold_ms"]) > 10_000:  # ours, not a shorter one of the caller's
        assert alive, "the idle worker was killed"


def test_every_command_applies_the_runtime_memory_bound(ray_cluster):
    """``runtime.data_memory_mb`` bounds Ray Data's in-flight blocks for the commands that join Ray through
    ``connect`` (rollout, score, train-step, logprobs, values) and through ``start_services`` (train, eval,
    recompute), as the flows' own ``ensure_ray`` does; before, those two left it out and Ray's default applied."""
    import ray.data
    from prefect.settings import PREFECT_SERVER_ALLOW_EPHEMERAL_MODE, temporary_settings

    from flows.cli.common import connect
    from flows.services import start_services
    from schemas.config import RuntimeConfig

    ctx = ray.data.DataContext.get_current()
    before = ctx.execution_options.resource_limits
    try:
        for start, mb in ((connect, 48.0), (start_services, 80.0)):
            with temporary_settings(updates={PREFECT_SERVER_ALLOW_EPHEMERAL_MODE: False}):  # Ray only, no server
                start(RuntimeConfig(num_cpus=2, data_memory_mb=mb))
            limits = ray.data.DataContext.get_current().execution_options.resource_limits
            assert limits.object_store_memory == mb * 2**20, (start.__name__, limits)
    finally:
        ctx.execution_options.resource_limits = before


def test_ray_data_reads_its_limits_soon_after_an_execution_starts_and_then_at_its_own_pace(ray_cluster):
    """Ray Data learns an execution's CPUs from a call answered at its next read of the limits; at Ray's 1 s between
    reads, every stage ran its first task alone for a second (issue 49). ``ensure_ray`` shortens the wait until an
    execution has its limits; after that each read (a call to Ray Data's coordinator actor) comes at Ray's own
    interval, also after ``ensure_ray`` ran again (asked of Ray Data's resource manager objects)."""
    from ray.data._internal.execution.interfaces import ExecutionResources
    from ray.data._internal.execution.resource_manager import ResourceManager

    from stages.cluster import DATA_LIMITS_REFRESH_S, ensure_ray

    ensure_ray(num_cpus=2, progress=False)
    ensure_ray(num_cpus=2, progress=False)
    assert ResourceManager.GLOBAL_LIMITS_UPDATE_INTERVAL_S == DATA_LIMITS_REFRESH_S < 1
    waiting, known = object.__new__(ResourceManager), object.__new__(ResourceManager)
    waiting._global_limits, known._global_limits = ExecutionResources.zero(), ExecutionResources(cpu=2)
    assert waiting.GLOBAL_LIMITS_UPDATE_INTERVAL_S == DATA_LIMITS_REFRESH_S
    assert known.GLOBAL_LIMITS_UPDATE_INTERVAL_S == 1  # Ray 2.60's own
