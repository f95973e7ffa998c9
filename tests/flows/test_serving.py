"""A real local Prefect server and a scheduled deployment of the recompute flow executed by ``rollflow deploy``;
plus the quick checks of the server/deploy preconditions (busy port, bad schedules, no server)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.serving import ServerError, free_port, make_schedule, resolve_api_url, start_server
from schemas.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
GIGPO = REPO / "configs" / "recompute_gigpo.yaml"
WAIT_S = 150  # a cron of every minute fires within 60 s; the run itself takes 20-60 s on a loaded 2-core machine


def test_busy_port_is_a_clear_error(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is already in use"):
            start_server("127.0.0.1", port, tmp_path)
    assert not list(tmp_path.glob("server-*.log"))  # nothing was started


@pytest.mark.parametrize("cron, interval, match", [
    (None, None, "exactly one schedule"),
    ("* * * * *", 60.0, "exactly one schedule"),
    ("* * *", None, "not a valid cron"),
    ("61 * * * *", None, "not a valid cron"),
    (None, 0.0, "must be > 0"),
])
def test_bad_schedules_are_config_errors(cron, interval, match):
    with pytest.raises(ConfigError, match=match):
        make_schedule(cron, interval)


def test_schedules():
    assert make_schedule("0 3 * * *").cron == "0 3 * * *"
    assert make_schedule(interval_s=90).interval.total_seconds() == 90


def test_deploy_needs_a_reachable_server(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with pytest.raises(ServerError, match="rollflow server"):
        resolve_api_url(None)
    with pytest.raises(ServerError, match="does not answer"):
        resolve_api_url(f"http://127.0.0.1:{free_port()}/api")


def test_deploy_command_refuses_bad_input_before_serving(tmp_path):
    """The CLI exits 2 with one message when there is no server (no Prefect run is started)."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)
    result = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--config", str(GIGPO), "--input",
                             str(tmp_path), "--output", str(tmp_path / "out"), "--cron", "0 3 * * *"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "error: deploy: no Prefect server given" in result.stderr


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def _stop(process: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM the process (the runner pauses the schedule and exits), SIGKILL its group if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


def _deployment(client, name: str, serve: subprocess.Popen, serve_log: Path, deadline: float):
    while True:
        assert serve.poll() is None, f"rollflow deploy exited {serve.returncode}:\n{_tail(serve_log)}"
        assert time.monotonic() < deadline, f"no deployment registered:\n{_tail(serve_log)}"
        try:
            return client.read_deployment_by_name(name)
        except Exception:  # not registered yet (ObjectNotFound)
            time.sleep(1)


def _completed_runs(client, deployment, serve: subprocess.Popen, serve_log: Path, deadline: float, count: int = 1):
    """The first ``count`` completed runs of ``deployment`` (by start), waiting for them; a run that ends otherwise,
    a serving process that exits, or the deadline fails the test."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    only_this = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
    while True:
        runs = client.read_flow_runs(deployment_filter=only_this)
        completed = sorted((r for r in runs if r.state is not None and r.state.is_completed()),
                           key=lambda r: r.start_time)
        if len(completed) >= count:
            return completed[:count]
        broken = [r for r in runs if r.state is not None and r.state.is_final() and not r.state.is_completed()]
        assert not broken, f"run {broken[0].name} ended {broken[0].state.name}:\n{_tail(serve_log)}"
        assert serve.poll() is None, f"rollflow deploy exited {serve.returncode}:\n{_tail(serve_log)}"
        assert time.monotonic() < deadline, (f"{count} scheduled runs did not complete in time; runs: "
                                             f"{[(r.name, r.state_name) for r in runs]}\n{_tail(serve_log)}")
        time.sleep(2)


def _first_completed_run(client, deployment, serve: subprocess.Popen, serve_log: Path, deadline: float):
    return _completed_runs(client, deployment, serve, serve_log, deadline)[0]


def _serve(args: list[str], server, tmp_path: Path, serve_log: Path) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "client"), "PREFECT_API_URL": server.api_url,
           "PREFECT_RUNNER_POLL_FREQUENCY": "2", "PREFECT_LOGGING_LEVEL": "INFO"}
    with open(serve_log, "wb") as log_file:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "deploy", *args], cwd=REPO, env=env,
                                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


@pytest.mark.server
def test_scheduled_deployment_runs_on_a_local_server(tmp_path, prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from stages.example import ExampleSpec, generate

    samples, output = tmp_path / "samples", tmp_path / "nightly"
    generate(ExampleSpec(samples=200, response_len=(8, 16)), str(samples))
    server = prefect_server  # the session's (tests/conftest.py)
    serve_log = tmp_path / "serve.log"
    serve = None
    try:
        serve = _serve(["--config", str(GIGPO), "--input", str(samples), "--output", str(output), "--cron",
                        "* * * * *", "--name", "every-minute", "--set", "runtime.num_cpus=2"], server, tmp_path,
                       serve_log)
        deadline = time.monotonic() + WAIT_S
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
            deployment = _deployment(client, "recompute/every-minute", serve, serve_log, deadline)
            assert [s.schedule.cron for s in deployment.schedules] == ["* * * * *"]
            assert deployment.parameters["input_dir"] == str(samples)
            assert deployment.parameters["cfg"]["runtime"]["num_cpus"] == 2

            run = _first_completed_run(client, deployment, serve, serve_log, deadline)
            assert run.auto_scheduled  # created by the server's scheduler, not started by hand
            assert run.expected_start_time.second == 0  # on a minute boundary, as the cron says

            manifest = json.loads((output / "advantaged" / "manifest.json").read_text())
            assert manifest["rows"] == 210

            assert _stop(serve) == 0, _tail(serve_log)
            assert client.read_deployment(deployment.id).paused  # stopping the server-side schedule too
    finally:
        if serve is not None:
            _stop(serve)


@pytest.mark.server
@pytest.mark.slow
def test_scheduled_training_run_on_a_local_server(tmp_path, prefect_server):
    """``rollflow deploy --flow train``: the server's scheduler starts a run every tick, and every tick advances the
    run (tiny model, one iteration a tick): the first trains iteration 0, the second continues from its checkpoint
    with iteration 1, never a run that finds everything done. Ticks never overlap (the deployment's concurrency
    limit): the second starts after the first ended."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from stages.generation.model_store import tiny_random_model_dir

    server = prefect_server  # the session's (tests/conftest.py)
    serve_log = tmp_path / "serve.log"
    serve = None
    tiny = ["--set", "run_name=nightly", "--set", f"runs_dir={tmp_path}", "--set", "max_steps=1",
            "--set", f"pretrain={tiny_random_model_dir()}", "--set", "rollout.engine.backend=hf",
            "--set", "rollout.engine.options={}", "--set", "rollout.env.num_env_groups=2",
            "--set", "rollout.env.group_size=2", "--set", "rollout_batch_size=4", "--set", "rollout.env.max_steps=2",
            "--set", "rollout.generating_args.max_new_tokens=8", "--set", "eval.eval_steps=0",
            "--set", "train.actor_train.model_args.dtype=fp32"]
    try:
        serve = _serve(["--flow", "train", "--config", str(REPO / "configs/train_frozenlake_grpo.yaml"),
                        "--interval", "30", "--name", "hourly", *tiny], server, tmp_path, serve_log)
        deadline = time.monotonic() + 8 * WAIT_S
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
            deployment = _deployment(client, "advance-run/hourly", serve, serve_log, deadline)
            assert deployment.parameters["cfg"]["run_name"] == "nightly"
            assert deployment.global_concurrency_limit is not None and \
                deployment.global_concurrency_limit.limit == 1
            first, second = _completed_runs(client, deployment, serve, serve_log, deadline, count=2)
            assert first.auto_scheduled and second.auto_scheduled
            assert second.start_time >= first.end_time, "the ticks overlapped"
            for k in (0, 1):
                for stage in ("rollout/samples", "logprobs", "advantaged", "checkpoint"):
                    assert (tmp_path / f"nightly/iter_{k:04d}" / stage / "manifest.json").exists(), (k, stage)
            train_state = json.loads((tmp_path / "nightly/iter_0001/checkpoint/train_state.json").read_text())
            assert train_state["global_step"] > json.loads(
                (tmp_path / "nightly/iter_0000/checkpoint/train_state.json").read_text())["global_step"]
            assert json.loads((tmp_path / "nightly/config.json").read_text())["max_steps"] >= 2
            assert _stop(serve) == 0, _tail(serve_log)
    finally:
        if serve is not None:
            _stop(serve)
