"""The Prefect recompute flow: ephemeral mode (no server; a command's default, kept here by the ``ephemeral_prefect``
mark, while the other tests on the session's cluster report to its server) and against a real ``prefect server``
that the test session starts on 127.0.0.1 and stops (tests/conftest.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from schemas.errors import SchemaError
from tests.processes import rollflow_here
from tests.spine.helpers import GIGPO, config, flow_runs, read_table, tree_digest


def _task_runs(client, flow_run_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _recorded(tasks) -> bool:
    """Both task runs of a recompute flow, finished."""
    return len(tasks) == 2 and all(t.state.is_final() for t in tasks)


@pytest.mark.ephemeral_prefect  # reads its runs from this process's own database
def test_flow_in_ephemeral_mode(step_set, tmp_path, ray_cluster, prefect_home):
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    from flows.recompute import recompute_flow

    assert "PREFECT_API_URL" not in os.environ and get_current_settings().api.url is None
    cfg = config(GIGPO).model_dump(mode="json")
    out = tmp_path / "out"
    first = recompute_flow(step_set, str(out), cfg)
    assert not first["rewarded"]["skipped"] and not first["advantaged"]["skipped"]
    assert first["advantaged"]["rows"] == read_table(step_set, ["row_id"]).num_rows
    assert first["advantaged"]["output"] == str(out / "advantaged")
    assert "critic/kl" in first["advantaged"]["metrics"] and "kl_ctrl" in first["advantaged"]["state"]
    before = tree_digest(out)
    second = recompute_flow(step_set, str(out), cfg)
    assert second["rewarded"]["skipped"] and second["advantaged"]["skipped"]
    assert tree_digest(out) == before

    with get_client(sync_client=True) as client:
        runs = flow_runs(client)
        assert len(runs) >= 2 and all(r.state.is_completed() for r in runs[:2])
        tasks = _task_runs(client, runs[0].id)
        assert sorted(t.name.rsplit("-", 1)[0] for t in tasks) == \
            ["advantages", "response_rewards"]
        assert all(t.state.is_completed() for t in tasks)
    assert Path(prefect_home, "prefect.db").exists(), "the ephemeral database lives in PREFECT_HOME"


@pytest.mark.ephemeral_prefect  # reads its runs from this process's own database
def test_flow_failure_raises_our_error_and_marks_the_run_failed(step_set, tmp_path, ray_cluster):
    from prefect.client.orchestration import get_client

    from flows.recompute import recompute_flow
    from tests.spine.helpers import modified_copy

    bad = modified_copy(step_set, tmp_path / "bad", lambda t: t.drop_columns(["tag"]))
    with pytest.raises(SchemaError, match="missing column 'tag'"):
        recompute_flow(bad, str(tmp_path / "out"), config(GIGPO).model_dump(mode="json"))
    assert not (tmp_path / "out").exists()
    with get_client(sync_client=True) as client:
        assert flow_runs(client)[0].state.is_failed()


@pytest.mark.server
@pytest.mark.slow
def test_flow_against_a_real_prefect_server(prefect_server, ray_cluster, step_set, tmp_path):
    """``rollflow recompute`` reporting to the session's real Prefect server: its flow run and both task runs are
    there, completed, with the command's parameters. The command runs in this process (``rollflow_here``, the
    server in Prefect's settings), not as a child (7.9 -> 0.8 CPU-s, a process's imports): that a child reports to
    the server named by PREFECT_API_URL in its environment, starting no ephemeral one, is checked on the S3
    recompute child of tests/spine/test_object_store.py, which reports to this server too."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    out = tmp_path / "out"
    result = rollflow_here("recompute", "--input", step_set, "--config", GIGPO, "--output", str(out),
                           "--set", "runtime.num_cpus=2", api_url=prefect_server.api_url)
    assert result.exit_code == 0, result.output[-3000:]
    assert (out / "advantaged" / "manifest.json").exists()

    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
        with get_client(sync_client=True) as client:
            assert client.api_url.host == "127.0.0.1"
            runs = [r for r in flow_runs(client) if r.parameters.get("output_dir") == str(out)]  # a shared server
            assert len(runs) == 1 and runs[0].state.is_completed(), runs
            assert runs[0].parameters["input_dir"] == step_set
            # the task runs reach the server as events, which this process's events worker sends on its own time (a
            # child flushed them at its exit)
            deadline = time.monotonic() + 60
            while not _recorded(tasks := _task_runs(client, runs[0].id)) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert sorted(t.name.rsplit("-", 1)[0] for t in tasks) == ["advantages", "response_rewards"]
            assert all(t.state.is_completed() for t in tasks)
