"""A local Prefect server and scheduled deployments of rollflow's flows.

``start_server`` spawns ``prefect server start`` (its SQLite database and log under ``home``), waits for
``/api/health`` and returns a handle that stops the server's whole process group.

``deploy`` registers a deployment of a flow with a cron or interval schedule on a Prefect server and serves it: the
calling process polls the server for due runs and executes each in a child process (Prefect's ``flow.serve``), one at
a time (``limit=1``, and the deployment's concurrency limit ``global_limit=1`` across every process serving it: a
nightly recompute or a training run never overlaps itself; a tick due while the previous one runs waits for it). A
training deployment serves :func:`advance_run`: every tick continues the run for ``max_steps`` more iterations. It blocks until interrupted; on
Ctrl-C/SIGTERM it stops and pauses the schedule, so no runs pile up while nobody executes them. In production:

    rollflow server --port 4200                       # or any Prefect server / Prefect Cloud workspace
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    rollflow deploy --config configs/recompute_gigpo.yaml --input runs/x/samples --output runs/x/nightly \\
        --cron '0 3 * * *' --name nightly                # keep it running (tmux, systemd, a container)

Runs are visible in the Prefect UI (``http://127.0.0.1:4200``) and can also be started by hand there or with
``prefect deployment run 'recompute/nightly'``. Prefect starts flow runs with multiprocessing's spawn method: a script
that calls ``deploy`` needs an ``if __name__ == "__main__":`` guard (the ``rollflow`` command has one).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zoneinfo
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow

from flows.console import LogFileHandler
from flows.pipelines import pipeline_of
from flows.report import write_report
from flows.runkit import publish_run, run_log
from schemas.config import validate_config
from schemas.errors import ConfigError, RollflowError

log = logging.getLogger("rollflow.serving")


class ServerError(RollflowError):
    """A Prefect server cannot be started or reached."""


# ---- the server -------------------------------------------------------------------------------------------------

def port_in_use(host: str, port: int) -> bool:
    """Whether ``host:port`` cannot be bound (something listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def is_healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``GET {api_url}/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class LocalServer:
    """A running ``prefect server start`` in its own process group. ``stop()`` ends the group."""

    process: subprocess.Popen
    host: str
    port: int
    home: Path
    log_path: Path
    _log_file: Any = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM the server's process group, SIGKILL it after ``timeout_s``; returns the exit status."""
        if self.running():
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.process.wait()

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_env(home: Path) -> dict[str, str]:
    """The server's environment: this one with its database/home under ``home`` and telemetry off."""
    env = dict(os.environ)
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    return env


def start_server(host: str = "127.0.0.1", port: int = 4200, home: str | Path | None = None,
                 timeout_s: float = 120.0) -> LocalServer:
    """Spawn ``prefect server start --host HOST --port PORT`` with ``PREFECT_HOME=home`` (default
    ``$PREFECT_HOME``, which flows.settings.configure() puts under the project's cache), wait until
    ``/api/health`` answers and return the handle. Raises ServerError if the port is taken, the server exits,
    or it is not healthy within ``timeout_s``."""
    if port_in_use(host, port):
        raise ServerError(f"prefect server: port {port} on {host} is already in use (another Prefect server? "
                          f"check http://{host}:{port}); pass another port (--port) or stop what listens there")
    home = Path(home or os.environ.get("PREFECT_HOME") or Path.cwd() / ".prefect").resolve()
    if home.exists() and not home.is_dir():
        raise ServerError(f"prefect server: home {home} is a file; pass a folder (new or existing) as --home")
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / f"server-{port}.log"
    log_file = open(log_path, "ab")
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)]
    process = subprocess.Popen(command, env=server_env(home), stdout=log_file, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    server = LocalServer(process, host, port, home, log_path, log_file)
    deadline = time.monotonic() + timeout_s
    while not is_healthy(server.api_url):
        if not server.running():
            server.stop()
            raise ServerError(f"prefect server on {host}:{port} exited with status {process.returncode} before it "
                              f"was healthy; its log {log_path} ends with:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            server.stop()
            raise ServerError(f"prefect server on {host}:{port} was not healthy after {timeout_s:.0f}s (the "
                              f"database migrates on first start; a loaded machine is slower): retry with a longer "
                              f"timeout; its log {log_path} ends with:\n{_tail(log_path)}")
        time.sleep(0.5)
    log.info("prefect server healthy at %s (home %s)", server.url, home)
    return server


# ---- deployments ------------------------------------------------------------------------------------------------

def make_schedule(cron: str | None = None, interval_s: float | None = None, timezone: str | None = None):
    """A Prefect schedule from exactly one of ``cron`` (5 fields) or ``interval_s``; ConfigError otherwise."""
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.schedules import Cron, Interval
    from pydantic import ValidationError

    if timezone is not None:
        check_timezone(timezone)
    if (cron is None) == (interval_s is None):
        raise ConfigError("deploy: give exactly one schedule, --cron '0 3 * * *' (cron, in UTC unless --timezone) "
                          "or --interval SECONDS")
    if cron is not None:
        try:
            CronSchedule(cron=cron, timezone=timezone)
        except ValidationError as err:
            raise ConfigError(f"deploy: --cron {cron!r} is not a valid cron schedule "
                              f"({err.errors()[0]['msg']}); use 5 fields: minute hour day month weekday, "
                              "e.g. '0 3 * * *' for 03:00 every day") from err
        return Cron(cron, timezone=timezone)
    if not interval_s > 0:
        raise ConfigError(f"deploy: --interval {interval_s} must be > 0 seconds")
    return Interval(dt.timedelta(seconds=interval_s), timezone=timezone)


def check_timezone(name: str) -> None:
    """``--timezone`` must name an IANA time zone (the tz database Prefect's schedules read); else a ConfigError that
    names --timezone (Prefect's own refusal reads as a bad --cron)."""
    try:
        zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ConfigError(f"deploy: --timezone {name!r} is not a time zone name; use an IANA name such as UTC, "
                          "Europe/Paris or America/New_York") from None


def resolve_api_url(api_url: str | None = None) -> str:
    """``api_url`` or ``$PREFECT_API_URL``, checked healthy; ServerError naming the fix otherwise."""
    api_url = api_url or os.environ.get("PREFECT_API_URL")
    if not api_url:
        raise ServerError("deploy: no Prefect server given; a scheduled deployment lives on a server: start one "
                          "with `rollflow server` and pass --api-url http://127.0.0.1:4200/api (or set "
                          "PREFECT_API_URL)")
    if not is_healthy(api_url, timeout_s=5.0):
        raise ServerError(f"deploy: the Prefect server at {api_url} does not answer {api_url}/health; start it "
                          "with `rollflow server` or fix --api-url / PREFECT_API_URL")
    return api_url


# ---- scheduled training runs that advance ------------------------------------------------------------------------

@flow(name="advance-run")
def advance_run(cfg: dict, iterations: int | None = None) -> dict:
    """One tick of a scheduled training run: continue the run folder of ``cfg`` (its pipeline's flow) for
    ``iterations`` more iterations (default: the config's ``max_steps``) after its last committed one, or start it.
    As ``rollflow train`` does, the tick appends to the run's log (``<run>/logs/rollflow.log``), writes its report
    at the end and, for a run folder on an object store, uploads both (also after a failure). A tick killed half-way
    is resumed by the next one (its committed stages are skipped). Returns the flow's summary plus
    ``from_iteration`` and ``report`` (the report page)."""
    pipeline = pipeline_of(cfg, "deployment parameters")
    config = validate_config(pipeline.config_model(), cfg, "deployment parameters")
    run, log_file = run_log(config)
    handler = LogFileHandler(Path(log_file), append=True)
    logging.getLogger().addHandler(handler)
    if logging.getLogger("rollflow").getEffectiveLevel() > logging.INFO:  # Prefect's set-up leaves the root at WARNING
        logging.getLogger("rollflow").setLevel(logging.INFO)
    try:
        done = pipeline.committed_steps(run)
        target = done + (iterations or config.max_steps)
        log.info("scheduled run %s: iterations %d..%d", run, done, target - 1)
        summary = pipeline.flow()({**cfg, "max_steps": target})
        report = write_report(summary["run"]).html
        log.info("scheduled run %s: report %s", run, report)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
        publish_run(run)
    return {**summary, "from_iteration": done, "report": str(report)}


def deploy(flow: Any, name: str, *, cron: str | None = None, interval_s: float | None = None,
           timezone: str | None = None, parameters: dict[str, Any] | None = None, api_url: str | None = None,
           limit: int = 1) -> None:
    """Register deployment ``<flow name>/<name>`` of ``flow`` with the schedule and default ``parameters`` on the
    server at ``api_url`` (default ``$PREFECT_API_URL``) and serve it until interrupted (module docstring)."""
    schedule = make_schedule(cron, interval_s, timezone)
    api_url = resolve_api_url(api_url)
    os.environ["PREFECT_API_URL"] = api_url  # the flow-run subprocesses inherit the environment
    from prefect.deployments.runner import EntrypointType
    from prefect.settings import PREFECT_API_URL, temporary_settings

    log.info("serving deployment %s/%s on %s", flow.name, name, api_url)
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        try:
            flow.serve(name=name, schedules=[schedule], parameters=parameters or {}, limit=limit, global_limit=limit,
                       pause_on_shutdown=True, print_starting_message=False,
                       entrypoint_type=EntrypointType.MODULE_PATH)
        finally:
            # Prefect pauses the schedule on Ctrl-C, but its SIGTERM handler exits before the pause request is
            # sent (3.7.7): pause it here too, so a supervisor's stop leaves no runs due that nobody executes.
            pause_deployment(f"{flow.name}/{name}")


def pause_deployment(full_name: str) -> bool:
    """Pause the schedule of deployment ``flow/name`` on the current API; False if it cannot be reached."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.pause_deployment(client.read_deployment_by_name(full_name).id)
        return True
    except Exception as err:  # the server may be gone already; nothing to pause then
        log.warning("could not pause deployment %s: %s", full_name, err)
        return False
