"""Serving a deployment with ``rollflow deploy`` in a child process and waiting for its scheduled runs on a real
Prefect server (the session's, tests/conftest.py). Used by the serving tests and by the default-model scenarios,
whose run is two ticks of a scheduled training deployment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def serve(args: list[str], api_url: str, home: Path, log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """``rollflow deploy ARGS`` in its own process group, reporting to ``api_url``, its output in ``log_path``.
    ``env``: the base environment (default: this process's)."""
    env = {**(os.environ if env is None else env), "PREFECT_HOME": str(home), "PREFECT_API_URL": api_url,
           "PREFECT_RUNNER_POLL_FREQUENCY": "2", "PREFECT_LOGGING_LEVEL": "INFO"}
    with open(log_path, "wb") as log_file:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "deploy", *args], cwd=REPO, env=env,
                                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def stop(process: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM the process (the runner pauses the schedule and exits), SIGKILL its group if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


def deployment(client, name: str, served: subprocess.Popen, log_path: Path, deadline: float):
    """The deployment ``flow/name`` once the serving process registered it."""
    while True:
        assert served.poll() is None, f"rollflow deploy exited {served.returncode}:\n{tail(log_path)}"
        assert time.monotonic() < deadline, f"no deployment registered:\n{tail(log_path)}"
        try:
            return client.read_deployment_by_name(name)
        except Exception:  # not registered yet (ObjectNotFound)
            time.sleep(1)


def completed_runs(client, deployment, served: subprocess.Popen, log_path: Path, deadline: float, count: int = 1):
    """The first ``count`` completed runs of ``deployment`` (by start), waiting for them; a run that ends otherwise,
    a serving process that exits, or the deadline fails the test. Only runs that started are read: the scheduler
    keeps up to 100 future runs of the deployment, which the server would send every 2 s otherwise."""
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    only_this = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
    started = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
        not_any_=[StateType.SCHEDULED, StateType.PENDING])))
    while True:
        runs = client.read_flow_runs(deployment_filter=only_this, flow_run_filter=started)
        completed = sorted((r for r in runs if r.state is not None and r.state.is_completed()),
                           key=lambda r: r.start_time)
        if len(completed) >= count:
            return completed[:count]
        broken = [r for r in runs if r.state is not None and r.state.is_final() and not r.state.is_completed()]
        assert not broken, f"run {broken[0].name} ended {broken[0].state.name}:\n{tail(log_path)}"
        assert served.poll() is None, f"rollflow deploy exited {served.returncode}:\n{tail(log_path)}"
        assert time.monotonic() < deadline, (f"{count} scheduled runs did not complete in time; runs: "
                                             f"{[(r.name, r.state_name) for r in runs]}\n{tail(log_path)}")
        time.sleep(2)
