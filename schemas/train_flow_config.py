"""``rollflow train``: the agentic training run (spec §0.4, §7). ROLL's algorithm options sit at the top level;
the rollout, log-prob, training and evaluation settings are sections that each stage receives on its own.

The validation rules are ROLL's agentic ones (spec §7.2) plus the consistency checks between sections that ROLL
spreads over several ``__post_init__`` methods; each message gives the rule, the reason and the fix.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from schemas.capabilities import estimator_capabilities
from schemas.config import AlgorithmConfig, RuntimeConfig
from schemas.rollout_config import (MIXED_ENV_FIELDS, EnvManagerConfig, EnvTag, OmitUnsetMixed, RolloutConfig,
                                    check_tags_partition, partition_field, tags_field)
from schemas.run_config import RunOptions


class EvalConfig(OmitUnsetMixed):
    """Evaluation on a fixed held-out seed set (ROLL's val env manager), before training and every ``eval_steps``.
    Its environments are its own (``tags`` / ``num_groups_partition``), by default the training rollout's."""

    _omit_when_none = MIXED_ENV_FIELDS

    eval_steps: int = Field(1, ge=0, description="Evaluate after every N training steps (0: never).")
    seed: int = Field(1_000_003, ge=0, description="Base seed of the held-out levels (never used for training).")
    num_env_groups: int = Field(16, gt=0, description="Held-out levels.")
    group_size: int = Field(1, gt=0, description="Episodes per held-out level.")
    temperature: float | None = Field(None, ge=0.0, description="Sampling temperature of evaluation "
                                                                "(null: the rollout's).")
    tags: tuple[EnvTag, ...] | None = tags_field("here ROLL's val_env_manager tags, the environments evaluated "
                                                 "(null: the training rollout's)")
    num_groups_partition: tuple[int, ...] | None = partition_field(
        "null: the training's partition when it sums to num_env_groups and the tags are the training's, else an even "
        "split")


class TrainFlowConfig(AlgorithmConfig, RunOptions):
    """One agentic RL run: per iteration rollout → log-probs → rewards → advantages → train → checkpoint → eval.
    The run's folder, length, initial policy, log-prob and training sections are :class:`RunOptions`'s."""

    engine_field: ClassVar[str] = "rollout.engine"
    runtime_sections: ClassVar[tuple[str, ...]] = ("rollout", "logprobs", "train")
    pipeline: Literal["agentic"] = Field("agentic", description="Which training flow runs this config.")
    rollout_batch_size: int | None = Field(None, gt=0, description="Trajectories per iteration (ROLL name); when set "
                                                                   "it must equal rollout.env num_env_groups x "
                                                                   "group_size.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout of each iteration.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="The run's Ray cluster and batch "
                                   "settings, read by all its stages (a section's own runtime may only repeat them).")

    @model_validator(mode="after")
    def _agentic_rules(self) -> "TrainFlowConfig":
        env = self.rollout.env
        episodes = env.num_env_groups * env.group_size
        if self.rollout_batch_size is not None:
            if self.rollout_batch_size % env.group_size:
                fixed = (self.rollout_batch_size // env.group_size + 1) * env.group_size
                raise ValueError(f"rollout_batch_size ({self.rollout_batch_size}) must be divisible by "
                                 f"rollout.env.group_size ({env.group_size}), because advantages are normalised over "
                                 f"complete groups; set rollout_batch_size to {fixed}")
            if self.rollout_batch_size != episodes:
                raise ValueError(f"rollout_batch_size ({self.rollout_batch_size}) must equal rollout.env.num_env_groups"
                                 f" x group_size ({episodes}), because every group is rolled out once per iteration; "
                                 f"set rollout.env.num_env_groups to {self.rollout_batch_size // env.group_size}")
        est = estimator_capabilities(self.adv_estimator)
        if est.needs_step_rows and self.rollout.sample_level != "step":
            raise ValueError(f"adv_estimator {self.adv_estimator} needs one sample per environment step (discounted "
                             f"step returns, anchor states), but rollout.sample_level is "
                             f"'{self.rollout.sample_level}'; set rollout.sample_level: step")
        if est.needs_trajectory_rows and self.rollout.sample_level != "trajectory":
            raise ValueError(f"adv_estimator {self.adv_estimator} computes returns over the turns (segments) of one "
                             "trajectory row; set rollout.sample_level: trajectory")
        rn = self.reward_normalization
        grouped = rn.grouping == "traj_group_id" and (rn.method != "identity" or rn.norm_std_type == "group")
        if grouped and env.group_size < 2:
            raise ValueError(f"rollout.env.group_size ({env.group_size}) must be at least 2 when rewards are "
                             "normalised per traj_group_id, because a group of one has no spread and every reward "
                             "would become 0; set rollout.env.group_size: 8")
        self.eval_env()  # the evaluation's tags and partition (errors name eval.*)
        if self.train.runtime.num_workers > 1 and episodes < self.train.runtime.num_workers:
            raise ValueError(f"{episodes} episodes per iteration cannot feed {self.train.runtime.num_workers} training "
                             f"workers; raise rollout.env.num_env_groups or lower train.runtime.num_workers")
        return self

    def generation_engine(self):
        """The engine settings of the rollout (the engines live for the whole run)."""
        return self.rollout.engine

    def generation_window(self) -> int:
        """The context length of the rollout's engines (:meth:`EngineConfig.window`)."""
        return self.rollout.engine.window(self.rollout.sequence_length)

    def rollout_for(self, iteration: int) -> RolloutConfig:
        """The rollout of a training iteration: new levels and samples each iteration, row ids named by run, under
        the run's cluster settings (:meth:`run_runtime`)."""
        return self.rollout.model_copy(update={"iteration": iteration, "run_name": self.run_name,
                                               "runtime": self.run_runtime(self.rollout.runtime)})

    def eval_env(self) -> EnvManagerConfig:
        """The env manager of evaluation (ROLL's val_env_manager): the training's with the held-out counts and the
        evaluation's own tags and partition, resolved from ``eval.tags`` / ``eval.num_groups_partition``."""
        train, ev = self.rollout.env, self.eval
        update: dict = {"num_env_groups": ev.num_env_groups, "group_size": ev.group_size}
        if ev.tags is None and ev.num_groups_partition is None and train.tags is None:
            return train.model_copy(update=update)  # one environment: exactly the training's
        if ev.tags is None and train.tags is None:
            raise ValueError("eval.num_groups_partition is set but neither eval.tags nor rollout.env.tags is, so "
                             "there are no tags to divide the groups among; set eval.tags or remove "
                             "eval.num_groups_partition")
        tags = ev.tags if ev.tags is not None else train.tags
        partition = ev.num_groups_partition
        if partition is None:
            if ev.tags is None and sum(train.partition) == ev.num_env_groups:
                partition = train.partition
            elif ev.num_env_groups % len(tags) == 0 and ev.num_env_groups >= len(tags):
                partition = (ev.num_env_groups // len(tags),) * len(tags)
            else:
                raise ValueError(f"eval.num_env_groups ({ev.num_env_groups}) cannot be split evenly over the "
                                 f"{len(tags)} evaluation tags {list(tags)}; set eval.num_groups_partition "
                                 f"({len(tags)} numbers >= 1 summing to {ev.num_env_groups}) or make "
                                 f"eval.num_env_groups a multiple of {len(tags)}")
        check_tags_partition(tags, partition, ev.num_env_groups, "eval")
        if train.tags is None:  # the single training environment's own fields do not describe the evaluation's
            update.update({"tag": type(train).model_fields["tag"].default, "env_config": {}})
            if train.tag in tags and train.env_config:
                raise ValueError(f"eval.tags names the training's single environment '{train.tag}', whose "
                                 "rollout.env.env_config a mixed evaluation cannot carry; declare it in "
                                 f"rollout.custom_envs ({train.tag}: {{env_config: ...}}) and use rollout.env.tags")
        return train.model_copy(update={**update, "tags": tuple(tags), "num_groups_partition": tuple(partition)})

    def eval_rollout(self) -> RolloutConfig:
        """The held-out rollout: fixed seeds (the same levels at every evaluation), under the run's cluster settings
        (:meth:`run_runtime`)."""
        env = self.eval_env()
        gen = self.rollout.generating_args
        if self.eval.temperature is not None:
            gen = gen.model_copy(update={"temperature": self.eval.temperature})
        return self.rollout.model_copy(update={"env": env, "generating_args": gen, "seed": self.eval.seed,
                                               "iteration": 0, "run_name": f"{self.run_name}-eval",
                                               "runtime": self.run_runtime(self.rollout.runtime)})
