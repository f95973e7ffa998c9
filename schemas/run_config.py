"""What every training run has, whichever its pipeline (agentic or RLVR): :class:`RunOptions`, declared and
validated once. The pipelines' configs (schemas/train_flow_config.py, schemas/rlvr_train_config.py) add their
rollout or prompt sections to it and to their data-side options (``AlgorithmConfig``, ``RLVRConfig``)."""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar, TypeVar

from pydantic import (BaseModel, Field, SerializerFunctionWrapHandler, field_validator, model_serializer,
                      model_validator)

from schemas.config import OmitDefaults, RuntimeConfig, drop_section_runtimes, raw_section
from schemas.devices import check_async_placement, check_device_mappings
from schemas.names import run_name
from schemas.tracking import TrackingOptions
from schemas.train_config import ForwardConfig, RunTrainConfig, TrainStepConfig


R = TypeVar("R", bound=RuntimeConfig)
# where RunOptions.train_step_config keeps its result: (the train section, the estimator, the top-level runtime, the
# TrainStepConfig)
_TRAIN_STEP_KEY = "_train_step_config"
# train.train_infer_correction of an asynchronous run that sets none (ROLL's token-level is_weight, spec §6.6)
ASYNC_CORRECTION = {"is_weight": {"enabled": True, "weight_type": "token", "upper_bound": 1.2}}


def rollout_lag(ratio: float) -> int:
    """How many iterations a rollout's policy may be behind the one trained at ``async_generation_ratio`` ``ratio``:
    ceil(ratio); 0 plays each iteration's rollout in turn."""
    return math.ceil(ratio)


def played_with(iteration: int, lag: int) -> int:
    """The policy (its number of training steps) the rollout of ``iteration`` plays with when rollouts may be ``lag``
    iterations behind (ceil(async_generation_ratio)): ``max(0, iteration - lag)`` — a fixed schedule, so a resumed run
    chooses the same checkpoint; ``iteration`` itself when in turn (``lag`` 0)."""
    return max(0, iteration - lag)


class RunOptions(TrackingOptions, OmitDefaults):
    """The run folder, its length, the initial policy, the log-prob and training sections, and where the metrics go
    besides the metrics table (:class:`TrackingOptions`: ROLL's track_with and tracker_kwargs)."""

    # async_generation_ratio 0 (today's loop) is left out of the dump: a run's config.json and its hashes stay as
    # before the option existed
    omit_when_default: ClassVar[dict] = {"async_generation_ratio": 0.0}
    engine_field: ClassVar[str] = "engine"  # where the generation engine section sits (agentic: rollout.engine)
    # The sections that are also a command's whole config (rollflow logprobs, train-step, rollout) and so hold a
    # runtime of their own. A run declares the cluster settings (RuntimeConfig's fields) once, in its top-level
    # runtime, which the run's accessors hand to each stage (:meth:`run_runtime`); the sections keep only their own
    # options there (loading drops a repeated setting: :func:`schemas.config.drop_section_runtimes`).
    runtime_sections: ClassVar[tuple[str, ...]] = ("logprobs", "train")
    # Options a run sets once that earlier versions also wrote into a second place (so a run folder's config.json
    # holds both): (the retired place, the option's place), dotted. Loading drops the retired one when it repeats the
    # option and refuses it, with the fix, when it differs (:meth:`_one_place`).
    retired_copies: ClassVar[tuple[tuple[str, str], ...]] = (("train.adv_estimator", "adv_estimator"),)

    run_name: str = Field("run", description="Folder name under runs_dir: letters, digits, '_', '-' and '.', not "
                                             "'.' or '..', at most 255 bytes.")
    runs_dir: str = Field("runs", description="Where run folders live (a local path or a pyarrow filesystem URI).")
    max_steps: int = Field(3, gt=0, description="Training steps, i.e. iterations (ROLL's max_steps).")
    pretrain: str | None = Field(None, description="Initial policy: an HF checkpoint folder (null: the default "
                                                   "model, SmolLM2-135M-Instruct converted from the shipped GGUF).")
    logprobs: ForwardConfig = Field(default_factory=ForwardConfig, description="old/ref log-prob stage.")
    train: RunTrainConfig = Field(default_factory=RunTrainConfig, description="Actor (and critic) training (its "
                                  "estimator is the run's adv_estimator).")
    async_generation_ratio: float = Field(
        0.0, ge=0, description="ROLL's asynchronous generation: 0 runs each iteration's stages in turn; r > 0 "
                               "generates the rollouts of iterations k+1 .. k+ceil(r), one after the other, while "
                               "iteration k's log-probs, rewards, advantages and training run, iteration j's with the "
                               "policy after max(0, j - ceil(r)) training steps (at most ceil(r) iterations old). "
                               "The engines need devices of their own (no device_mapping "
                               "shared with training); train.train_infer_correction defaults to ROLL's token-level "
                               "is_weight (upper_bound 1.2) against the engines' log-probs.")

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, value: str) -> str:
        """It becomes the run folder's name (schemas/names.py)."""
        return run_name(value)

    def rollout_staleness(self, iteration: int) -> int | None:
        """Training steps between the policy iteration ``iteration``'s rollout plays (:func:`played_with`) and the one
        trained on it, the samples' ``staleness`` column; None in turn (``async_generation_ratio`` 0: no column, the
        tables as before the option)."""
        lag = rollout_lag(self.async_generation_ratio)
        return iteration - played_with(iteration, lag) if lag else None

    def run_runtime(self, runtime: R) -> R:
        """A section's ``runtime`` (a :class:`RuntimeConfig`, or a subclass with the section's own options) with the
        run's cluster settings, those of its top-level ``runtime`` (each pipeline's config declares it): the
        runtime a stage of the run reads."""
        cluster = getattr(self, "runtime")
        return runtime.model_copy(update={name: getattr(cluster, name) for name in RuntimeConfig.model_fields})

    def train_step_config(self) -> TrainStepConfig:
        """The config of the run's training step: the ``train`` section with the run's ``adv_estimator`` (whether a
        critic trains) and cluster settings (:meth:`run_runtime`). What every reader of the training step's options
        uses, many times an iteration, so it is validated once per config: kept in the instance's ``__dict__``
        (outside the fields, so the dump, equality and hash ignore it, as they do a ``functools.cached_property``; a
        private attribute would count in equality) with the ``train`` section, estimator and top-level runtime it was
        made of. A copy (``model_copy``, deepcopy, pickle) carries it, and one whose ``train``, ``adv_estimator`` or
        ``runtime`` differs makes its own."""
        estimator, cluster = getattr(self, "adv_estimator"), getattr(self, "runtime")
        kept = self.__dict__.get(_TRAIN_STEP_KEY)
        if kept is not None and kept[0] is self.train and kept[1] == estimator and kept[2] is cluster:
            return kept[3]
        fields = {name: getattr(self.train, name) for name in RunTrainConfig.model_fields}
        step = TrainStepConfig.model_validate({**fields, "adv_estimator": estimator,
                                               "runtime": self.run_runtime(self.train.runtime)})
        self.__dict__[_TRAIN_STEP_KEY] = (self.train, estimator, cluster, step)
        return step

    def logprobs_config(self) -> ForwardConfig:
        """The config of the run's log-prob and values stages: the ``logprobs`` section with the run's cluster
        settings (:meth:`run_runtime`)."""
        return self.logprobs.model_copy(update={"runtime": self.run_runtime(self.logprobs.runtime)})

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The dump (a run folder's config.json, and the hashes of it) keeps the format of earlier versions: it also
        writes each ``retired_copies`` place, with the option's value, and the run's cluster settings into the
        runtime of each of ``runtime_sections``, which loading drops again (:meth:`_one_place`)."""
        data = self.omit_unused(handler(self))
        cluster = data.get("runtime")
        for name in self.runtime_sections:
            section = data.get(name)
            if isinstance(cluster, dict) and isinstance(section, dict) and isinstance(section.get("runtime"), dict):
                own = {k: v for k, v in section["runtime"].items() if k not in RuntimeConfig.model_fields}
                section["runtime"] = {**copy.deepcopy(cluster), **own}  # the cluster settings first, as declared
        for retired, option in self.retired_copies:
            *sections, name = retired.split(".")
            node = data
            for section in sections:
                node = node.get(section) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node[name] = self.option_value(option)
        return data

    def option_value(self, dotted: str) -> Any:
        """The value of the option at the dotted path ``dotted`` (e.g. ``generating_args.max_new_tokens``)."""
        value: Any = self
        for name in dotted.split("."):
            value = getattr(value, name)
        return value

    @model_validator(mode="before")
    @classmethod
    def _one_place(cls, data: dict) -> dict:
        """Each option of a run in one place, at load time and only here: a retired copy (``retired_copies``) is
        dropped, and so are the cluster settings repeated under the runtime of each of ``runtime_sections`` (the
        top-level runtime declares them: :func:`schemas.config.drop_section_runtimes`)."""
        if not isinstance(data, dict):
            return data
        for retired, option in cls.retired_copies:
            data = drop_retired_copy(cls, data, retired, option)
        return drop_section_runtimes(data, cls.runtime_sections)

    @model_validator(mode="before")
    @classmethod
    def _async_correction(cls, data: dict) -> dict:
        """With ``async_generation_ratio > 0`` the rollouts are played by an older policy than the one trained, so
        the training section corrects for it by default (ROLL's token-level importance weight e^(old - infer),
        clamped to [0, 1.2], spec §6.6); a ``train.train_infer_correction`` the user wrote wins."""
        if not isinstance(data, dict):
            return data
        ratio, train = data.get("async_generation_ratio", 0), raw_section(data, "train")
        if train is None or not isinstance(ratio, (int, float)) or ratio <= 0 or "train_infer_correction" in train:
            return data
        return {**data, "train": {**train, "train_infer_correction": dict(ASYNC_CORRECTION)}}

    @model_validator(mode="after")
    def _reference_rule(self) -> "RunOptions":
        if (getattr(self, "add_token_level_kl", False) or self.train.use_kl_loss) and not self.logprobs.enable_reference:
            raise ValueError("add_token_level_kl / train.use_kl_loss need the reference model's log-probs; set "
                             "logprobs.enable_reference: true")
        return self

    @model_validator(mode="after")
    def _difficulty_source(self) -> "RunOptions":
        """difficulty_loss_weight weighs rows by the training table's per-row ``difficulty`` column (spec §6.5),
        which no stage of a training run writes: refused here rather than by the first training step."""
        if "difficulty" in self.train_step_config().table_needs:
            raise ValueError("train.difficulty_loss_weight weighs each row's policy loss by the per-row 'difficulty' "
                             "column of the training table (0.5 + 1.5·clip(difficulty, 0, 1), spec §6.5), but no "
                             "stage of a training run writes that column (the prompt files' difficulty is not "
                             "carried into the samples), so the first training step would fail; set "
                             "train.difficulty_loss_weight: false, or train a table that has the column with "
                             "rollflow train-step")
        return self

    @model_validator(mode="after")
    def _device_mappings(self) -> "RunOptions":
        """ROLL's device_mapping rules: which roles share GPUs, and that a colocated engine sleeps between rollouts
        (schemas/devices.py)."""
        check_device_mappings(self)
        check_async_placement(self)
        return self

    @model_validator(mode="after")
    def _forward_workers_options(self) -> "RunOptions":
        """With a kept training group (train.runtime.keep_workers, the default) the actor group computes the
        log-prob and values stages where its workers run (issue 44, stages/train/actor_forward.py): no forward
        worker exists, so the options that place or size one would be ignored. Refused rather than ignored."""
        if not self.train.runtime.keep_workers:
            return self
        fix = ("the actor group computes the log-probs on the training workers (train.runtime.keep_workers: true); "
               "{} or set train.runtime.keep_workers: false for forward workers of their own")
        if self.logprobs.cpus_per_actor != ForwardConfig.model_fields["cpus_per_actor"].default:
            raise ValueError(f"logprobs.cpus_per_actor is {self.logprobs.cpus_per_actor:g}, but no forward worker "
                             "reserves it: " + fix.format("size them with train.runtime.cpus_per_worker and "
                                                          "threads, remove logprobs.cpus_per_actor,"))
        if self.logprobs.device == "cuda" and not self.train.runtime.use_gpu:
            raise ValueError("logprobs.device is cuda, but the log-probs run on the CPU training workers "
                             "(train.runtime.use_gpu: false): " + fix.format("set train.runtime.use_gpu: true to "
                                                                             "run them on GPUs, remove "
                                                                             "logprobs.device,"))
        if "logprobs" in getattr(self, "runtime").stage_resources:
            raise ValueError("runtime.stage_resources.logprobs pins forward workers, but the log-probs run where "
                             "the training workers run: " + fix.format("pin them with runtime.stage_resources."
                                                                       "train_step, remove the logprobs entry,"))
        return self


def _default_at(model: type[BaseModel], dotted: str) -> Any:
    """The default of the option at the dotted path ``dotted`` of ``model`` (through its sections' models)."""
    head, _, rest = dotted.partition(".")
    field = model.model_fields[head]
    if not rest:
        return field.get_default(call_default_factory=True)
    return _default_at(field.annotation, rest)


def drop_retired_copy(model: type[BaseModel], data: dict, retired: str, option: str) -> dict:
    """The raw run config ``data`` without the retired copy at ``retired`` (dotted) of the option at ``option``: an
    equal (or null) copy is dropped (a run folder's config.json of an earlier version holds one), a different one
    refused with the fix. A section that is not a mapping is left to the model to report."""
    def walk(path: str) -> tuple[dict | None, str]:
        *sections, name = path.split(".")
        node: dict | None = data
        for section in sections:
            node = raw_section(node, section) if node is not None else None
        return node, name

    node, name = walk(retired)
    if node is None or name not in node:
        return data
    holder, key = walk(option)
    value = holder.get(key, _default_at(model, option)) if holder is not None else _default_at(model, option)
    if node[name] is not None and node[name] != value:  # null: not set, as earlier versions took it
        raise ValueError(f"{retired} ({node[name]}) differs from {option} ({value}), and a run has one value of it; "
                         f"set it once, at {option}, and remove {retired}")
    return _without(data, retired.split("."))


def _without(data: dict, keys: list[str]) -> dict:
    """``data`` (a raw mapping) without the value at the key path ``keys``, its sections copied, not changed."""
    head, *rest = keys
    if not rest:
        return {k: v for k, v in data.items() if k != head}
    return {**data, head: _without(data[head], rest)}
