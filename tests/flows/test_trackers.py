"""ROLL's track_with: TensorBoard, MLflow (a real local tracking server started here) and W&B (offline files),
read back through each library; a resumed run continues the same tracker runs without duplicated steps; a
misconfigured or unreachable tracker fails the pre-flight of `rollflow train` with the fix (exit 2, nothing
written)."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from schemas.config import validate_config
from schemas.train_flow_config import TrainFlowConfig
from stages.metrics import MetricsLog, read_metrics, tracker_name
from stages.ports import free_port
from stages.run_folder import run_folder
from stages.trackers import TRACKERS_DIR, open_trackers, read_state
from tests.flows.test_metrics import _scalars

# The metrics of a two-iteration agentic run, in the order the flow logs them (flows/agentic.py): names of the
# metrics table (ROLL's), eval before training at 0 and after iteration k at k + 1. The evaluation logs the
# rollout's names (the same samples stage computes both), which every tracker files under val/.
ROLLOUT = ["env/FrozenLake/success", "rollout/success_rate", "time/rollout/env_step"]
STAGES = {
    "eval": ROLLOUT,
    "rollout": ROLLOUT,
    "logprobs": ["critic/ref_kl"],
    "advantages": ["critic/advantages/mean", "critic/score/mean"],
    "train": ["actor/pg_loss", "actor/entropy", "actor/grad_norm"],
}


def _metrics(iteration: int, stage: str) -> dict[str, float]:
    return {name: round(0.1 * iteration + 0.01 * i + 0.001 * len(stage), 6) for i, name in enumerate(STAGES[stage])}


def _iteration(log: MetricsLog, k: int, stages=("rollout", "logprobs", "advantages", "train", "eval")) -> None:
    for stage in stages:
        log.log(k + 1 if stage == "eval" else k, stage, _metrics(k + 1 if stage == "eval" else k, stage), wall_s=1.5)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A local MLflow tracking server (SQLite store) on a free port of 127.0.0.1, stopped after the module; without
    the job runner MLflow 3 starts beside it (its own processes, importing MLflow again, for GenAI jobs and trace
    roll-ups, which no tracker here uses)."""
    folder = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--host",
                               "127.0.0.1", "--port", str(port), "--workers", "1",
                               "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
                               "--default-artifact-root", str(folder / "artifacts")],
                              stdout=open(folder / "server.log", "wb"), stderr=subprocess.STDOUT,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                              start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (folder / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the MLflow server did not start in 180 s"
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


# ---- reading W&B's offline files ---------------------------------------------------------------------------------

def wandb_offline_records(path: str):
    """The records of a W&B transaction log (``run-<id>.wandb``) as wandb's own protobuf ``Record`` messages.

    The file is wandb's LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of
    chunks, each with a 7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail
    shorter than a chunk header is zero padding."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), f"{path}: not a W&B log"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(wandb_dir: Path, run_id: str) -> tuple[dict[str, list[tuple[int, float]]], list[dict]]:
    """``name → [(step, value)]`` over every offline session of the W&B run ``run_id``, and each session's config."""
    points: dict[str, list[tuple[int, float]]] = {}
    configs = []
    # a session started in the same second as an earlier one gets the folder name with "-1" (then "-2", ...)
    folders = [f for f in glob.glob(f"{wandb_dir}/offline-run-*-{run_id}*")
               if re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", os.path.basename(f))]
    for path in sorted(f"{f}/run-{run_id}.wandb" for f in folders):
        for record in wandb_offline_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                for item in record.history.item:
                    name = item.key or "/".join(item.nested_key)
                    if not name.startswith("_"):
                        points.setdefault(name, []).append((record.history.step.num, json.loads(item.value_json)))
            elif kind in ("run", "config"):  # the run record carries the config given to wandb.init
                update = (record.run.config if kind == "run" else record.config).update
                if update:
                    configs.append({u.key: json.loads(u.value_json) for u in update})
    return points, configs


# ---- the Done-when test ----------------------------------------------------------------------------------------

def _table_points(run_dir) -> dict[str, list[tuple[int, float]]]:
    """``tracker name → [(iteration, value)]`` of the metrics table (one value per name and iteration here)."""
    points: dict[str, dict[int, float]] = {}
    for row in read_metrics(run_dir).to_pylist():
        by_step = points.setdefault(tracker_name(row["stage"], row["name"]), {})
        assert row["iteration"] not in by_step, f"two values of {row['name']} at step {row['iteration']}"
        by_step[row["iteration"]] = row["value"]
    return {name: sorted(by_step.items()) for name, by_step in points.items()}


def test_two_iterations_reach_all_three_trackers_and_a_resume_appends_without_duplicated_steps(tmp_path,
                                                                                                 mlflow_server):
    from mlflow import MlflowClient

    config = validate_config(TrainFlowConfig, {
        "run_name": "tracked", "runs_dir": str(tmp_path), "track_with": ["tensorboard", "mlflow", "wandb"],
        "tracker_kwargs": {"mlflow": {"tracking_uri": mlflow_server, "experiment_name": "rollflow-test"}}})
    run, cfg = run_folder(config), config.model_dump(mode="json")

    # the first session: eval before training, iteration 0, then iteration 1's rollout; killed there
    with MetricsLog(run.uri(), trackers=open_trackers(config, run, cfg)) as log:
        log.log(0, "eval", _metrics(0, "eval"), wall_s=2.0)
        _iteration(log, 0)
        _iteration(log, 1, stages=("rollout",))
    # ... after the table got iteration 1's log-probs but before the trackers did (the kill came in between)
    MetricsLog(run.uri(), trackers=[]).log(1, "logprobs", _metrics(1, "logprobs"), wall_s=1.5)
    first = {name: read_state(run, name)["run"] for name in ("mlflow", "wandb")}

    # the resumed session: the trackers catch up the log-probs; iteration 1's rollout is logged again (a stage
    # re-run on resume) and reaches no tracker twice; the rest of iteration 1 appends
    with MetricsLog(run.uri(), trackers=open_trackers(config, run, cfg)) as log:
        _iteration(log, 1, stages=("rollout", "advantages", "train", "eval"))
    assert {name: read_state(run, name)["run"] for name in ("mlflow", "wandb")} == first  # the same tracker runs

    table = _table_points(run.uri())
    assert set(table) == {f"val/{n}" for n in ROLLOUT + ["time/eval"]} | {n for names in STAGES.values() for n in
                                                                          names} | {f"time/{s}" for s in STAGES
                                                                                    if s != "eval"}
    # the rollout and the evaluation of one step: the same metric name, two series
    assert table["rollout/success_rate"][1] != table["val/rollout/success_rate"][1]
    assert max(step for pts in table.values() for step, _ in pts) == 2  # eval after iteration 1

    assert _scalars(Path(run.path)) == {n: [(s, pytest.approx(v)) for s, v in pts] for n, pts in table.items()}

    client = MlflowClient(tracking_uri=mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("rollflow-test").experiment_id])
    assert [r.info.run_id for r in runs] == [first["mlflow"]]  # one MLflow run, resumed
    history = {n: sorted((m.step, m.value) for m in client.get_metric_history(first["mlflow"], n)) for n in table}
    assert history == table  # every (name, step) once, with the table's value
    params = runs[0].data.params
    assert params["run_name"] == "tracked" and params["rollout.env.group_size"] == str(config.rollout.env.group_size)

    points, configs = wandb_history(Path(run.path) / "wandb", first["wandb"])
    assert len(configs) == 2 and all(c["run_name"] == "tracked" for c in configs)  # two sessions, one run id
    assert {n: sorted(p) for n, p in points.items()} == table


def test_every_pipelines_evaluation_is_filed_under_val():
    """The trackers' rule (stages/metrics.py tracker_name) knows each pipeline's evaluation stage by name: a pipeline
    whose evaluation it did not know would mix that evaluation's values into the rollout's series again."""
    from flows.agentic import AGENTIC
    from flows.rlvr import RLVR
    from stages.metrics import EVALUATION_STAGES

    assert {AGENTIC.evaluation.name, RLVR.evaluation.name} == EVALUATION_STAGES
    assert tracker_name(AGENTIC.evaluation.name, "rollout/success_rate") == "val/rollout/success_rate"
    assert tracker_name("rollout", "rollout/success_rate") == "rollout/success_rate"
    assert tracker_name(RLVR.evaluation.name, "val/score/mean") == "val/score/mean"


# ---- the pre-flight -----------------------------------------------------------------------------------------------

runner = CliRunner()


@pytest.mark.parametrize("options, env, words", [
    ({"track_with": ["tensorboard", "neptune"]}, {}, ["track_with[1]", "'tensorboard', 'mlflow' or 'wandb'"]),
    ({"track_with": "mlflow", "tracker_kwargs": {"mlflow": {"tracking_uri": "localhost:5000"}}}, {},
     ["not an MLflow server or database URI", "http://HOST:PORT"]),
    ({"track_with": "mlflow", "tracker_kwargs": {"mlflow": {"tracking_uri": "http://127.0.0.1:{port}"}}}, {},
     ["no MLflow tracking server answers", "mlflow server", "tracking_uri: null"]),
    ({"track_with": ["wandb"], "tracker_kwargs": {"wandb": {"mode": "online"}}}, {"WANDB_API_KEY": None},
     ["no W&B API key", "WANDB_API_KEY", "mode: offline"]),
    ({"tracker_kwargs": {"wandb": {"project": "p"}}}, {}, ["tracker_kwargs sets ['wandb']", "add them to track_with"]),
])
def test_a_misconfigured_or_unreachable_tracker_fails_the_preflight_with_the_fix(tmp_path, monkeypatch, options,
                                                                                 env, words):
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))  # no `wandb login` of this machine counts
    for name, value in env.items():
        monkeypatch.delenv(name, raising=False) if value is None else monkeypatch.setenv(name, value)
    text = json.dumps(options).replace("{port}", str(free_port()))  # a port no server listens on
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "refused", "runs_dir": str(tmp_path / "runs"), "max_steps": 1,
                                      **json.loads(text)}))
    result = runner.invoke(app, ["train", "--config", str(config)])
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output
    assert not (tmp_path / "runs").exists()  # nothing written: no run folder, no tracker state


def test_mlflow_without_a_uri_keeps_its_store_in_the_run_folder_and_resumes_the_same_run(tmp_path):
    from mlflow import MlflowClient

    config = validate_config(TrainFlowConfig, {"run_name": "local", "runs_dir": str(tmp_path), "track_with": "mlflow"})
    run, cfg = run_folder(config), config.model_dump(mode="json")
    for session in range(2):  # the second continues the first's MLflow run
        with MetricsLog(run.uri(), trackers=open_trackers(config, run, cfg)) as log:
            log.log(session, "train", _metrics(session, "train"))
    state = read_state(run, "mlflow")
    assert state["tracking_uri"] == f"sqlite:///{tmp_path}/local/mlflow/mlflow.db"
    assert (tmp_path / "local" / TRACKERS_DIR / "mlflow.json").is_file()
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    assert [r.info.run_id for r in client.search_runs([client.get_experiment_by_name("rollflow").experiment_id])] \
        == [state["run"]]
    assert [(m.step, m.value) for m in client.get_metric_history(state["run"], "actor/pg_loss")] == \
        [(0, _metrics(0, "train")["actor/pg_loss"]), (1, _metrics(1, "train")["actor/pg_loss"])]
    assert not (tmp_path / "local" / "tensorboard").exists()  # track_with without tensorboard: no event files


KILLED_SESSION = """
import os, signal, sys
from schemas.config import validate_config
from schemas.train_flow_config import TrainFlowConfig
from stages.metrics import MetricsLog
from stages.run_folder import run_folder
from stages.trackers import open_trackers
config = validate_config(TrainFlowConfig, {"run_name": "killed", "runs_dir": sys.argv[1], "track_with": "wandb"})
run = run_folder(config)
log = MetricsLog(run.uri(), trackers=open_trackers(config, run, config.model_dump(mode="json")))
for k in (0, 1):
    log.log(k, "train", {"actor/pg_loss": float(k)})
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_wandb_session_is_sent_again_by_the_resume(tmp_path):
    """W&B's service writes a session's files at finish: a SIGKILLed run leaves none of its points, so the resume
    sends the table's rows again, into the same W&B run id, once each."""
    own_service = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # not this process's service
    (tmp_path / "tmp").mkdir()  # where wandb's import makes its temporary folders, which the kill leaves behind
    killed = subprocess.run([sys.executable, "-c", KILLED_SESSION, str(tmp_path)],
                            env={**own_service, "TMPDIR": str(tmp_path / "tmp")}, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    config = validate_config(TrainFlowConfig, {"run_name": "killed", "runs_dir": str(tmp_path), "track_with": "wandb"})
    run = run_folder(config)
    run_id = read_state(run, "wandb")["run"]
    with MetricsLog(run.uri(), trackers=open_trackers(config, run, config.model_dump(mode="json"))) as log:
        log.log(2, "train", {"actor/pg_loss": 2.0})
    points, _ = wandb_history(Path(run.path) / "wandb", run_id)
    assert sorted(points["actor/pg_loss"]) == [(0, 0.0), (1, 1.0), (2, 2.0)]
