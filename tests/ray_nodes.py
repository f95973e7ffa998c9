"""A real multi-node Ray cluster on this machine, for the multi-node tests and benchmarks (issue 14, item 3).

Each node is a ``ray start --block`` child process in its own session (the head first, then
``ray start --address=HEAD``; or only nodes joining a running cluster, such as the test session's own), with its
own CPUs and custom resources, on ports chosen free for it (GCS, node manager, object manager, agents, metrics,
workers: never Ray's fixed defaults, which other clusters on this machine may hold) and a temporary folder of its
own. :meth:`RayNodes.stop` ends exactly the processes of these nodes: the ``ray start`` processes and their
descendants (GCS, raylets, agents, workers), recorded with their start times so that a reused process id is never
touched — never ``ray stop``, which stops every Ray cluster of the user.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from stages.watchdog import kill_known, start_time, tree

RAY = str(Path(sys.executable).with_name("ray"))
REPO = str(Path(__file__).resolve().parents[1])
# A port :func:`free_ports` found free may be taken before the node binds it (another process of the machine binding
# port 0, such as a Ray cluster starting on the other test worker: seen once, the GCS's gRPC server of a head node
# failed so): the cluster is then started again on new ports, at most PORT_TRIES times in all.
PORT_TAKEN = ("Address already in use", "Failed to start the grpc server")
PORT_TRIES = 3
# The custom resource of the test session's own cluster (tests/conftest.py ray_cluster), the head of a cluster that
# nodes join (RayNodes(join=...)): stages are pinned to the head by it.
HEAD_RESOURCE = "rollflow_head"
# Ray's workers and drivers send their task events to the GCS once a second (Ray's task_events_report_interval_ms,
# 1000): a command's last tasks are in the GCS's record this long after it ended.
TASK_EVENTS_FLUSH_S = 3.0


@dataclass(frozen=True)
class NodeSpec:
    """One node: its logical CPUs and custom resources (``{"trainer_node": 1}``)."""

    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)
    object_store_mb: int = 400


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free now (all bound at once, so the OS cannot hand one out twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ports(ports: list[int], head: bool) -> list[str]:
    """Every port a node opens, from ``ports`` (Ray's defaults are fixed numbers: 8265, 10001, 52365, ...)."""
    names = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
    if head:
        names += ["--dashboard-port", "--ray-client-server-port"]
    args = [a for name, port in zip(names, ports) for a in (name, str(port))]
    return args + ["--min-worker-port", "0", "--max-worker-port", "0"] + (["--include-dashboard=false"] if head else [])


class RayNodes:
    """Start ``specs[0]`` as the head and the others as worker nodes joining it; ``address`` is the head's GCS
    address (what ``RAY_ADDRESS`` takes). With ``join`` (a running cluster's GCS address, e.g. the test session's
    own cluster, to which this process is connected) every spec is a worker node joining that cluster instead, and
    :meth:`stop` ends these nodes alone. A context manager: the nodes are stopped on exit, also on failure."""

    def __init__(self, specs: list[NodeSpec], env: dict | None = None, timeout_s: float = 120,
                 join: str | None = None):
        self.specs, self.timeout_s, self.join = specs, timeout_s, join
        env = {k: v for k, v in (env or os.environ).items() if k != "RAY_ADDRESS"}  # ray start takes --address
        self.env = {**env, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
        self.root = Path(tempfile.mkdtemp(prefix="rf-ray-", dir="/tmp"))  # short: Ray's socket paths are limited
        self.address: str = join or ""
        self._procs: list[subprocess.Popen] = []
        self._known: dict[int, int] = {}  # pid -> start time of every process of this cluster seen so far
        self._watchdog: int | None = None  # the write end of the watchdog's pipe
        # the watchdog itself, held until stop() reaps it (a Popen dropped while its process runs is a
        # ResourceWarning, "subprocess N is still running", which reached make test's console once)
        self._watchdog_proc: subprocess.Popen | None = None

    def __enter__(self) -> "RayNodes":
        tries = 1
        while True:
            try:
                self.start()
                return self
            except BaseException as err:
                self.stop()
                if tries == PORT_TRIES or not any(words in str(err) for words in PORT_TAKEN):
                    raise
            tries += 1
            self.root = Path(tempfile.mkdtemp(prefix="rf-ray-", dir="/tmp"))  # stop() removed the last one

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        ports = free_ports(1 + 8 * len(self.specs))
        port = ports[0]
        before = 0 if self.join is None else _alive_nodes_here(self.join)
        self.address = self.join or f"127.0.0.1:{port}"
        for i, spec in enumerate(self.specs):
            head = i == 0 and self.join is None
            where = ["--head", "--port", str(port), "--node-ip-address", "127.0.0.1"] if head else \
                ["--address", self.address, "--node-ip-address", "127.0.0.1"]
            cmd = [RAY, "start", "--block", *where, "--num-cpus", str(spec.num_cpus), "--num-gpus", "0",
                   "--resources", json.dumps(spec.resources),
                   "--object-store-memory", str(spec.object_store_mb * 2**20), "--temp-dir", str(self.root / "tmp"),
                   "--disable-usage-stats", *_ports(ports[1 + 8 * i:9 + 8 * i], head)]
            log = open(self.root / f"node{i}.log", "w")
            self._procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True))
            log.close()
            self._wait_started(i)
        self._watch()
        self._wait_nodes(before + len(self.specs))
        return self.address

    def _watch(self) -> None:
        """stages/watchdog.py on the nodes: if this process dies without :meth:`stop` (a SIGKILLed test run), the
        cluster goes with it instead of outliving it (the nodes run in sessions of their own)."""
        read_end, self._watchdog = os.pipe()
        self._watchdog_proc = subprocess.Popen(
            [sys.executable, "-m", "stages.watchdog", str(read_end), *(str(p.pid) for p in self._procs)],
            pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd=REPO)
        os.close(read_end)

    def _wait_started(self, i: int) -> None:
        """Wait until ``ray start`` of node ``i`` says its node runs (the next node can then join it)."""
        deadline = time.monotonic() + self.timeout_s
        while "Ray runtime started" not in self.log(i):
            self._record()
            if self._procs[i].poll() is not None:
                raise RuntimeError(f"ray start of node {i} exited: {self.log(i)[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {i} never started: {self.log(i)[-3000:]}")
            time.sleep(0.2)

    def _wait_nodes(self, count: int) -> None:
        """Wait until ``count`` nodes are alive in the cluster (asked through the GCS, as ``ray status`` does: in
        this process when it joined the cluster, else in a child)."""
        probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                 "print(sum(1 for n in ray.nodes() if n['Alive']))")
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._record()
            dead = [i for i, p in enumerate(self._procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"ray start of node {dead[0]} exited: {self.log(dead[0])[-3000:]}")
            if self.join is not None:
                alive, error = _alive_nodes_here(self.join), ""
            else:
                out = subprocess.run([sys.executable, "-c", probe, self.address], env=self.env, capture_output=True,
                                     text=True, timeout=self.timeout_s)
                alive = int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else -1
                error = out.stderr[-2000:]
            if alive == count:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} nodes never came up at {self.address}: {error}")
            time.sleep(1.0)

    def log(self, i: int) -> str:
        return (self.root / f"node{i}.log").read_text(errors="replace")

    def _record(self) -> None:
        """Remember every living process of the cluster (the node's processes and workers come and go)."""
        for pid in tree([p.pid for p in self._procs]):
            if pid not in self._known and (t := start_time(pid)) is not None:
                self._known[pid] = t

    def stop(self) -> None:
        """End this cluster's processes: SIGTERM every process of it (the ``ray start`` processes, GCS, raylets,
        agents, workers), then SIGKILL whatever is left after a short grace period (a test cluster keeps nothing
        worth a graceful shutdown; Ray's GCS and raylet often outlive SIGTERM); remove the temporary folder."""
        self._record()
        for pid, started in self._known.items():
            if start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(start_time(p) == t for p, t in self._known.items()):
            self._record()
            time.sleep(0.3)
        self._record()
        kill_known(self._known)
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        if self._watchdog is not None:  # the watchdog wakes, finds nothing left and exits
            os.close(self._watchdog)
            self._watchdog = None
        if self._watchdog_proc is not None:
            try:
                self._watchdog_proc.wait(10)
            except subprocess.TimeoutExpired:
                self._watchdog_proc.kill()
                self._watchdog_proc.wait()
            self._watchdog_proc = None
        shutil.rmtree(self.root, ignore_errors=True)

    def alive(self, wait_s: float = 10.0) -> list[int]:
        """Processes of this cluster still alive (empty after :meth:`stop`), after waiting up to ``wait_s`` for those
        already sent SIGKILL to be gone: on a loaded machine a killed process takes a moment to exit (seen: one Ray
        process still there right after :meth:`stop`, gone a moment later); one never killed stays and is listed."""
        deadline = time.monotonic() + wait_s
        while True:
            left = [p for p, t in self._known.items() if start_time(p) == t]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.2)


def _alive_nodes_here(address: str) -> int:
    """The alive nodes of the cluster at ``address``, asked through this process's connection to it."""
    import ray

    assert ray.is_initialized() and ray.get_runtime_context().gcs_address == address, \
        f"nodes join the cluster at {address}, to which this process must be connected"
    return sum(1 for n in ray.nodes() if n["Alive"])


def record_here(*bounds: float) -> list[dict]:
    """``{"nodes": {node id: [its resource names]}, "tasks": [{name, resources, job, node, actor}, ...]}`` for each
    window between consecutive ``bounds`` (``time.time()`` values; default one window, all time): what Ray's GCS
    recorded of the tasks and actor methods of the cluster this process is connected to (an actor's creation task
    placed on its actor's node) that it first saw in the window (a task by the earliest timestamp of its state
    changes, which Ray takes from the same clock). Every command a test runs in its own process is one Ray job, the
    test process's: the time, not the job, tells one command's tasks from another's. The record is read once for all
    windows. Ray's state API (ray.util.state) asks the dashboard, which needs packages that the lock does not install
    (aiohttp_cors, ...); the GCS holds the same records, read through Ray's own accessor."""
    from ray._private import state

    bounds = bounds or (0.0, float("inf"))
    nodes = {n["NodeID"]: sorted(k for k in n["Resources"] if not k.startswith("node:")) for n in state.nodes()}
    actors = {a["ActorID"]: a["Address"]["NodeID"] for a in state.actors().values()}
    windows: list[list[dict]] = [[] for _ in bounds[1:]]
    for event in state.state._get_all_task_events():
        stamps = event.state_updates.state_ts_ns.values()
        window = bisect.bisect_right(bounds, min(stamps) / 1e9) - 1 if stamps else -1
        if not 0 <= window < len(windows):
            continue
        info = event.task_info
        node = event.state_updates.node_id.hex() if event.state_updates.node_id else ""
        actor = info.actor_id.hex() if info.actor_id else ""
        windows[window].append({"name": info.name, "resources": dict(info.required_resources),
                                "job": event.job_id.hex(), "node": node or actors.get(actor, ""), "actor": actor})
    return [{"nodes": nodes, "tasks": rows} for rows in windows]


# Run in a child process (a test process may hold another Ray connection): record_here of the cluster at an address.
_RECORD = r"""
import json, sys
import ray
sys.path.insert(0, sys.argv[2])
from tests.ray_nodes import record_here

ray.init(address=sys.argv[1], log_to_driver=False)
(record,) = record_here()
ray.shutdown()
print(json.dumps(record))
"""


def ray_record(address: str, env: dict) -> dict:
    """:func:`record_here` of every task of the cluster at ``address``, read in a child process."""
    out = subprocess.run([sys.executable, "-c", _RECORD, address, REPO], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def asks_for(task: dict, resource: str) -> bool:
    """Whether a recorded task asked for ``resource``: by name, or inside a placement group (the training workers),
    where Ray renames it ``<resource>_group_<pg id>`` / ``<resource>_group_<bundle>_<pg id>``."""
    return any(name == resource or name.startswith(f"{resource}_group_") for name in task["resources"])


def nodes_of(record: dict, resource: str) -> set[str]:
    """The nodes on which the recorded tasks and actors that asked for the custom ``resource`` ran (each must have
    run somewhere: a task without a node is reported as '')."""
    return {t["node"] for t in record["tasks"] if asks_for(t, resource)}


def names_of(record: dict, resource: str) -> set[str]:
    """The names of the recorded tasks that asked for ``resource`` (an actor's: its class, e.g. ``TrainWorker``)."""
    return {t["name"].split(".")[0].split(":")[-1] for t in record["tasks"] if asks_for(t, resource)}


def node_with(record: dict, resource: str) -> str:
    """The one node that declares ``resource``."""
    (node,) = [n for n, names in record["nodes"].items() if resource in names]
    return node
