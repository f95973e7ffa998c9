"""The options of the actor losses with ROLL's names (spec §6.3–6.6, §7.1), declared once: the losses read them
(``stages.losses.LossConfig`` is :class:`LossOptions`) and the training section inherits them
(:class:`schemas.train_config.TrainSection`), so a training config's top-level ``pg_clip``, ``loss_agg_mode``,
``train_infer_correction: {is_weight: {...}, filters: [...]}``, ... are these fields.

Ours, beyond ROLL: ``dual_clip_c`` (null → ROLL's 1 + 2·pg_clip, [Q-15]); ``kl_loss_type`` (ROLL hard-wires k3);
``sum_norm_constant`` (null → ROLL's padded length T, [Q-14]); ``roll_compat`` (reproduce ROLL's BUG-7/8/9).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, get_args

from pydantic import Field, FieldSerializationInfo, field_serializer, model_validator

from schemas.config import Frozen, refuse_unless_above, validate_config
from schemas.errors import ConfigError

AggType = Literal["token", "geometric", "sequence", "segment"]
AGG_TYPES: tuple[str, ...] = get_args(AggType)
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
KLLossType = Literal["kl", "abs", "mse", "k3"]


class IsWeightConfig(Frozen):
    """ROLL's ``train_infer_correction.is_weight``: weight = ratio[weight_type], clamped to [0, upper_bound]."""

    enabled: bool = Field(False, description="Multiply the token losses by the train/infer importance weight.")
    weight_type: AggType = Field("token", description="Granularity of the ratio e^(old - infer): token, geometric, "
                                                      "sequence or segment.")
    upper_bound: float | None = Field(1.2, description="Clamp the weight to [0, upper_bound] (null: no clamp).")
    detach: bool = Field(True, description="Stop the gradient through the weight.")

    @model_validator(mode="after")
    def _positive_bound(self) -> "IsWeightConfig":
        refuse_unless_above("is_weight.upper_bound", self.upper_bound, 0, null_ok=True, why=(
            "because the weight is "
            f"clamped to [0, upper_bound] and a bound <= 0 makes every weight {self.upper_bound} "
            "(no gradient, or the loss's sign flipped); use e.g. 1.2 (ROLL's default), or null for "
            "no clamp"))
        return self


class FilterConfig(Frozen):
    """One entry of ROLL's ``train_infer_correction.filters``: keep tokens with low ≤ ratio/diff[agg_type] ≤ high."""

    enabled: bool = Field(False, description="Apply this filter.")
    agg_type: AggType = Field("token", description="Granularity: token, geometric, sequence or segment.")
    ratio_enabled: bool = Field(True, description="Filter on the ratio e^(old - infer).")
    ratio_low: float = Field(0.8, description="Lowest kept ratio.")
    ratio_high: float = Field(1.2, description="Highest kept ratio.")
    diff_enabled: bool = Field(False, description="Filter on the probability gap e^old - e^infer.")
    diff_low: float = Field(-0.2, description="Lowest kept gap.")
    diff_high: float = Field(0.2, description="Highest kept gap.")

    @model_validator(mode="after")
    def _ranges(self) -> "FilterConfig":
        for kind in ("ratio", "diff"):
            low, high = getattr(self, f"{kind}_low"), getattr(self, f"{kind}_high")
            if low > high:
                raise ValueError(f"{kind}_low ({low}) must not exceed {kind}_high ({high}), because a token is kept "
                                 f"when {kind}_low <= {kind} <= {kind}_high and an empty range drops every token; "
                                 "swap them")
        if self.ratio_high <= 0:
            raise ValueError(f"ratio_high ({self.ratio_high}) must be > 0, because the ratio e^(old - infer) is "
                             "positive and every token would be dropped; use e.g. 1.2")
        return self


class TrainInferCorrectionConfig(Frozen):
    """ROLL's ``train_infer_correction`` (spec §6.6); a null entry means its default, as in ROLL's YAML."""

    is_weight: IsWeightConfig = Field(default_factory=IsWeightConfig, description="The importance weight.")
    filters: tuple[FilterConfig, ...] = Field((), description="Token filters, all applied (a token must pass each).")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, Mapping) else data

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "TrainInferCorrectionConfig":
        """From ROLL's nested dict ``{is_weight: {...}, filters: [{...}, ...]}``; a ConfigError names a bad entry."""
        d = dict(d or {})
        unknown = set(d) - set(cls.model_fields)
        if unknown:
            raise ConfigError(f"train_infer_correction has unknown keys {sorted(unknown)}; allowed: is_weight, filters")
        return validate_config(cls, d, "train_infer_correction")


class LossOptions(Frozen):
    """Options of the actor losses (agentic §6.3, base §6.4, rlvr §6.5, train/infer correction §6.6)."""

    pg_clip: float = Field(0.2, gt=0, description="PPO ratio clip epsilon.")
    use_pg_clip_range: bool = Field(False, description="Use pg_clip_low / pg_clip_high instead of pg_clip.")
    pg_clip_low: float = Field(0.2, gt=0, description="Lower ratio clip epsilon (use_pg_clip_range).")
    pg_clip_high: float = Field(0.2, gt=0, description="Upper ratio clip epsilon (use_pg_clip_range).")
    dual_clip_loss: bool = Field(False, description="Dual-clip PPO for negative advantages.")
    dual_clip_c: float | None = Field(None, description="Dual-clip constant (null: ROLL's 1 + 2*pg_clip).")
    loss_agg_mode: LossAggMode = Field("seq-mean-token-mean", description="Loss aggregation (spec §6.1).")
    sum_norm_constant: float | None = Field(None, description="Constant of seq-mean-token-sum-norm (null: ROLL's "
                                                              "padded length).")
    use_kl_loss: bool = Field(False, description="Add kl_loss_coef x KL(pi || ref) to the loss.")
    kl_loss_coef: float = Field(0.0, ge=0, description="KL loss coefficient.")
    kl_loss_type: KLLossType = Field("k3", description="KL estimator of the KL loss.")
    entropy_loss_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    ratio_type: Literal["token", "segment"] = Field("token", description="Agentic ratio: per token or per turn.")
    importance_sampling: Literal["token", "seq"] = Field("token", description="RLVR ratio: per token or sequence.")
    rl_loss_coef: float = Field(1.0, gt=0, description="Scale of the pg + KL terms of the rlvr policy loss (ROLL's "
                                                       "RLVR actor, spec §6.5; > 0: a negative scale ascends the "
                                                       "loss, 0 leaves only the entropy bonus). The agentic and base "
                                                       "losses do not read it (nor does ROLL's agentic pipeline): "
                                                       "another value needs policy_loss: rlvr.")
    difficulty_loss_weight: bool = Field(False, description="RLVR difficulty sample weights (policy_loss: rlvr "
                                                            "only): each row's pg loss weighed by 0.5 + 1.5·clip("
                                                            "difficulty, 0, 1), from the training table's per-row "
                                                            "'difficulty' column (rollflow train-step).")
    length_loss_weight: bool = Field(False, description="RLVR length sample weights (policy_loss: rlvr only).")
    train_infer_correction: TrainInferCorrectionConfig = Field(
        default_factory=TrainInferCorrectionConfig, description="ROLL's train/infer mismatch correction "
                                                                "{is_weight: {...}, filters: [...]} (spec §6.6).")
    roll_compat: bool = Field(False, description="Reproduce ROLL's loss defects (comparison runs only).")

    # a distinct name: a subclass's validator of the same name would replace this one instead of running after it
    @model_validator(mode="after")
    def _loss_option_rules(self) -> "LossOptions":
        refuse_unless_above("dual_clip_c", self.dual_clip_c, 1, why=(
            "because the dual clip bounds a negative "
            "advantage's loss at c*|A|; use e.g. 3.0, or null for ROLL's 1 + 2*pg_clip"))
        refuse_unless_above("sum_norm_constant", self.sum_norm_constant, 0, why=(
            "because it divides the "
            "summed token losses; use e.g. the maximum response length, or null for ROLL's padded "
            "length"))
        return self

    @field_serializer("train_infer_correction")
    def _as_written(self, value: TrainInferCorrectionConfig, info: FieldSerializationInfo) -> dict[str, Any]:
        """Only the entries set, as written: the mapping that the training section's fingerprint and a run's
        config.json have always held (loading fills in the defaults again)."""
        return value.model_dump(mode=info.mode, exclude_unset=True)

    @property
    def clip_range(self) -> tuple[float, float]:
        """(ε_low, ε_high) of the ratio clip (spec §6.3 step 6)."""
        if self.use_pg_clip_range:
            return self.pg_clip_low, self.pg_clip_high
        return self.pg_clip, self.pg_clip

    @property
    def dual_clip_constant(self) -> float:
        """c of the dual clip: ``dual_clip_c`` or ROLL's fixed 1 + 2·pg_clip [Q-15]."""
        return 1.0 + 2.0 * self.pg_clip if self.dual_clip_c is None else self.dual_clip_c

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LossOptions":
        """From ROLL-style flat options (``train_infer_correction`` nested); a ConfigError names a bad option."""
        unknown = set(d) - set(cls.model_fields)
        if unknown:
            raise ConfigError(f"loss config has unknown options {sorted(unknown)}; known: "
                              f"{', '.join(sorted(cls.model_fields))}")
        return validate_config(cls, dict(d), "loss options")
