"""The trackers a run's metrics go to besides its metrics table (ROLL's ``track_with``): TensorBoard, MLflow, W&B.

One registry, :data:`TRACKERS`, looked up in one place (:func:`tracker`). An entry (:class:`TrackerSpec`) has a
pre-flight check (``rollflow train`` runs it before Prefect and Ray start: a misconfigured or unreachable tracker is
refused with the fix, never found mid-run; it writes nothing) and an opener, called by the training flows once the
run's config is frozen; :class:`stages.metrics.MetricsLog` then hands every stage's rows to each opened tracker.

Steps are the metrics table's iterations; names its ``name`` (``actor/pg_loss``, ...), under ``val/`` for an
evaluation stage's rows (stages/metrics.py ``tracker_name``: the evaluation logs the rollout's names). The run's
frozen config is the tracker run's parameters (MLflow params, flattened ``a.b.c``; W&B config).

Resume continues the same tracker run. TensorBoard mirrors the table exactly (stages/metrics.py). MLflow and W&B
keep every point they are sent (their stores are append-only), so they are sent each ``(iteration, stage)`` once:
the run folder's ``trackers/<name>.json`` holds the tracker run's id (MLflow's run id; W&B's run ``id``, resumed
with ``resume="allow"``) and, per stage, the last iteration sent. Opening catches up the rows of the table the
tracker lacks (a run killed between the table and the tracker), and a stage logged again at an iteration already
sent (a resumed run re-running an iteration) is not sent again: these trackers keep the first values of a step.
W&B's service writes a session's files when its run's stream closes, so its state counts a step as sent only after
a clean close that waits for the service (WandbTracker.close): a killed session leaves no W&B points, and the resume
sends them again (MLflow's are committed by each request, so its state is written after each).

The libraries are imported when a tracker is opened or checked, not at module import: importing mlflow and wandb
takes seconds, and every command imports the metrics module (its ``--help`` must stay fast).
"""

from __future__ import annotations

import json
import netrc
import os
import re
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import pyarrow as pa

from schemas.errors import ConfigError
from stages.metrics import TensorBoardMirror, Tracker, read_metrics, tracker_names
from stages.outputs import check_output_location
from stages.registry import Registry
from stages.storage import Location, local_side

TRACKERS_DIR = "trackers"  # the run folder's tracker states (trackers/<name>.json)
MLFLOW_DIR = "mlflow"      # the run folder's own MLflow store (local side): mlflow.db and artifacts/
WANDB_DIR = "wandb"        # W&B's offline files (local side): wandb/offline-run-<time>-<id>/
CHECK_TIMEOUT_S = 5.0      # how long a pre-flight check waits for a tracking server


@dataclass(frozen=True)
class TrackerSpec:
    """A tracker: ``check(options, run, field)`` before the run starts (reads only; raises ConfigError with the
    fix), ``open(options, run, params)`` once the config is frozen (``params``: the frozen config as JSON)."""

    check: Callable[[Any, Location, str], None]
    open: Callable[[Any, Location, Mapping[str, Any]], Tracker]


TRACKERS: Registry[TrackerSpec] = Registry("tracker")


def tracker(name: str) -> TrackerSpec:
    """The one lookup of a tracker by its ``track_with`` name."""
    return TRACKERS.get(name)


def check_trackers(config, run: Location) -> None:
    """Pre-flight of every tracker of ``config.track_with`` for the run folder ``run``."""
    for name in config.track_with:
        tracker(name).check(getattr(config.tracker_kwargs, name), run, f"tracker_kwargs.{name}")


def open_trackers(config, run: Location, params: Mapping[str, Any]) -> list[Tracker]:
    """The run's trackers, opened in ``track_with`` order (closed again if one fails to open)."""
    opened: list[Tracker] = []
    try:
        for name in config.track_with:
            opened.append(tracker(name).open(getattr(config.tracker_kwargs, name), run, params))
    except BaseException:
        for t in opened:
            t.close()
        raise
    return opened


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as flat ``a.b.c → text`` parameters (lists and nulls as JSON), for MLflow's params."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return out


def _require(module: str, package: str, field: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"track_with names {field.rsplit('.', 1)[-1]}, but {package} is not installed; run "
                          f"`make setup` (the lock has it), or `pip install {package}`")


# ---- append-only trackers: the state file and the catch-up ------------------------------------------------------

class _AppendOnly:
    """What MLflow and W&B share: their state in ``trackers/<name>.json`` (the tracker run's id, the last iteration
    sent per stage), each ``(iteration, stage)`` sent once, the table's unsent rows sent at open."""

    name = ""
    # whether a point is in the tracker's store once send() returns (MLflow: a committed request); otherwise the
    # state records what was sent only at a clean close (W&B's service buffers its files: a killed run keeps none
    # of its session's points, so a resume sends them all again)
    durable_send = True

    def __init__(self, run: Location) -> None:
        self.run = run
        self.state_file = run.child(TRACKERS_DIR).child(f"{self.name}.json")
        self.state: dict[str, Any] = read_state(run, self.name) or {}
        self.sent: dict[str, int] = dict(self.state.get("sent", {}))

    def catch_up(self) -> None:
        """Send the table's ``(iteration, stage)`` groups this tracker has not been sent, in iteration order."""
        table = read_metrics(self.run.uri())
        groups: dict[tuple[int, str], dict[str, float]] = {}
        for row, name in zip(table.to_pylist(), tracker_names(table)):
            if row["value"] is not None and row["iteration"] > self.sent.get(row["stage"], -1):
                groups.setdefault((row["iteration"], row["stage"]), {})[name] = row["value"]
        for (iteration, stage), values in sorted(groups.items()):
            self._send_once(iteration, stage, values)

    def log(self, iteration: int, stage: str, rows: pa.Table) -> None:
        values = {n: v for n, v in zip(tracker_names(rows), rows["value"].to_pylist()) if v is not None}
        self._send_once(iteration, stage, values)

    def _send_once(self, iteration: int, stage: str, values: dict[str, float]) -> None:
        if iteration <= self.sent.get(stage, -1):
            return  # this tracker holds the step already (its store keeps every point: no duplicates)
        self.send(iteration, values)
        self.sent[stage] = iteration
        if self.durable_send:
            self.save()

    def save(self) -> None:
        self.state["sent"] = self.sent
        self.run.child(TRACKERS_DIR).fs.create_dir(self.run.child(TRACKERS_DIR).path, recursive=True)
        tmp = self.run.child(TRACKERS_DIR).child(f".{self.name}.json.tmp")
        tmp.write_text(json.dumps(self.state, indent=1, sort_keys=True))
        tmp.fs.move(tmp.path, self.state_file.path)  # a reader sees the old state or the new one

    def drop_after(self, iteration: int) -> None:
        """Nothing: the points of later iterations stay in the tracker's store (append-only)."""

    def send(self, iteration: int, values: dict[str, float]) -> None:
        raise NotImplementedError


def read_state(run: Location, name: str) -> dict[str, Any] | None:
    """The state of tracker ``name`` in the run folder ``run`` (None when it has none)."""
    path = run.child(TRACKERS_DIR).child(f"{name}.json")
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{path.uri()} is not JSON ({err}); delete it to start a new {name} run for this run "
                          "folder") from err
    if not isinstance(state, dict) or not isinstance(state.get("run"), str):
        raise ConfigError(f"{path.uri()} names no {name} run; delete it to start a new {name} run for this run folder")
    return state


# ---- TensorBoard ------------------------------------------------------------------------------------------------

def _tensorboard_check(options, run: Location, field: str) -> None:
    """Its event files go to the run folder (checked with the run folder itself)."""


def _tensorboard_open(options, run: Location, params: Mapping[str, Any]) -> Tracker:
    return TensorBoardMirror(run.uri())


TRACKERS.register("tensorboard")(TrackerSpec(_tensorboard_check, _tensorboard_open))


# ---- MLflow -----------------------------------------------------------------------------------------------------

MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /:]")  # what MLflow accepts in a metric or param name
MLFLOW_BATCH = 100  # params per log_batch call (MLflow's limit)
MLFLOW_PARAM_CHARS = 6000  # MLflow's longest param value


def mlflow_store(run: Location) -> str:
    """The run folder's own MLflow store: a SQLite database in its local side."""
    return f"sqlite:///{os.path.abspath(local_side(run))}/{MLFLOW_DIR}/mlflow.db"


def _mlflow_check(options, run: Location, field: str) -> None:
    """The library is installed; a server URI answers MLflow's /health; a database's folder can be written."""
    _require("mlflow", "mlflow-skinny", field)
    uri = options.tracking_uri
    if uri is None:
        return  # the run folder's own store (the run folder itself is checked)
    if uri.startswith("sqlite:///"):
        try:
            check_output_location(os.path.dirname(uri.removeprefix("sqlite:///")) or ".")
        except ConfigError as err:
            raise ConfigError(f"{field}.tracking_uri {uri}: {err}") from err
        return
    health = f"{uri.rstrip('/')}/health"
    try:
        with urllib.request.urlopen(health, timeout=CHECK_TIMEOUT_S) as answer:
            ok = answer.status == 200
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise ConfigError(f"{field}.tracking_uri {uri}: no MLflow tracking server answers ({health}: "
                          f"{getattr(err, 'reason', err)}); start it (`mlflow server --host 127.0.0.1 --port 5000 "
                          "--backend-store-uri sqlite:///mlflow.db`), correct the URI, or set tracking_uri: null "
                          "for the run folder's own store") from None
    if not ok:
        raise ConfigError(f"{field}.tracking_uri {uri}: {health} answered {answer.status}, not an MLflow tracking "
                          "server's 200; correct the URI (the server's address, without a path)")


class MlflowTracker(_AppendOnly):
    """An MLflow run: params = the frozen config, metrics by name and step = iteration."""

    name = "mlflow"

    def __init__(self, options, run: Location, params: Mapping[str, Any]) -> None:
        from mlflow import MlflowClient

        super().__init__(run)
        uri = options.tracking_uri or mlflow_store(run)
        if options.tracking_uri is None:
            os.makedirs(f"{local_side(run)}/{MLFLOW_DIR}", exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        if self.state.get("tracking_uri") == uri:
            self.run_id = self.state["run"]
            self.client.get_run(self.run_id)  # raises when the store has lost it
        else:
            self.run_id = self._new_run(options, uri, params)
            self.state.update({"run": self.run_id, "tracking_uri": uri})
            self.sent = {}
            self.save()
        self.catch_up()

    def _new_run(self, options, uri: str, params: Mapping[str, Any]) -> str:
        from mlflow.entities import Param

        experiment = self.client.get_experiment_by_name(options.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        elif options.tracking_uri is None:  # artifacts beside the database, in the run folder
            artifacts = f"{os.path.abspath(local_side(self.run))}/{MLFLOW_DIR}/artifacts"
            experiment_id = self.client.create_experiment(options.experiment_name, artifact_location=artifacts)
        else:
            experiment_id = self.client.create_experiment(options.experiment_name)
        name = options.run_name or params.get("run_name") or self.run.path.rsplit("/", 1)[-1]
        created = self.client.create_run(experiment_id, run_name=name,
                                         tags={"rollflow.run_folder": self.run.uri(), **options.tags})
        run_id = created.info.run_id
        items = [Param(MLFLOW_KEY.sub("_", k)[:250], v[:MLFLOW_PARAM_CHARS]) for k, v in flat_params(params).items()]
        for start in range(0, len(items), MLFLOW_BATCH):
            self.client.log_batch(run_id, params=items[start:start + MLFLOW_BATCH])
        return run_id

    def send(self, iteration: int, values: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(MLFLOW_KEY.sub("_", k), v, now_ms, iteration)
                                                    for k, v in values.items()])

    def close(self) -> None:
        """The MLflow run stays RUNNING between a run's sessions; it is not marked finished here (a resume
        continues it)."""


TRACKERS.register("mlflow")(TrackerSpec(_mlflow_check, MlflowTracker))


# ---- Weights & Biases -------------------------------------------------------------------------------------------

WANDB_HOST = "https://api.wandb.ai"


def _wandb_api_key(host: str) -> str | None:
    """W&B's API key as wandb finds it: WANDB_API_KEY, else the netrc entry `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(re.sub(r"^https?://", "", host).split("/")[0])
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry else None


def _wandb_check(options, run: Location, field: str) -> None:
    """The library is installed; online: an API key, and the W&B server answers."""
    _require("wandb", "wandb", field)
    if options.mode == "offline":
        return
    host = os.environ.get("WANDB_BASE_URL", WANDB_HOST).rstrip("/")
    if not _wandb_api_key(host):
        raise ConfigError(f"{field}.mode is online but no W&B API key is set for {host}; set WANDB_API_KEY (or run "
                          "`wandb login`), or use mode: offline (the default: upload later with `wandb sync`)")
    try:
        with urllib.request.urlopen(host, timeout=CHECK_TIMEOUT_S):
            pass
    except urllib.error.HTTPError:
        pass  # it answered
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise ConfigError(f"{field}.mode is online but {host} does not answer ({getattr(err, 'reason', err)}); "
                          "check the network (or WANDB_BASE_URL), or use mode: offline and `wandb sync` "
                          "later") from None


class WandbTracker(_AppendOnly):
    """A W&B run (offline by default, files under the run folder's ``wandb/``): config = the frozen config,
    ``run.log(values, step=iteration)``; resumed by its id with ``resume="allow"``."""

    name = "wandb"
    durable_send = False  # wandb's service writes the session's files at finish(); a killed run leaves none

    def __init__(self, options, run: Location, params: Mapping[str, Any]) -> None:
        import wandb

        super().__init__(run)
        if "run" not in self.state:
            self.state["run"] = secrets.token_hex(4)  # W&B run ids: [a-z0-9], 8 characters here
            self.sent = {}
        folder = local_side(run)
        os.makedirs(folder, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, save_code=False, disable_git=True,
                                  x_disable_stats=True, x_disable_meta=True)
        # offline, each session writes its own offline-run-<time>-<id> folder under the same id (W&B ignores resume)
        resume = "allow" if options.mode == "online" else None
        self.wandb_run = wandb.init(id=self.state["run"], resume=resume, mode=options.mode, dir=folder,
                                    project=options.project, entity=options.entity,
                                    name=options.name or params.get("run_name"), group=options.group,
                                    tags=options.tags or None, notes=options.notes, config=dict(params),
                                    settings=settings, reinit="create_new")
        self.save()
        self.catch_up()

    def send(self, iteration: int, values: dict[str, float]) -> None:
        self.wandb_run.log(values, step=iteration)

    def close(self) -> None:
        """Finish the W&B run, wait until W&B's service has written its files, then record what they hold.

        finish() returns once the service has the run's exit record, but the service writes the session's
        ``run-<id>.wandb`` when it closes the run's stream, after that (seen: a file of only its 7-byte header right
        after finish()); a state counting those steps as sent would lose them if the process died then.
        ``wandb.teardown()`` waits for this process's service to exit, its files written whole."""
        import wandb

        self.wandb_run.finish()
        wandb.teardown()
        self.save()


TRACKERS.register("wandb")(TrackerSpec(_wandb_check, WandbTracker))
