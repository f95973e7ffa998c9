"""Config of the RLVR data side (``rollflow score``, the RLVR chain): ROLL's ``RLVRConfig`` option names (spec §7.1)
plus a ``rewards`` section that routes each domain to a reward worker (ROLL's ``rewards: {domain: worker}``).

Each stage hashes only its own section: :func:`reward_section` (routing), :func:`rlvr_reward_section` (sample masks
and reward normalisation, §3.3/§3.5), :func:`rlvr_advantage_section` (token rewards and advantages, §2.4/§4.3).
Rules are checked once at load time; each message gives the rule, the reason and the fix.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from schemas.capabilities import estimator_capabilities
from schemas.config import AdvantageOptions, AdvantageSection, AdvEstimator, Frozen, RuntimeConfig, section
from schemas.rollout_config import EngineConfig

RLVRNormType = Literal["batch", "group", "running"]


class RewardRouteConfig(Frozen):
    """One domain's reward worker."""

    worker: str = Field(..., min_length=1, description="Registered worker name (math_rule, code_sandbox, llm_judge, "
                                                       "multiple_choice_boxed, general_val_rule, crossthinkqa, "
                                                       "ifeval, detection) or 'module:name' of a custom worker.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Constructor keywords of the worker (or "
                                                                     "keywords of a function worker).")


class RewardsConfig(Frozen):
    """Which worker scores which rows: rows are routed by the value of ``domain_column``; ``'*'`` catches the rest.
    This is also the reward stage's section (its fingerprint)."""

    domain_column: str = Field("domain", min_length=1, description="Column whose value picks the route (domain or "
                                                                   "tag). The RLVR chain normalises per value of it.")
    routes: dict[str, RewardRouteConfig] = Field(..., description="domain value → {worker, kwargs}; '*' = fallback.")

    @field_validator("routes")
    @classmethod
    def _some_routes(cls, routes: dict[str, RewardRouteConfig]) -> dict[str, RewardRouteConfig]:
        if not routes:
            raise ValueError("rewards.routes is empty, but every row must be scored by some worker; add a route "
                             "such as  math: {worker: math_rule}")
        if any(not key for key in routes):
            raise ValueError("rewards.routes has an empty domain key; name the domain value (or '*' as fallback)")
        return routes


class JudgeEngineConfig(EngineConfig):
    """The judge's engine: an :class:`EngineConfig` that reserves no CPU unless told to (it idles outside the reward
    stage, and an engine holding a CPU for the whole run starves the reward stage's actors on a small machine)."""

    num_cpus_per_engine: float = Field(0.0, ge=0.0, description="CPUs reserved by the judge's engine actor in Ray "
                                                                "(default 0: it computes only while the reward stage "
                                                                "waits for it).")


class JudgeConfig(Frozen):
    """The model behind ``llm_judge`` routes, in an engine of its own (ROLL's judge model of LLMJudgeRewardWorker): never
    the policy being trained. Not part of any fingerprint (the judge's replies are; a changed judge scores anew only
    with ``--force`` or a new output)."""

    model: str | None = Field(None, description="HF checkpoint folder of the judge (null: the default model, "
                                                "SmolLM2-135M-Instruct converted from the shipped GGUF).")
    engine: JudgeEngineConfig = Field(default_factory=JudgeEngineConfig, description="The judge's engine (vllm or "
                                      "hf; it idles outside the reward stage, so it reserves no CPU by default).")
    max_new_tokens: int = Field(256, gt=0, description="Reply budget of a verdict. The judge prompts ask for the "
                                                       "verdict line first and a brief explanation after it, so a reply "
                                                       "cut at the budget keeps its verdict.")
    sequence_length: int = Field(2048, gt=0, description="Judge prompt + reply tokens; a longer prompt is not judged "
                                                         "(its row cannot be scored). Also the judge engine's context "
                                                         "window unless judge.engine.max_model_len (>= it) is set.")

    @model_validator(mode="after")
    def _reply_fits(self) -> "JudgeConfig":
        if self.engine.device_mapping is not None or self.engine.sleep_level:
            raise ValueError("judge.engine.device_mapping / sleep_level: the judge's engine is not colocated (it "
                             "scores while the policy's engine is awake, and it keeps its own reservation); remove "
                             "them and set judge.engine.num_gpus_per_engine for a GPU of its own")
        window = self.engine.max_model_len
        if window is not None and window < self.sequence_length:
            raise ValueError(f"judge.engine.max_model_len ({window}) must be >= judge.sequence_length "
                             f"({self.sequence_length}), because a judge prompt and its reply of sequence_length tokens "
                             f"must fit the engine's context; raise judge.engine.max_model_len to "
                             f"{self.sequence_length} or leave it unset")
        if self.max_new_tokens >= self.sequence_length:
            raise ValueError(f"judge.max_new_tokens ({self.max_new_tokens}) must be below judge.sequence_length "
                             f"({self.sequence_length}), because the judge prompt needs room too; raise "
                             "judge.sequence_length or lower judge.max_new_tokens")
        return self


class RLVRRewardOptions(Frozen):
    """RLVR's sample-mask and reward post-processing options (ROLL's names and defaults), declared once for the
    config (:class:`RLVROptions`) and for the response_rewards stage's section (:class:`RLVRRewardSection`)."""

    num_return_sequences_in_group: int = Field(1, ge=1, description="Responses per prompt (the group size n); every "
                                                                    "prompt_id must have exactly n rows.")
    # §3.5 sample masks
    max_len_mask: bool = Field(False, description="Drop truncated responses (response length = max_new_tokens).")
    difficulty_mask: bool = Field(False, description="Keep only prompts whose group pass rate is strictly inside "
                                                     "(difficulty_low_threshold, difficulty_high_threshold).")
    difficulty_low_threshold: float = Field(0.0, description="Lower (exclusive) bound of the group pass rate.")
    difficulty_high_threshold: float = Field(1.0, description="Upper (exclusive) bound of the group pass rate.")
    error_max_len_clip: bool = Field(False, description="Keep rows with score 1, or score 0 and length < "
                                                        "error_max_len_threshold.")
    error_max_len_threshold: int = Field(9999999999, gt=0, description="Length bound of error_max_len_clip.")
    # §3.3 reward post-processing (adv_estimator, reward_clip and the §2.4 token-reward / §4.3 advantage options come
    # from AdvantageOptions)
    norm_mean_type: RLVRNormType | None = Field(None, description="Mean of the reward normalisation: batch, group "
                                                                  "(per prompt), running (per domain), or none.")
    norm_std_type: RLVRNormType | None = Field(None, description="Std of the reward normalisation (same choices).")


class RLVROptions(AdvantageOptions, RLVRRewardOptions):
    """The RLVR chain's options (ROLL's RLVRConfig / PPOConfig data-side options, ROLL's defaults): the shared
    advantage options plus the RLVR reward routing, sample masks and reward normalisation. The generation budget that
    max_len_mask compares with is :meth:`generation_budget`: ``rollflow score``'s max_new_tokens, a training run's
    generating_args.max_new_tokens."""

    rewards: RewardsConfig = Field(..., description="Reward routing by domain.")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="The model of llm_judge routes (read only "
                                                                        "when a route uses that worker; set without "
                                                                        "one, refused before anything starts).")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="Execution settings.")

    def generation_budget(self) -> int | None:
        """The generation token budget Lmax of the responses (None: unknown)."""
        raise NotImplementedError

    @model_validator(mode="after")
    def _rlvr_rules(self) -> "RLVROptions":
        est = estimator_capabilities(self.adv_estimator)
        if est.agentic_only:
            raise ValueError(f"adv_estimator '{self.adv_estimator}' is agentic-only, because its returns follow the "
                             "turn segments of multi-turn trajectories and an RLVR response has one segment; use "
                             "grpo, reinforce or gae")
        n = self.num_return_sequences_in_group
        group_norm = est.forces_group_norm or "group" in (self.norm_mean_type, self.norm_std_type)
        if group_norm and n < 2:
            why = (f"adv_estimator {self.adv_estimator} normalises" if est.forces_group_norm
                   else "norm_mean_type/norm_std_type 'group' normalises")
            raise ValueError(f"num_return_sequences_in_group ({n}) must be at least 2, because {why} each prompt's "
                             "rewards by their group mean/std and a group of one has no spread; set "
                             "num_return_sequences_in_group: 8")
        ignored = {f: v for f, v in (("norm_mean_type", self.norm_mean_type), ("norm_std_type", self.norm_std_type))
                   if v not in (None, "group")}
        if est.forces_group_norm and ignored:
            field, value = next(iter(ignored.items()))
            raise ValueError(f"{field} '{value}' is ignored with adv_estimator {self.adv_estimator}, which normalises "
                             "each prompt's rewards by its group's mean and std whatever the norm types say (ROLL's "
                             "RLVR reward post-processing, spec §3.3), so it would change nothing; remove "
                             f"{', '.join(ignored)}, or use adv_estimator reinforce with {field}: {value}")
        if self.max_len_mask and self.generation_budget() is None:
            raise ValueError("max_len_mask needs max_new_tokens, because a response is truncated when its length "
                             "equals the generation budget; set max_new_tokens to the rollout's budget")
        if self.difficulty_mask and not self.difficulty_low_threshold < self.difficulty_high_threshold:
            raise ValueError(f"difficulty_low_threshold ({self.difficulty_low_threshold}) must be below "
                             f"difficulty_high_threshold ({self.difficulty_high_threshold}), because the kept pass "
                             "rates lie strictly between them and an empty interval masks every row; e.g. 0.0 and 1.0")
        if self.difficulty_mask and n < 2:
            raise ValueError("difficulty_mask keeps a prompt's responses by the mean score of its group, but "
                             f"num_return_sequences_in_group is {n}, and with groups of one it keeps every row "
                             "(ROLL's difficulty_mask, spec §3.5), so it would change nothing; set "
                             "num_return_sequences_in_group: 8, or difficulty_mask: false")
        return self


class RLVRConfig(RLVROptions):
    """``rollflow score``: the RLVR chain's options over stored responses, whose generation budget it is told."""

    max_new_tokens: int | None = Field(None, gt=0, description="Generation token budget Lmax (ROLL: sequence_length - "
                                                               "prompt_length); needed by max_len_mask.")

    def generation_budget(self) -> int | None:
        return self.max_new_tokens


# ---- stage sections -------------------------------------------------------------------------------------------

class RLVRRewardSection(RLVRRewardOptions):
    """What the response-rewards stage reads in an RLVR run (§3.5 sample masks, §3.3 reward post-processing per
    domain; the domains come with the scores): the RLVR reward options, the generation budget and, of the advantage
    options, those the reward post-processing needs."""

    max_new_tokens: int | None
    adv_estimator: AdvEstimator
    reward_clip: float | None


def reward_section(config: RLVROptions) -> RewardsConfig:
    """The reward stage's section: the routing."""
    return config.rewards


def rlvr_reward_section(config: RLVROptions) -> RLVRRewardSection:
    fields = {name: getattr(config, name) for name in RLVRRewardSection.model_fields if name != "max_new_tokens"}
    return RLVRRewardSection.model_validate({**fields, "max_new_tokens": config.generation_budget()})


def rlvr_advantage_section(config: RLVROptions) -> AdvantageSection:
    """The advantages stage's section (the stage both pipelines run; the domains come with ``rewarded``)."""
    return section(config, AdvantageSection)
