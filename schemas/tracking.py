"""Where a run's metrics go besides its metrics table: ROLL's ``track_with`` and ``tracker_kwargs``.

ROLL names one tracker (``track_with: tensorboard``) and passes ``tracker_kwargs`` to it; here ``track_with`` is a
list of any of :data:`TRACKER_OPTIONS`' names (ROLL's single name is accepted too) and ``tracker_kwargs`` holds one
section per tracker, checked like every other section (``tracker_kwargs: {wandb: {project: my-project}}``).
The trackers themselves (stages/trackers.py) register under the same names; this table is what a config validates
against, so schemas/ imports nothing of stages/.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from schemas.config import Frozen


class TensorBoardOptions(Frozen):
    """TensorBoard takes no options: its event files are the run folder's ``tensorboard/``."""


class MlflowOptions(Frozen):
    """An MLflow run per training run: a local tracking store in the run folder, or a tracking server by URI."""

    tracking_uri: str | None = Field(None, description="MLflow tracking URI: a server (http://host:5000) or a "
                                                        "database (sqlite:///path/mlflow.db); null: a local store "
                                                        "in the run folder (mlflow/mlflow.db; `mlflow ui "
                                                        "--backend-store-uri sqlite:///runs/<run>/mlflow/mlflow.db`).")
    experiment_name: str = Field("rollflow", min_length=1, description="The MLflow experiment (made when missing).")
    run_name: str | None = Field(None, description="The MLflow run's name (null: the run's run_name).")
    tags: dict[str, str] = Field(default_factory=dict, description="Tags set on the MLflow run.")

    @field_validator("tracking_uri")
    @classmethod
    def _a_scheme_we_can_check(cls, uri: str | None) -> str | None:
        """A server or a database URI: a bare host:port would be read by MLflow as a local folder of that name."""
        if uri is None:
            return uri
        scheme = re.match(r"^([a-z][a-z0-9+.-]*)://", uri)
        if scheme is None or scheme.group(1) not in ("http", "https", "sqlite"):
            raise ValueError(f"tracking_uri {uri!r} is not an MLflow server or database URI; write "
                             "http://HOST:PORT (a tracking server) or sqlite:///PATH.db (MLflow 3 refuses a folder "
                             "store), or null for the run folder's own store")
        return uri


class WandbOptions(Frozen):
    """A Weights & Biases run per training run, offline by default (no network; upload later with `wandb sync`)."""

    mode: Literal["offline", "online"] = Field("offline", description="offline: files under the run folder's "
                                               "wandb/, uploaded later with `wandb sync runs/<run>/wandb/offline-"
                                               "run-*`; online: sent as the run goes (needs an API key: "
                                               "WANDB_API_KEY or `wandb login`).")
    project: str = Field("rollflow", min_length=1, description="The W&B project.")
    entity: str | None = Field(None, description="The W&B team or user (null: the API key's default).")
    name: str | None = Field(None, description="The W&B run's display name (null: the run's run_name).")
    group: str | None = Field(None, description="The W&B run group.")
    tags: list[str] = Field(default_factory=list, description="Tags of the W&B run.")
    notes: str | None = Field(None, description="Notes of the W&B run.")


TrackerName = Literal["tensorboard", "mlflow", "wandb"]


class TrackerKwargs(Frozen):
    """One section per tracker (ROLL's tracker_kwargs, split by tracker because several can run together)."""

    tensorboard: TensorBoardOptions = Field(default_factory=TensorBoardOptions, description="TensorBoard's options.")
    mlflow: MlflowOptions = Field(default_factory=MlflowOptions, description="MLflow's options.")
    wandb: WandbOptions = Field(default_factory=WandbOptions, description="Weights & Biases' options.")


TRACKER_OPTIONS: dict[str, type[Frozen]] = {name: TrackerKwargs.model_fields[name].annotation
                                             for name in TrackerKwargs.model_fields}


class TrackingOptions(Frozen):
    """``track_with`` and ``tracker_kwargs`` of a run (a part of every training config: schemas/run_config.py)."""

    track_with: list[TrackerName] = Field(default_factory=lambda: ["tensorboard"],
                                          description="Where the metrics go besides the metrics table: any of "
                                                      "tensorboard, mlflow, wandb (ROLL's track_with; a single "
                                                      "name or a list; [] for the table only).")
    tracker_kwargs: TrackerKwargs = Field(default_factory=TrackerKwargs, description="Each tracker's options, "
                                          "under its name: {mlflow: {tracking_uri: ...}, wandb: {project: ...}}.")

    @field_validator("track_with", mode="before")
    @classmethod
    def _one_name_or_a_list(cls, value: Any) -> Any:
        """ROLL writes one name (``track_with: wandb``); a list names several; each once."""
        names = [value] if isinstance(value, str) else value
        if isinstance(names, list):
            twice = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
            if twice:
                raise ValueError(f"track_with names {twice} more than once; name each tracker once")
        return names

    @model_validator(mode="after")
    def _kwargs_of_a_tracker_in_use(self) -> "TrackingOptions":
        """Options of a tracker the run does not use are a mistake (a tracker left out, or a typo in track_with);
        its defaults spelled out (a frozen config has every section) are not."""
        unused = sorted(name for name in set(TRACKER_OPTIONS) - set(self.track_with)
                        if getattr(self.tracker_kwargs, name) != TRACKER_OPTIONS[name]())
        if unused:
            raise ValueError(f"tracker_kwargs sets {unused} but track_with is {self.track_with}; add them to "
                             "track_with, or remove their tracker_kwargs")
        return self
