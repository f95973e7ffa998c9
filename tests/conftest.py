"""Process-wide test set-up, applied before any test module imports Prefect or Ray.

- Prefect runs in its ephemeral mode with its database in a temporary ``PREFECT_HOME``; a developer's
  ``PREFECT_API_URL`` is ignored (the server tests start their own server). Under pytest-xdist the flows a worker
  runs in its own process report to the workers' shared server once the worker's Ray cluster is up
  (:func:`ray_cluster`); a test marked ``ephemeral_prefect`` keeps the ephemeral mode.
- Logging handlers are bound now, to the session's stderr. The CLI tests call commands through Typer's
  ``CliRunner``, which swaps ``sys.stderr`` for a buffer it closes afterwards; a handler created inside such a call
  (``logging.basicConfig`` in the CLI, Prefect's console handler on its first import) would keep that closed stream
  and print ``--- Logging error ---`` in every later command, whichever test directory ran first.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

_PREFECT_HOME = tempfile.mkdtemp(prefix="rollflow-test-prefect-")
atexit.register(shutil.rmtree, _PREFECT_HOME, True)  # after Prefect's own exit handler stopped its server
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The two test workers (and the runs they start) share two cores: OpenMP threads that sleep at barriers instead of
# spinning, or two torch processes slow each other 4-7x (benchmarks/omp_wait.py; BENCHMARKS.md says why rollflow's
# own default stays libgomp's: a run alone generates faster with it). Children and their Ray workers inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# The tests' Prefect servers (the shared one, the ephemeral ones of the workers and of the `rollflow` children, which
# inherit this environment) without the loop services no test uses: automations (triggers), the events feed (event
# persister, and so its vacuum), late-run marking, worker-pool health (foreman), pause expiry, the clean-up of
# cancelled runs' children and the work pools' clean-up queue (rollflow marks its own runs Cancelled,
# flows/interrupt.py, and serves its deployments without a work pool). Kept: the scheduler (the scheduled deployments
# of tests/flows/test_serving.py and tests/scenarios), the task-run recorder (the tests read task runs) and the
# repossessor (the deployments' concurrency leases). Idle, a `prefect server` used 1.02 CPU-s a minute with them and
# 0.80 without, an ephemeral one 0.83 and 0.72 (benchmarks/idle_cpu.py, 2 cores). A user's keeps Prefect's defaults.
for _service in ("TRIGGERS", "EVENT_PERSISTER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP",
                 "CLEANUP_RECONCILER"):
    os.environ.setdefault(f"PREFECT_SERVER_SERVICES_{_service}_ENABLED", "false")

logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
import prefect.main  # noqa: E402,F401  (runs Prefect's setup_logging() now, outside any CliRunner call)



@pytest.fixture(autouse=True)
def _root_logging():
    """A command run in-process (Typer's runner) routes the root logger for itself (flows/console.py: a console
    handler, the command's log file, INFO, Python warnings as records); the next test gets the set-up above back."""
    import warnings

    root = logging.getLogger()
    handlers, level, showwarning = list(root.handlers), root.level, warnings.showwarning
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    warnings.showwarning = showwarning


@pytest.fixture(scope="session")
def prefect_home() -> str:
    """The temporary ``PREFECT_HOME`` of this test session (the ephemeral database lives there)."""
    return _PREFECT_HOME


@pytest.fixture(scope="session")
def prefect_server(request, tmp_path_factory):
    """ONE real ``prefect server`` (127.0.0.1, a free port, its own home) for the whole test run: the tests that run
    flows in child processes report to it instead of each starting an ephemeral server (about 30 s each on two
    loaded cores). Ephemeral mode keeps its own tests (tests/spine/test_flow.py, tests/spine/test_resume.py).
    Under pytest-xdist the workers share it (see :func:`_shared_prefect_server`); the tests tell their flow runs
    apart by their parameters or deployments, never by counting the server's runs."""
    from flows.serving import start_server
    from stages.ports import free_port
    from tests.prefect_template import seeded

    shared = getattr(request.config, "workerinput", {}).get(_SHARED_DIR)
    if shared:
        yield _shared_prefect_server(Path(shared))
        return
    server = start_server("127.0.0.1", free_port(), seeded(tmp_path_factory.mktemp("prefect-server")), timeout_s=300)
    yield server
    server.stop()


# ---- one Prefect server for all pytest-xdist workers ---------------------------------------------------------------
# An idle `prefect server` costs about 1.4 CPU-s a minute and 12 to start (BENCHMARKS.md): one per worker was 4 % of
# the suite's CPU. The first worker that needs it starts it in a folder the controller made, under a file lock, and
# writes its address and process id there; the others read them; the controller stops it when the run ends.
_SHARED_DIR = "rollflow_shared_dir"
_SERVER_FILE = "prefect-server.json"


@dataclass(frozen=True)
class _SharedServer:
    """The part of flows.serving.LocalServer the tests use, for a server another process started."""

    api_url: str


_SHARED_SERVERS: dict[Path, _SharedServer] = {}  # this process's answer, once: the server lives as long as the run


def _shared_prefect_server(shared: Path) -> _SharedServer:
    """The run's one server: started by the first worker to ask (the lock makes the others wait for it)."""
    import fcntl

    from flows.serving import is_healthy, start_server
    from stages.ports import free_port
    from tests.prefect_template import seeded

    if shared in _SHARED_SERVERS:
        return _SHARED_SERVERS[shared]
    with open(shared / "prefect-server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = shared / _SERVER_FILE
        if record.exists():
            api_url = json.loads(record.read_text())["api_url"]
            assert is_healthy(api_url, timeout_s=10.0), f"the shared Prefect server {api_url} does not answer"
        else:
            server = start_server("127.0.0.1", free_port(), seeded(shared / "prefect-server"), timeout_s=300)
            record.write_text(json.dumps({"api_url": server.api_url, "pid": server.process.pid}))
            api_url = server.api_url
    _SHARED_SERVERS[shared] = _SharedServer(api_url)
    return _SHARED_SERVERS[shared]


def pytest_configure(config: pytest.Config) -> None:
    """The process that starts the run (xdist's controller, or the one pytest process) makes the folder of the run's
    migrated Prefect database (tests/prefect_template.py); the workers and the children find it in the environment."""
    from tests.prefect_template import ENV

    if not hasattr(config, "workerinput"):
        config._rollflow_prefect_template = os.environ[ENV] = tempfile.mkdtemp(prefix="rollflow-test-template-")


@pytest.fixture(scope="session", autouse=True)
def _seeded_prefect_home() -> None:
    """This process's ``PREFECT_HOME`` (its ephemeral server's, and its ``rollflow`` children's) starts from the
    run's migrated database, at the first test, after collection."""
    from tests.prefect_template import seeded

    seeded(Path(_PREFECT_HOME))


def pytest_configure_node(node) -> None:
    """xdist controller: every worker gets the run's shared folder (made for the first)."""
    config = node.config
    if not hasattr(config, "_rollflow_shared_dir"):
        config._rollflow_shared_dir = tempfile.mkdtemp(prefix="rollflow-test-shared-")
    node.workerinput[_SHARED_DIR] = config._rollflow_shared_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    """xdist controller, at the end of the run: stop the shared server and remove the shared folder; the process
    that started the run: remove the migrated database's folder."""
    shared = getattr(config, "_rollflow_shared_dir", None)
    if shared:
        _stop_shared_server(Path(shared))
        shutil.rmtree(shared, ignore_errors=True)
    template = getattr(config, "_rollflow_prefect_template", None)
    if template:
        shutil.rmtree(template, ignore_errors=True)


def _stop_shared_server(shared: Path) -> None:
    """SIGTERM the shared server's process group (it runs in its own session), SIGKILL it if it lingers."""
    import json
    import signal
    import time

    record = shared / _SERVER_FILE
    if not record.exists():
        return
    pid = json.loads(record.read_text())["pid"]
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@pytest.fixture(scope="session")
def cli_env(prefect_server, ray_cluster, tmp_path_factory) -> dict:
    """Environment of a ``rollflow`` child process: this one, with RAY_ADDRESS set to this worker's session cluster
    (``ray_cluster``) and reporting to the session's Prefect server, with the project's model cache. A child joins
    the cluster as a user's command joins an existing one, instead of starting its own: about 18 CPU-seconds and 7 s
    less a command on two cores (Ray's daemons, Ray Data's actors). A killed command joins it too (Ray ends the
    driver's job with it; ``tests.processes.wait_ray_jobs_gone``); the commands whose kill is about their own cluster
    (tests/spine/test_cluster.py's SIGKILLed driver, whose watchdog takes its cluster down) build their environment
    without RAY_ADDRESS."""
    import ray

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
    return {**env, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            "PREFECT_API_URL": prefect_server.api_url, "PREFECT_HOME": str(tmp_path_factory.mktemp("client")),
            "ROLLFLOW_CACHE": os.environ.get("ROLLFLOW_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))}


@pytest.fixture(scope="session")
def default_model() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (converted once from the shipped GGUF into the cache)."""
    from stages.generation.model_store import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random model (plumbing tests)."""
    from stages.generation.model_store import tiny_random_model_dir

    return tiny_random_model_dir()


@pytest.fixture(scope="session")
def ray_cluster(request):
    """ONE local Ray cluster (2 CPUs) for the whole session of this worker, started as the rollflow commands start
    theirs (``ensure_ray``); the stage entry points run on it. Ray Data's DEBUG execution reports are silenced: they
    would flood the captured output of a failing test. Its node declares the custom resource
    ``tests/ray_nodes.py HEAD_RESOURCE``, which nothing asks for but the stages a test pins to the head of the cluster
    when it adds a node (tests/trainflow/test_async_rollout.py's two-node run), through Ray's own variable for a
    node's resources, read where ray.init starts the node."""
    import ray
    import ray.data  # noqa: F401  (configures its loggers on import)
    from ray._private.ray_constants import RESOURCES_ENVIRONMENT_VARIABLE

    from stages.cluster import ensure_ray
    from tests.ray_nodes import HEAD_RESOURCE

    os.environ[RESOURCES_ENVIRONMENT_VARIABLE] = json.dumps({HEAD_RESOURCE: 4})
    try:
        settings = ensure_ray(num_cpus=2, progress=False)
    finally:  # the children (commands that start clusters of their own) do not inherit it
        os.environ.pop(RESOURCES_ENVIRONMENT_VARIABLE, None)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("ray", "prefect", "httpx", "filelock", "asyncio")):
            logging.getLogger(name).setLevel(logging.WARNING)
    with _flows_on_the_shared_server(request):
        yield settings
    ray.shutdown()


@contextlib.contextmanager
def _flows_on_the_shared_server(request):
    """Under pytest-xdist, the flows this worker runs in its own process (the in-process commands, a module's
    reference run) report to the workers' shared Prefect server from now on, as its ``rollflow`` children do
    (``cli_env``): otherwise the first of them starts Prefect's ephemeral server in this process, one per worker
    beside the shared one, living until the worker ends (6-12 CPU-s to start, 1.1-1.4 CPU-s a minute idle;
    BENCHMARKS.md). Prefect's settings context, not the environment: children built from ``os.environ`` still choose
    for themselves. Without xdist (one pytest process, no shared server) nothing changes. A test marked
    ``ephemeral_prefect`` steps back into the ephemeral mode (:func:`_ephemeral_prefect`)."""
    if not getattr(request.config, "workerinput", {}).get(_SHARED_DIR):
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: request.getfixturevalue("prefect_server").api_url}):
        yield


@pytest.fixture(autouse=True)
def _ephemeral_prefect(request):
    """A test marked ``ephemeral_prefect`` (the ephemeral mode's own, tests/spine/test_flow.py) runs its flows in
    Prefect's ephemeral mode, whatever :func:`_flows_on_the_shared_server` set; under pytest-xdist, the ephemeral
    server those tests started is stopped when their module ends (:func:`_stop_ephemeral_server`). Any other test
    under pytest-xdist reports the flows it runs in its own process to the shared server, also before this worker's
    Ray cluster is up (a test's toy flow), and the first such test of the run starts it: otherwise Prefect would
    start an ephemeral server in the worker for the flow (4-8 CPU-s; the worker's first tests ran toy flows before
    any test had asked for the shared server)."""
    shared = getattr(request.config, "workerinput", {}).get(_SHARED_DIR)
    if request.node.get_closest_marker("ephemeral_prefect") is None:
        if not shared:
            yield
            return
        with _prefect_settings(api_url=_shared_prefect_server(Path(shared)).api_url):
            yield
        return
    with _prefect_settings(api_url=None):
        yield
    if shared:
        request.node.getparent(pytest.Module).addfinalizer(_stop_ephemeral_server)


_SETTINGS_MADE: dict[tuple, tuple] = {}  # (base settings' id, PREFECT_* variables, url) -> (base, settings)


@contextlib.contextmanager
def _prefect_settings(api_url: str | None):
    """Prefect's ``temporary_settings`` with ``PREFECT_API_URL`` set to ``api_url`` (``None``: back to its default,
    the ephemeral mode), the settings object built once per base settings, ``PREFECT_*`` variables and URL and
    entered again for each test: building one validates every setting and reads the whole environment again
    (about 25 ms, once per test: 70 CPU-s of a suite's 2,900 tests)."""
    import prefect.context
    from prefect.settings import PREFECT_API_URL

    context = prefect.context.get_settings_context()
    key = (id(context.settings), tuple(sorted(x for x in os.environ.items() if x[0].startswith("PREFECT_"))), api_url)
    made = _SETTINGS_MADE.get(key)
    if made is None or made[0] is not context.settings:
        change = {"updates": {PREFECT_API_URL: api_url}} if api_url else {"restore_defaults": {PREFECT_API_URL}}
        made = _SETTINGS_MADE[key] = (context.settings, context.settings.copy_with_update(**change))
    with prefect.context.SettingsContext(profile=context.profile, settings=made[1]):
        yield


def _stop_ephemeral_server() -> None:
    """Stop this process's ephemeral Prefect server if it runs (idle, 0.7-0.8 CPU-s a minute until the worker
    ends), after Prefect's workers sent it their events and logs; a later flow in ephemeral mode starts a new one."""
    server_module = sys.modules.get("prefect.server.api.server")  # not imported: no ephemeral server was started
    if server_module is None or not server_module.SubprocessASGIServer().running:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    EventsWorker.drain_all(timeout=10, at_exit=False)
    APILogWorker.drain_all(timeout=10, at_exit=False)
    server_module.SubprocessASGIServer().stop()


# ---- running on several workers (pytest-xdist; `make test` runs `-n 2 --dist loadgroup`) ----------------------------
def _loadgroup(config: pytest.Config) -> bool:
    """A worker sees ``loadgroup``; the controller sees ``dist``."""
    return bool(getattr(config.option, "loadgroup", False)) or config.getoption("dist", "no") == "loadgroup"


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup``: the work units are the groups of tests/groups.py, else whole modules, in the order the
    workers collected them (``--no-loadscope-reorder``; see pytest_collection_modifyitems)."""
    if not _loadgroup(config):
        return None
    from xdist.scheduler import LoadScopeScheduling

    from tests.groups import group_of

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup``: the groups with the most slow tests first, so that the longest work starts at once
    and the short modules fill in (stable: ties keep the collection order; a group's tests stay together)."""
    if not _loadgroup(config):
        return
    from tests.groups import group_of

    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(group_of(item.nodeid), []).append(item)
    slow = {name: sum(1 for i in members if i.get_closest_marker("slow") or i.get_closest_marker("vllm"))
            for name, members in groups.items()}
    items[:] = [item for name in sorted(groups, key=lambda name: -slow[name]) for item in groups[name]]
