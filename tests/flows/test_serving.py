"""A real local Prefect server and a scheduled deployment of the recompute flow executed by ``rollflow deploy``;
plus the quick checks of the server/deploy preconditions (busy port, bad schedules, no server)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from flows.serving import ServerError, make_schedule, resolve_api_url, start_server
from schemas.errors import ConfigError
from stages.ports import free_port
from tests.flows import deployments

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


def test_deploy_command_refuses_bad_input_before_serving(tmp_path, monkeypatch):
    """The CLI exits 2 with one message when there is no server (no Prefect run is started). The command runs in
    this process (Typer's runner: the same entry point and exit status, no child importing rollflow again)."""
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # and restored if a broken deploy sets it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "samples").mkdir()  # the config and folders are checked first (an output inside the input is refused)
    result = CliRunner().invoke(app, ["deploy", "--config", str(GIGPO), "--input", str(tmp_path / "samples"),
                                      "--output", str(tmp_path / "out"), "--cron", "0 3 * * *"])
    assert result.exit_code == 2, result.output
    assert "error: deploy: no Prefect server given" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples"], "nothing written"


def test_a_training_deployment_gets_the_training_runs_checks_before_it_is_registered(tmp_path, prefect_server,
                                                                                      monkeypatch):
    """``deploy --flow train`` refuses what ``rollflow train`` refuses before it starts (here an environment that is
    not registered), exit 2, and registers nothing on the server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.chdir(tmp_path)
    quick = str(REPO / "configs/train_frozenlake_quickstart.yaml")
    result = CliRunner().invoke(app, ["deploy", "--flow", "train", "--config", quick, "--interval", "60", "--name",
                                      "refused-tick", "--api-url", prefect_server.api_url,
                                      "--set", "rollout.env.tag=Chess"])
    assert result.exit_code == 2, result.output
    assert "rollout.env.tag 'Chess' is not a registered environment" in result.output
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        assert not [d for d in client.read_deployments() if d.name == "refused-tick"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.server
def test_scheduled_deployment_runs_on_a_local_server(tmp_path, prefect_server, cli_env):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from stages.example import ExampleSpec, generate

    samples, output = tmp_path / "samples", tmp_path / "nightly"
    generate(ExampleSpec(samples=200, response_len=(8, 16)), str(samples))
    server = prefect_server  # the session's (tests/conftest.py)
    serve_log = tmp_path / "serve.log"
    served = None
    try:
        served = deployments.serve(["--config", str(GIGPO), "--input", str(samples), "--output", str(output),
                                    "--cron", "* * * * *", "--name", "every-minute", "--set", "runtime.num_cpus=2"],
                                   server.api_url, tmp_path / "client", serve_log, env=cli_env)
        deadline = time.monotonic() + WAIT_S
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
            deployment = deployments.deployment(client, "recompute/every-minute", served, serve_log, deadline)
            assert [s.schedule.cron for s in deployment.schedules] == ["* * * * *"]
            assert deployment.parameters["input_dir"] == str(samples)
            assert deployment.parameters["cfg"]["runtime"]["num_cpus"] == 2

            run, = deployments.completed_runs(client, deployment, served, serve_log, deadline)
            assert run.auto_scheduled  # created by the server's scheduler, not started by hand
            assert run.expected_start_time.second == 0  # on a minute boundary, as the cron says

            manifest = json.loads((output / "advantaged" / "manifest.json").read_text())
            assert manifest["rows"] == 210

            assert deployments.stop(served) == 0, deployments.tail(serve_log)
            assert client.read_deployment(deployment.id).paused  # stopping the server-side schedule too
    finally:
        if served is not None:
            deployments.stop(served)
