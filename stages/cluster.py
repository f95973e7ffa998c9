"""Process-wide execution settings, set in one place at flow start and logged (DESIGN.md "Code").

``ensure_ray`` joins the cluster named by the config or ``$RAY_ADDRESS`` (an existing Ray cluster: the code runs
there unchanged) or starts a local one. Ray Data keeps row order so stage outputs are deterministic. It is called once
where a command or a flow starts (the ``rollflow`` commands, ``start_run`` of the training flows, the recompute flow);
the stage entry points only check that it was (:func:`require_ray`), so a stage never starts a cluster with other
settings than its command's.
"""

from __future__ import annotations

import logging
import os
import signal

from schemas.errors import RollflowError
from stages import progress as bars, watchdog
from stages.plan import PlanError, group_fit_problems, local_resources, stage_resource_problems
from stages.watchdog import cmdline, start_time, tree

log = logging.getLogger("rollflow.cluster")


def configure_threads() -> None:
    """One intra-op thread per process next to Ray workers (STACK.md: oversubscription slows torch 6-10x)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")


WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

# A local cluster's log monitor tails the log files of the Ray session folder to publish their new lines to the
# drivers; rollflow starts Ray with log_to_driver=False, so no driver of its own reads them. While the folder holds
# fewer than RAY_LOG_MONITOR_MANY_FILES_THRESHOLD files (1000), Ray 2.60's monitor lists it ten times a second, and
# the folder grows by three files per worker process. With the folder listed every 5 s instead, the monitor of a
# cluster whose folder held 445 files used 0.8 CPU-seconds a minute against 2.9 (measured 2026-11-28, 2 cores; in
# `make test` the log monitors used 51 CPU-seconds). The variables are Ray's own; a value the caller set is kept.
LOG_MONITOR_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "5"}

# A local cluster's worker pool (Ray's raylet reads these variables of Ray's own at its start; a value the caller set is
# kept). A Python worker costs about 1.2 CPU-seconds to start on two loaded cores before it runs anything
# (benchmarks/suite_cpu.py; BENCHMARKS.md, issue 44):
# - prestart_worker_first_driver: when the first driver connects, Ray starts one worker per CPU with the default
#   runtime environment; rollflow gives every job one (WORKER_ENV), which a worker must match to take a task: after
#   five Ray Data stages a prestarted worker still idled unused at 80 MiB.
# - idle_worker_killing_time_threshold_ms: Ray keeps as many idle workers as there are free CPUs and kills the others
#   after 1 s idle. While a run's actors hold the CPUs (the engines, the training workers) that is every idle worker,
#   and the driver's work between two stages (a manifest, a Prefect task) takes longer than a second, so each stage
#   started its tasks' workers anew (a task's worker was gone 3 s after its task while an actor held both CPUs; with
#   30 s, alive: tests/spine/test_cluster.py). Kept for 30 s, the next stage's tasks reuse them (an idle worker that
#   ran Ray Data tasks holds about 0.2 GiB); the workers of a job that ended are still killed at once.
# A subset of the suite (the rollout and spine flows and an evaluation, two pytest workers) started 9 task workers
# instead of 16, and 7 instead of 14, in two pairs of runs: 191 CPU-seconds instead of 200, 186 instead of 205.
WORKER_POOL_ENV = {"RAY_prestart_worker_first_driver": "0", "RAY_idle_worker_killing_time_threshold_ms": "30000"}

# How often Ray Data re-reads the CPUs and memory an execution may use (ResourceManager.GLOBAL_LIMITS_UPDATE_INTERVAL_S,
# 1 s in Ray 2.60). It learns them from its autoscaling coordinator by a non-blocking call whose answer it takes at the
# next read, so every execution runs with limits of zero until the second read: one task (the one Ray Data lets an
# idle operator start) for its first second, whatever the cores — at 50k rows the advantages stage's first file ran
# alone for 1.0 s of its 3 s of tasks (BENCHMARKS.md, issue 49). Read every 0.1 s until the first answer, the second
# task starts 0.1 s in; then at Ray's own interval: each read is a call to the coordinator actor, and at 0.1 s
# throughout an execution cost 0.85 CPU-s more per 35 s (the coordinator, the driver and the raylet; 20 executions
# of 1.7 s on 2 cores). The limits themselves, and so the `data_memory_mb` budget, are unchanged.
DATA_LIMITS_REFRESH_S = 0.1

# Ray Data's Parquet reader. Ray 2.60's default (datasource V2) lists the files and reads their footers in extra Ray
# tasks and actors before the first block: about 3 s per ``read_parquet`` of a one-file, 4-row table here (2 CPUs,
# warm workers), against 0.2 s for the first reader (V1), and every stage reads its inputs once or more
# (benchmarks/parquet_read.py, BENCHMARKS.md). V1 reads each file in its own task (files beyond the read
# parallelism share tasks), in the order given, on a local cluster and a joined one alike.
PARQUET_DATASOURCE_V2 = False


class _HideSpuriousCpuWarning(logging.Filter):
    """Ray Data warns "The Ray cluster currently does not have any available CPUs. The Dataset job will hang unless
    more CPUs are freed up" whenever ``ray.available_resources()`` shows no free CPU as a dataset executes. Every stage
    write runs ``materialize()``, which checks again on its already computed result (no task left to run) right after
    the stage's actors and write tasks held every CPU of a 2-CPU machine, before Ray has released them, so the warning
    appears after a stage that finished. The real case — actors that hold the CPUs for good — is refused before any
    stage runs, with the fix (the run's resource plan, ``check_plan`` in flows/runkit.py and stages/plan.py; the forward
    stages' ``cpus_per_actor`` check).
    The record is marked ``hide``: it stays in the log file, off the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "does not have any available CPUs" in str(record.msg):
            record.hide = True
        return True


def route_ray_logs() -> None:
    """Ray's driver-side loggers print to stderr through their own handlers and do not propagate ("ray" since
    ``import ray``, "ray.data" since ``import ray.data``): drop those console handlers (Ray Data's file in the Ray
    session folder stays) and let the records propagate to the root logger, whose handlers decide where they go (the
    CLI: the command's log file; the console with ``--verbose``, see flows/console.py). Idempotent."""
    import ray.data  # noqa: F401  (configures the "ray.data" logger on import)

    for name in ("ray", "ray.data"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True
    # Ray Data logs at DEBUG into its session file; propagated, DEBUG records would reach handlers without a level
    data_logger = logging.getLogger("ray.data")
    if data_logger.level < logging.INFO:
        data_logger.setLevel(logging.INFO)
    dataset_logger = logging.getLogger("ray.data.dataset")
    if not any(isinstance(f, _HideSpuriousCpuWarning) for f in dataset_logger.filters):
        dataset_logger.addFilter(_HideSpuriousCpuWarning())
    _route_raylet_messages()


def _route_raylet_messages() -> None:
    """The raylet's messages to the driver (e.g. "N PYTHON worker processes have been started ... 4x the maximum
    expected startup concurrency" when a flow starts its actor pools on a 2-CPU machine: Ray queues the starts, nothing
    fails) are printed to stdout by a thread of Ray's driver even with ``log_to_driver=False``. They go to the
    "ray.raylet" logger instead, i.e. the command's log file (the console with ``--verbose``). Other messages pass
    through unchanged. Idempotent."""
    from ray._private import worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_rollflow_routed", False):
        return

    def print_to_stdstream(data, ignore_prefix: bool):
        if data.get("pid") == "raylet":
            for line in data.get("lines", []):
                logging.getLogger("ray.raylet").warning("%s", line)
            return
        original(data, ignore_prefix)

    print_to_stdstream._rollflow_routed = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream


def watch_local_cluster() -> None:
    """stages/watchdog.py on this process, told the processes of the local Ray cluster it just started: when the
    process dies (SIGKILL included) the cluster dies with it. A cluster joined through an address is never watched
    (its processes are not this one's descendants: not ours to stop)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is not None:
        watchdog.start(tuple(info.process.pid for infos in node.all_processes.values() for info in infos
                             if info.process))


# Ray's raylet waits a fixed 15 s for its dashboard agent to write its port file, then exits; ray.init reports "The
# current node timed out during startup" 30 s later (ray-project/ray#65983). On a loaded 2-core machine the agent's
# imports alone can take that long, so a local start is tried again, after the failed one's processes are stopped.
LOCAL_START_TRIES = 3
_STARTUP_TIMEOUT = "timed out during startup"


def _start_local_ray(num_cpus: int | None) -> None:
    """``ray.init`` of a new local cluster of ``num_cpus`` CPUs, up to LOCAL_START_TRIES times when Ray's own start-up
    times out (see above); any other error, or the last time-out, is raised with the cause and the fix."""
    import ray

    for name, value in {**LOG_MONITOR_ENV, **WORKER_POOL_ENV}.items():  # read by the processes ray.init starts
        os.environ.setdefault(name, value)
    for attempt in range(1, LOCAL_START_TRIES + 1):
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": WORKER_ENV})
            return
        except Exception as err:  # noqa: BLE001 (Ray raises a bare Exception for this time-out)
            if _STARTUP_TIMEOUT not in str(err):
                raise
            stopped = _stop_failed_start()
            if attempt == LOCAL_START_TRIES:
                from ray._common.utils import get_default_ray_temp_dir  # RAY_TMPDIR, TMPDIR or /tmp, then "ray"

                raylet_log = os.path.join(get_default_ray_temp_dir(), "session_latest", "logs", "raylet.out")
                raise RollflowError(
                    f"the local Ray cluster did not start, {LOCAL_START_TRIES} times ({err}): its raylet waits 15 s "
                    "for its agents, and this machine was too busy for them to start in time (the raylet's error is "
                    f"in {raylet_log}); try again when the machine is less loaded, or "
                    "start a cluster with `ray start --head` and point RAY_ADDRESS at it") from None
            log.warning("the local Ray cluster did not start (try %d of %d: its agents were too slow for the "
                        "raylet's 15 s wait, a busy machine); stopped its %d processes, starting it again",
                        attempt, LOCAL_START_TRIES, stopped)


def _stop_failed_start() -> int:
    """SIGKILL the processes a failed local ``ray.init`` of this process left running (its GCS server, log monitor,
    dashboard, reaper, and any agent still alive): this process's descendants started from Ray's package; returns
    how many. Ray keeps no handle on them after the failure. Linux only (/proc); elsewhere 0."""
    import ray

    if not os.path.isdir("/proc"):
        return 0
    package = os.path.dirname(os.path.abspath(ray.__file__)) + os.sep
    stopped = 0
    for pid in tree([os.getpid()])[1:]:
        if package in cmdline(pid) and start_time(pid) is not None:
            try:
                os.kill(pid, signal.SIGKILL)
                stopped += 1
            except ProcessLookupError:
                pass
    return stopped


def ensure_ray(address: str | None = None, num_cpus: int | None = None, progress: bool | None = None,
               data_memory_mb: float | None = None) -> dict:
    """Connect to (or start) Ray and set the Ray Data context. Returns the settings used, for logging.
    ``progress``: Ray Data's own progress bars (None: only with ``--verbose`` on a terminal, see stages/progress.py).
    ``data_memory_mb``: bound on the blocks Ray Data keeps in flight in the object store (None: Ray's default, which
    grows with the object store)."""
    import ray
    import ray.data

    configure_threads()
    route_ray_logs()
    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV})
        else:
            _start_local_ray(num_cpus)
            watch_local_cluster()
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.use_datasource_v2 = PARQUET_DATASOURCE_V2
    if data_memory_mb:
        from ray.data._internal.execution.interfaces import ExecutionResources

        ctx.execution_options.resource_limits = ExecutionResources(object_store_memory=float(data_memory_mb) * 2**20)
    _refresh_data_limits(DATA_LIMITS_REFRESH_S)
    ctx.enable_progress_bars = bars.ray_data_bars() if progress is None else progress
    ctx.print_on_execution_start = False
    settings = {"ray_address": address or "local", "cpus": ray.cluster_resources().get("CPU"),
                "preserve_order": True, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                "parquet_reader": "v2" if PARQUET_DATASOURCE_V2 else "v1"}
    log.info("execution settings: %s", settings)
    return settings


class _LimitsRefresh:
    """``ResourceManager.GLOBAL_LIMITS_UPDATE_INTERVAL_S`` as Ray Data reads it, per execution (its resource manager):
    ``first`` seconds while the execution's limits are still all zero (it has no answer from the coordinator yet),
    ``then`` seconds after. Read on the class, ``first``."""

    def __init__(self, first: float, then: float):
        self.first, self.then = first, then

    def __get__(self, manager, owner=None) -> float:
        limits = getattr(manager, "_global_limits", None)
        return self.first if limits is None or limits.is_zero() else self.then


def _refresh_data_limits(seconds: float) -> None:
    """Have Ray Data re-read an execution's resource limits every ``seconds`` until it has them (see
    DATA_LIMITS_REFRESH_S), then at Ray's own interval; a Ray without that class attribute is left as it is."""
    from ray.data._internal.execution.resource_manager import ResourceManager

    current = ResourceManager.__dict__.get("GLOBAL_LIMITS_UPDATE_INTERVAL_S")
    if isinstance(current, _LimitsRefresh):
        current.first = seconds
    elif isinstance(current, (int, float)):
        ResourceManager.GLOBAL_LIMITS_UPDATE_INTERVAL_S = _LimitsRefresh(seconds, float(current))


def connect_runtime(runtime) -> dict:
    """:func:`ensure_ray` with every cluster setting of a config's ``runtime`` section (``schemas.config.RuntimeConfig``):
    the cluster's address, the local cluster's CPUs and the bound on Ray Data's in-flight blocks
    (``data_memory_mb``). The one way a command or a service start applies its ``runtime`` section."""
    return ensure_ray(runtime.ray_address, runtime.num_cpus, data_memory_mb=runtime.data_memory_mb)


def cluster_resources(address: str | None = None, num_cpus: int | None = None) -> dict[str, float]:
    """The resources a run would get, without starting anything: the Ray cluster's (``ray.cluster_resources()``) when
    ``address`` or ``$RAY_ADDRESS`` names one (joined, read, left), else this machine's as a local cluster of
    ``num_cpus`` CPUs (default: all) would declare them (stages/plan.py, :func:`local_resources`)."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address or address == "local":
        return local_resources(num_cpus)
    import ray

    if ray.is_initialized():
        return {k: float(v) for k, v in ray.cluster_resources().items()}
    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as err:  # noqa: BLE001 (no cluster there: a user error with the fix)
        raise RollflowError(f"cannot join the Ray cluster at {address} ({type(err).__name__}: {err}); start it, fix "
                            "RAY_ADDRESS / runtime.ray_address, or plan for given resources with --cpus N --gpus N") \
            from None
    try:
        return {k: float(v) for k, v in ray.cluster_resources().items()}
    finally:
        ray.shutdown()


def check_stage_resources(runtime) -> None:
    """Refuse a config whose ``runtime.stage_resources`` names a custom resource that no node of the joined cluster
    declares (or too little of it): Ray would keep the pinned stage waiting forever. Call after :func:`ensure_ray`;
    the training flows check the same in their resource plan (stages/plan.py)."""
    if runtime.stage_resources:
        _refuse(stage_resource_problems(runtime, _cluster_totals()))


def check_group_fits(workers: int, cpus: float, gpus: float, fields: tuple[str, str, str, str]) -> None:
    """Refuse a command's worker group that the joined cluster cannot place even when idle (stages/plan.py
    :func:`group_fit_problems`), before it starts: Ray would keep it waiting until its placement timeout. Call after
    :func:`ensure_ray`."""
    _refuse(group_fit_problems(workers, cpus, gpus, _cluster_totals(), fields))


def _cluster_totals() -> dict[str, float]:
    """What the joined cluster's nodes declare, in all (``ray.cluster_resources()``)."""
    import ray

    return {k: float(v) for k, v in ray.cluster_resources().items()}


def _refuse(problems: list[str]) -> None:
    """A PlanError of ``problems`` (each with its fix), if there are any."""
    if problems:
        raise PlanError("; and ".join(problems))


def require_ray(who: str) -> None:
    """Raise a clear error when this process has no Ray connection: the stage entry points run on the cluster their
    command or flow started (:func:`ensure_ray`), never on one that Ray Data would start by itself."""
    import ray

    if not ray.is_initialized():
        raise RollflowError(f"{who} runs its work on a Ray cluster, and this process has not connected to one; call "
                            "stages.cluster.ensure_ray(address, num_cpus) first (the rollflow commands and flows do "
                            "it when they start)")
