"""``rollflow train`` with ``pipeline: rlvr``: the RLVR training run (spec §0.4 "RLVR pipeline").

Per step: a batch of prompts → ``num_return_sequences_in_group`` responses each (the generation engine) → reward
workers → sample masks and reward post-processing → token rewards → advantages → old log-probs → one PPO step.
The data-side options are :class:`schemas.rlvr_config.RLVROptions`'s (ROLL's names); the sections below add the
prompts, generation, log-prob and training settings.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from schemas.config import Frozen
from schemas.rlvr_config import RewardsConfig, RLVROptions
from schemas.rollout_config import EngineConfig, GeneratingArgs
from schemas.run_config import RunOptions


class PromptSetConfig(Frozen):
    """The prompts data set: JSONL files ``<data_dir>/<domain>.jsonl`` with ``id, domain, tag, prompt,
    ground_truth`` per line (the shipped sets live in ``data/rlvr``)."""

    data_dir: str | None = Field(None, description="Folder of the JSONL files (null: the shipped data/rlvr).")
    domains: tuple[str, ...] = Field(("math",), min_length=1, description="Which files (domains) to use.")
    limit: int | None = Field(None, gt=0, description="Use only the first N prompts of each domain.")
    system_prompt: str = Field("You are a helpful assistant. Think briefly, then give the final answer.",
                               description="System message of every prompt.")


class ValidationPromptsConfig(PromptSetConfig):
    """The validation prompts: by default the shipped multiple-choice set (kept apart from the training prompts)."""

    domains: tuple[str, ...] = Field(("mcq",), min_length=1, description="Which files (domains) to use.")


class ValidationConfig(Frozen):
    """Validation of an RLVR run (ROLL's ``validation`` with its ``eval_steps``): held-out prompts answered by the
    policy before training and after every ``eval_steps`` steps, scored by reward workers; ``rollflow eval`` runs it
    for one checkpoint. The samples of every validation use the same seeds, so runs and checkpoints compare."""

    eval_steps: int = Field(0, ge=0, description="Validate before training and after every N training steps "
                                                 "(0: never in a run; rollflow eval still can).")
    prompts: ValidationPromptsConfig = Field(default_factory=ValidationPromptsConfig, description="The validation "
                                             "prompts (data/rlvr files; keep them apart from the training prompts).")
    num_return_sequences: int = Field(1, ge=1, description="Responses per validation prompt.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of validation (0: greedy).")
    rewards: RewardsConfig | None = Field(
        default_factory=lambda: RewardsConfig(routes={"mcq": {"worker": "general_val_rule"}}),
        description="Reward routes of the validation prompts (default: the shipped MCQ set scored by the general "
                    "validation rule; null: the run's own routes).")


class RLVRTrainConfig(RLVROptions, RunOptions):
    """One RLVR run: ROLL's RLVR data-side options at the top level, plus prompts and generation; the run's folder,
    length, initial policy, log-prob and training sections are :class:`RunOptions`'s."""

    # the scoring config's max_new_tokens is generating_args.max_new_tokens here (earlier versions copied it up)
    retired_copies: ClassVar[tuple[tuple[str, str], ...]] = (*RunOptions.retired_copies,
                                                             ("max_new_tokens", "generating_args.max_new_tokens"))

    pipeline: Literal["rlvr"] = Field("rlvr", description="Which training flow runs this config.")
    run_name: str = Field("rlvr", description="Folder name under runs_dir: letters, digits, '_', '-' and '.', not "
                                              "'.' or '..', at most 255 bytes.")
    seed: int = Field(42, ge=0, description="Seed of the prompt order and of every sampling request.")
    rollout_batch_size: int = Field(8, gt=0, description="Prompts per step (ROLL name); each gets "
                                                         "num_return_sequences_in_group responses.")
    prompts: PromptSetConfig = Field(default_factory=PromptSetConfig, description="The prompts data set.")
    sequence_length: int = Field(1024, gt=0, description="Prompt + response token budget.")
    generating_args: GeneratingArgs = Field(default_factory=GeneratingArgs, description="Sampling parameters.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The generation engine.")
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Held-out validation.")

    def generation_engine(self) -> EngineConfig:
        """The engine settings (the engines live for the whole run)."""
        return self.engine

    def generation_window(self) -> int:
        """The context length of the generation engines (:meth:`EngineConfig.window`)."""
        return self.engine.window(self.sequence_length)

    def generation_budget(self) -> int:
        """The generation budget, set once in generating_args and read twice (generation, and the max_len_mask of
        the sample masks)."""
        return self.generating_args.max_new_tokens

    @model_validator(mode="after")
    def _lengths(self) -> "RLVRTrainConfig":
        budget = self.generating_args.max_new_tokens
        if budget >= self.sequence_length:
            raise ValueError(f"generating_args.max_new_tokens ({budget}) must be below sequence_length "
                             f"({self.sequence_length}), because sequence_length holds the prompt and the response "
                             "(ROLL: max_new_tokens = sequence_length - prompt_length) and a budget it cannot hold is "
                             "cut per prompt, so max_len_mask no longer finds the truncated responses; raise "
                             "sequence_length or lower generating_args.max_new_tokens")
        window = self.engine.max_model_len
        if window is not None and window < self.sequence_length:
            raise ValueError(f"engine.max_model_len ({window}) must be >= sequence_length ({self.sequence_length}), "
                             "because a prompt and its response of sequence_length tokens must fit the engine's "
                             f"context; raise engine.max_model_len to {self.sequence_length} or leave it unset")
        return self

    def validation_rewards(self) -> RewardsConfig:
        """The reward routes of the validation prompts (the validation's own, else the run's)."""
        return self.validation.rewards or self.rewards

    @model_validator(mode="after")
    def _validation_routes(self) -> "RLVRTrainConfig":
        routes = self.validation_rewards().routes
        missing = [d for d in self.validation.prompts.domains if d not in routes and "*" not in routes]
        if missing:
            raise ValueError(f"validation.prompts.domains {missing} have no reward route, so their answers could not "
                             "be scored; add validation.rewards.routes for them (e.g. mcq: {worker: general_val_rule})")
        return self
