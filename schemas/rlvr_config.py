"""Config of the RLVR data side (``rollflow score``, the RLVR chain): ROLL's ``RLVRConfig`` option names (spec §7.1)
plus a ``rewards`` section that routes each domain to a reward worker (ROLL's ``rewards: {domain: worker}``).

Each stage hashes only its own section: :func:`reward_section` (routing), :func:`rlvr_reward_section` (sample masks
and reward normalisation, §3.3/§3.5), :func:`rlvr_advantage_section` (token rewards and advantages, §2.4/§4.3).
Rules are checked once at load time; each message gives the rule, the reason and the fix.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from schemas.config import AdvEstimator, Frozen, KLPenalty, RuntimeConfig

RLVRNormType = Literal["batch", "group", "running"]
# §3.3: estimators whose RLVR reward normalisation is forced to (group, group).
GROUP_NORM_ESTIMATORS = frozenset({"grpo"})


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


class RLVRConfig(Frozen):
    """``rollflow score`` and the RLVR chain (ROLL's RLVRConfig / PPOConfig data-side options, ROLL's defaults)."""

    rewards: RewardsConfig = Field(..., description="Reward routing by domain.")
    num_return_sequences_in_group: int = Field(1, ge=1, description="Responses per prompt (the group size n); every "
                                                                    "prompt_id must have exactly n rows.")
    # §3.5 sample masks
    max_len_mask: bool = Field(False, description="Drop truncated responses (response length = max_new_tokens).")
    max_new_tokens: int | None = Field(None, gt=0, description="Generation token budget Lmax (ROLL: sequence_length - "
                                                               "prompt_length); needed by max_len_mask.")
    difficulty_mask: bool = Field(False, description="Keep only prompts whose group pass rate is strictly inside "
                                                     "(difficulty_low_threshold, difficulty_high_threshold).")
    difficulty_low_threshold: float = Field(0.0, description="Lower (exclusive) bound of the group pass rate.")
    difficulty_high_threshold: float = Field(1.0, description="Upper (exclusive) bound of the group pass rate.")
    error_max_len_clip: bool = Field(False, description="Keep rows with score 1, or score 0 and length < "
                                                        "error_max_len_threshold.")
    error_max_len_threshold: int = Field(9999999999, gt=0, description="Length bound of error_max_len_clip.")
    # §3.3 reward post-processing
    adv_estimator: AdvEstimator = Field("gae", description="Advantage estimator (ROLL names; grpo forces group "
                                                           "mean/std normalisation; agentic-only ones are refused).")
    norm_mean_type: RLVRNormType | None = Field(None, description="Mean of the reward normalisation: batch, group "
                                                                  "(per prompt), running (per domain), or none.")
    norm_std_type: RLVRNormType | None = Field(None, description="Std of the reward normalisation (same choices).")
    reward_clip: float | None = Field(None, description="Clip normalised and token rewards to ±reward_clip.")
    # §2.4 token rewards, §2.2 KL controller
    add_token_level_kl: bool = Field(False, description="Subtract beta·KL(old‖ref) from the token rewards.")
    kl_penalty: KLPenalty = Field("kl", description="KL estimator for token rewards: kl, abs, mse, k3, full.")
    init_kl_coef: float = Field(0.2, ge=0.0, description="Initial KL coefficient beta.")
    target_kl: float | None = Field(None, description="Adaptive KL controller target (None: fixed controller).")
    kl_horizon: int = Field(10000, gt=0, description="Adaptive KL controller horizon.")
    # §4.3 advantages
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Token-level discount of the advantage recursion.")
    lambd: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    whiten_rewards: bool = Field(False, description="Whiten token rewards over the valid tokens of each domain.")
    whiten_advantages: bool = Field(False, description="Whiten advantages over the valid tokens of each domain.")
    advantage_clip: float | None = Field(None, description="Clip advantages to ±advantage_clip.")
    roll_compat: bool = Field(False, description="GAE over unmasked values as ROLL does (BUG-4), for comparisons.")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="Execution settings.")

    @model_validator(mode="after")
    def _rules(self) -> "RLVRConfig":
        from stages.algos.estimators import ADVANTAGE_ESTIMATORS  # the registry's capabilities (lazy: schemas → algos)

        if ADVANTAGE_ESTIMATORS.get(self.adv_estimator).agentic_only:
            raise ValueError(f"adv_estimator '{self.adv_estimator}' is agentic-only, because its returns follow the "
                             "turn segments of multi-turn trajectories and an RLVR response has one segment; use "
                             "grpo, reinforce or gae")
        n = self.num_return_sequences_in_group
        group_norm = self.adv_estimator in GROUP_NORM_ESTIMATORS or "group" in (self.norm_mean_type,
                                                                                self.norm_std_type)
        if group_norm and n < 2:
            why = (f"adv_estimator {self.adv_estimator} normalises" if self.adv_estimator in GROUP_NORM_ESTIMATORS
                   else "norm_mean_type/norm_std_type 'group' normalises")
            raise ValueError(f"num_return_sequences_in_group ({n}) must be at least 2, because {why} each prompt's "
                             "rewards by their group mean/std and a group of one has no spread; set "
                             "num_return_sequences_in_group: 8")
        if self.max_len_mask and self.max_new_tokens is None:
            raise ValueError("max_len_mask needs max_new_tokens, because a response is truncated when its length "
                             "equals the generation budget; set max_new_tokens to the rollout's budget")
        if self.difficulty_mask and not self.difficulty_low_threshold < self.difficulty_high_threshold:
            raise ValueError(f"difficulty_low_threshold ({self.difficulty_low_threshold}) must be below "
                             f"difficulty_high_threshold ({self.difficulty_high_threshold}), because the kept pass "
                             "rates lie strictly between them and an empty interval masks every row; e.g. 0.0 and 1.0")
        if self.reward_clip is not None and self.reward_clip <= 0:
            raise ValueError(f"reward_clip ({self.reward_clip}) must be null or > 0, because ROLL treats 0 as 'off' "
                             "and a negative bound is meaningless; set reward_clip: null to disable clipping")
        if self.advantage_clip is not None and self.advantage_clip <= 0:
            raise ValueError(f"advantage_clip ({self.advantage_clip}) must be null or > 0, because clamping to "
                             f"±{self.advantage_clip} would zero every advantage; set advantage_clip: null to disable")
        if self.target_kl is not None and self.target_kl <= 0:
            raise ValueError(f"target_kl ({self.target_kl}) must be > 0, because the adaptive controller divides by "
                             "it; set target_kl: null for a fixed KL coefficient")
        return self


# ---- stage sections -------------------------------------------------------------------------------------------

class RLVRRewardSection(Frozen):
    """What the rlvr_rewards stage reads (§3.5 sample masks, §3.3 reward post-processing)."""

    domain_column: str
    num_return_sequences_in_group: int
    max_len_mask: bool
    max_new_tokens: int | None
    difficulty_mask: bool
    difficulty_low_threshold: float
    difficulty_high_threshold: float
    error_max_len_clip: bool
    error_max_len_threshold: int
    adv_estimator: AdvEstimator
    norm_mean_type: RLVRNormType | None
    norm_std_type: RLVRNormType | None
    reward_clip: float | None


class RLVRAdvantageSection(Frozen):
    """What the rlvr_advantages stage reads (§2.4 token rewards, §4.3 advantages)."""

    domain_column: str
    adv_estimator: AdvEstimator
    gamma: float
    lambd: float
    reward_clip: float | None
    advantage_clip: float | None
    whiten_rewards: bool
    whiten_advantages: bool
    add_token_level_kl: bool
    kl_penalty: KLPenalty
    init_kl_coef: float
    target_kl: float | None
    kl_horizon: int
    roll_compat: bool


def _fill(config: RLVRConfig, model: type[Frozen]) -> Any:
    values = {k: getattr(config, k) for k in model.model_fields if k != "domain_column"}
    return model.model_validate({**values, "domain_column": config.rewards.domain_column})


def reward_section(config: RLVRConfig) -> RewardsConfig:
    """The reward stage's section: the routing."""
    return config.rewards


def rlvr_reward_section(config: RLVRConfig) -> RLVRRewardSection:
    return _fill(config, RLVRRewardSection)


def rlvr_advantage_section(config: RLVRConfig) -> RLVRAdvantageSection:
    return _fill(config, RLVRAdvantageSection)
