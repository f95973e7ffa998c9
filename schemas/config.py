"""Frozen, validated config models with ROLL's option names (spec §7). Loaded once from YAML in ``configs/``.

A ROLL user recognises the top level: ``adv_estimator``, ``gamma``, ``lambd``, ``reward_normalization``,
``init_kl_coef``, ``advantage_clip``, ... Each stage receives only its own section, extracted by
:func:`section` from the fields its section model declares; the section is what the stage fingerprint hashes.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, field_validator,
                      model_serializer, model_validator)

from schemas.capabilities import ESTIMATOR_CAPABILITIES, estimator_capabilities
from schemas.errors import ConfigError
from schemas.stage_specs import pinnable_stages

# the names of the capability table's rows (gae, reinforce, grpo, gigpo, step_reinforce, agentic_reinforce)
AdvEstimator = Literal[tuple(ESTIMATOR_CAPABILITIES)]  # type: ignore[valid-type]
NormType = Literal["batch", "group", "running"]
KLPenalty = Literal["kl", "abs", "mse", "k3", "full"]
# reward_normalization.grouping: ROLL's names (and ours) of the samples table column a group shares (spec §5.2; ROLL's
# traj_group_id is our group_id, its tags our tag); "batch" is one group. The response_rewards stage reads them here.
GROUPING_COLUMNS = {"traj_group_id": "group_id", "tags": "tag", "traj_id": "traj_id", "group_id": "group_id",
                    "tag": "tag"}
Grouping = Literal[("batch", *GROUPING_COLUMNS)]  # type: ignore[valid-type]


class Frozen(BaseModel):
    # .nan / .inf are refused everywhere: no option means anything with them (a clip, coefficient or bound of nan
    # turns every value it touches into nan; null is the way to switch an option off)
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_section_is_default(cls, data: Any) -> Any:
        """A section written with nothing under it (``reward_normalization:``, YAML null) is its defaults, in every
        config model alike (as ``--set`` into it already was); a required section, and an option whose null means
        something (``X | None``), keep the null and the model reports or uses it."""
        if not isinstance(data, dict):
            return data
        empty = [name for name in _sections_with_defaults(cls) if name in data and data[name] is None]
        return {k: v for k, v in data.items() if k not in empty} if empty else data


@functools.cache
def _sections_with_defaults(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``model`` that hold a config model (a section) and have a default, by the key written for them."""
    return tuple(f.alias or name for name, f in model.model_fields.items()
                 if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel) and not f.is_required())


class OmitDefaults(Frozen):
    """A model whose later-added options (``omit_when_default``: field → the value that means "not used") are left
    out of its dump while they have that value, so a config that does not use them dumps, and a run's config.json and
    every fingerprint hash, exactly what they did before the options existed (loading fills the defaults in again)."""

    omit_when_default: ClassVar[dict[str, Any]] = {}

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return self.omit_unused(handler(self))

    def omit_unused(self, data: Any) -> Any:
        """The dump ``data`` of this model without the ``omit_when_default`` options that have their unused value."""
        if isinstance(data, dict):
            for name, unused in self.omit_when_default.items():
                if name in data and getattr(self, name) == unused:
                    del data[name]
        return data


def options_set(section: BaseModel, prefix: str = "") -> list[str]:
    """The options a config sets in ``section`` (a model whose options all have defaults) to other than their
    defaults, as dotted names under ``prefix``, a nested section's options by theirs (``judge.engine.options``).
    Only what the config itself names counts (pydantic's ``model_fields_set``: an option left out, whose default may
    be resolved on this host, ``dtype: auto``, is not one), compared with the validated defaults (a default written
    out is not one either)."""
    defaults = type(section)()
    found = []
    for name in type(section).model_fields:
        if name not in section.model_fields_set:
            continue
        value, default = getattr(section, name), getattr(defaults, name)
        if isinstance(value, BaseModel) and type(value) is type(default):
            found += options_set(value, f"{prefix}{name}.")
        elif value != default:
            found.append(f"{prefix}{name}")
    return found


def refuse_unless_above(label: str, value: float | None, bound: float, why: str, null_ok: bool = False) -> None:
    """The rule of an optional number option that, when set, must exceed ``bound`` (in a model validator): a
    ValueError "<label> (<value>) must be [null or ]> <bound>, <why>" otherwise (``null_ok``: the message offers
    null, the option's 'off'; ``why``: the reason and the fix)."""
    if value is not None and value <= bound:
        raise ValueError(f"{label} ({value}) must be {'null or ' if null_ok else ''}> {bound:g}, {why}")


class RewardNormalizationConfig(Frozen):
    """Agentic reward normalisation (spec §5.2)."""

    grouping: Grouping = Field("batch", description="'batch' for one group, or the column to group by: "
                                                    "traj_group_id (= group_id here: the episodes of one level), "
                                                    "tags (= tag: one environment), traj_id (one episode's rows).")
    method: Literal["identity", "mean", "mean_std", "asym_clip"] = Field(
        "identity", description="Deprecated ROLL field deriving the norm types: identity, mean, mean_std, asym_clip.")
    norm_mean_type: Literal["batch", "group"] | None = Field(None, description="Explicit mean type; wins over method.")
    norm_std_type: Literal["batch", "group"] | None = Field(None, description="Explicit std type; wins over method.")


class AdvantageOptions(Frozen):
    """The token-reward and advantage options both pipelines share (ROLL's PPOConfig names and defaults), declared
    once with their rules; the agentic :class:`AlgorithmConfig` and the RLVR ``RLVRConfig`` add their own."""

    adv_estimator: AdvEstimator = Field("gae", description="Advantage estimator (ROLL names). RLVR forces group "
                                                           "mean/std reward normalisation for grpo and refuses the "
                                                           "agentic-only estimators.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Token-level discount of the advantage recursion.")
    lambd: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    reward_clip: float | None = Field(None, description="Clip the response-level (normalised) rewards and the token "
                                                        "rewards to ±reward_clip (null: no clipping).")
    advantage_clip: float | None = Field(None, description="Clip advantages to ±advantage_clip.")
    whiten_rewards: bool = Field(False, description="Whiten token rewards over the valid tokens of the batch "
                                                    "(agentic) or of each domain (RLVR).")
    whiten_advantages: bool = Field(False, description="Whiten advantages over the valid tokens of the batch "
                                                       "(agentic) or of each domain (RLVR).")
    add_token_level_kl: bool = Field(False, description="Subtract beta·KL(old‖ref) from the token rewards.")
    kl_penalty: KLPenalty = Field("kl", description="KL estimator for token rewards: kl, abs, mse, k3, full.")
    init_kl_coef: float = Field(0.2, ge=0.0, description="Initial KL coefficient beta.")
    target_kl: float | None = Field(None, description="Adaptive KL controller target (None: fixed controller).")
    kl_horizon: int = Field(10000, gt=0, description="Adaptive KL controller horizon.")
    roll_compat: bool = Field(False, description="Reproduce ROLL's defects, for comparison runs only: GAE over "
                                                 "unmasked values (BUG-4) and, agentic, BUG-5/6.")

    # a distinct name: a subclass's validator of the same name would replace this one instead of running after it
    @model_validator(mode="after")
    def _advantage_option_rules(self) -> "AdvantageOptions":
        refuse_unless_above("reward_clip", self.reward_clip, 0, null_ok=True, why=(
            "because ROLL treats 0 as 'off' "
            "and a negative bound is meaningless; set reward_clip: null to disable clipping"))
        refuse_unless_above("advantage_clip", self.advantage_clip, 0, null_ok=True, why=(
            "because clamping to "
            f"±{self.advantage_clip} would zero every advantage; set advantage_clip: null to disable"))
        if self.kl_penalty == "full":
            raise ValueError("kl_penalty 'full' needs each token's whole log-distribution over the vocabulary, but the "
                             "tables store only the sampled tokens' log-probs (old_log_probs, ref_log_probs); set "
                             "kl_penalty to kl, abs, mse or k3")
        if self.kl_penalty != "kl" and not self.add_token_level_kl:
            raise ValueError(f"kl_penalty '{self.kl_penalty}' is the estimator of the token-level KL, which "
                             "add_token_level_kl: false leaves out of the token rewards, so it would change nothing "
                             "(train.kl_loss_type is the KL loss's estimator); set add_token_level_kl: true, or "
                             "remove kl_penalty")
        refuse_unless_above("target_kl", self.target_kl, 0, why=(
            "because the adaptive controller divides by "
            "it; set target_kl: null for a fixed KL coefficient"))
        return self


class AgenticRewardOptions(Frozen):
    """The agentic response-reward options (ROLL's AgenticConfig names and defaults), declared once for the config
    (:class:`AlgorithmConfig`) and for the response_rewards stage's section (:class:`ResponseRewardSection`)."""

    step_reward_gamma: float = Field(0.95, ge=0.0, le=1.0, description="Discount of step rewards across turns "
                                                                       "(gigpo, step_reinforce).")
    reward_normalization: RewardNormalizationConfig = Field(default_factory=RewardNormalizationConfig,
                                                            description="Agentic reward normalisation.")
    episode_reward_weight: float = Field(1.0, description="GiGPO weight of the episode-level normalised reward.")
    step_reward_weight: float = Field(1.0, description="GiGPO weight of the step-level normalised reward.")


class AlgorithmConfig(AdvantageOptions, AgenticRewardOptions):
    """The data-side algorithm options of ROLL's PPOConfig / AgenticConfig, with ROLL's defaults: the shared
    advantage options plus the agentic reward options."""

    # a distinct name: a subclass's validator of the same name would replace this one instead of running after it
    @model_validator(mode="after")
    def _reward_weight_rules(self) -> "AlgorithmConfig":
        if estimator_capabilities(self.adv_estimator).response_reward == "gigpo" and self.episode_reward_weight == 0 \
                and self.step_reward_weight == 0:
            raise ValueError("episode_reward_weight and step_reward_weight are both 0, so GiGPO rewards would be 0; "
                             "set episode_reward_weight: 1.0")
        if self.episode_reward_weight < 0 or self.step_reward_weight < 0:
            raise ValueError("episode_reward_weight and step_reward_weight must be >= 0, because a negative weight "
                             "rewards failure; use 0 to switch a part off")
        return self


# resources a stage asks for through its own options (num_cpus..., use_gpu, ...), or that Ray manages itself
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class RuntimeConfig(OmitDefaults):
    """Where and how stages execute. Not part of any stage fingerprint."""

    omit_when_default: ClassVar[dict[str, Any]] = {"stage_resources": {}}

    ray_address: str | None = Field(None, description="Ray cluster to join (default: $RAY_ADDRESS, else a local one).")
    num_cpus: int | None = Field(None, gt=0, description="CPUs of the local Ray cluster (default: all).")
    batch_rows: int = Field(1024, gt=0, description="Rows per Ray Data batch for row-level stages.")
    data_memory_mb: float | None = Field(512, gt=0, description="Bound on the blocks Ray Data keeps in flight in "
                                                                "the object store, MiB, so that memory does not grow "
                                                                "with the data (null: Ray's default, a share of the "
                                                                "object store, i.e. of the machine's memory).")
    stage_resources: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="Custom Ray resources a stage's tasks and actors ask for, by stage, e.g. "
        "{train_step: {trainer_node: 1}}: the stage then runs only on the cluster's nodes that declare them (ray "
        "start --resources='{\"trainer_node\": 4}'). Stages: response_rewards, advantages (each map task), logprobs "
        "(each forward worker, log-probs and values; refused in a training run with kept workers, whose log-probs run "
        "on the training workers: pin train_step), train_step (each training worker). The amount is per task, "
        "actor or worker. Where a stage runs does not change what it writes: not part of any fingerprint.")

    @field_validator("stage_resources")
    @classmethod
    def _known_stages_and_custom_resources(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for stage, resources in value.items():
            if stage not in pinnable_stages():  # the stages declared pinnable (schemas/stage_specs.py)
                raise ValueError(f"runtime.stage_resources names stage '{stage}', which takes no custom Ray resources; "
                                 f"use one of {', '.join(pinnable_stages())}")
            for name, amount in resources.items():
                where = f"runtime.stage_resources.{stage}.{name}"
                if name in RAY_BUILTIN_RESOURCES or name.startswith("node:"):
                    raise ValueError(f"{where}: '{name}' is not a custom resource (the stage's own options set its "
                                     "CPUs, GPUs and memory; node:<ip> names one address, which several nodes of "
                                     "a machine share); name a resource that the nodes declare with ray start "
                                     "--resources, e.g. trainer_node")
                if not amount > 0:
                    raise ValueError(f"{where} is {amount:g}; a stage asks for a positive amount of a resource (e.g. "
                                     f"1, or 0.01 so that many tasks share one unit); remove the entry to not pin "
                                     "the stage")
        return value

    def resources_for(self, stage: str) -> dict[str, float]:
        """The custom Ray resources each task or actor of ``stage`` (a pinnable stage, schemas/stage_specs.py) asks
        for ({} if none)."""
        return dict(self.stage_resources.get(stage, {}))


def raw_section(data: dict, name: str) -> dict | None:
    """The raw mapping of section ``name`` of a config mapping ({} when it is absent or null), or None when it is
    not a mapping (a before-validator then leaves it alone, and the model reports the wrong type)."""
    value = data.get(name)
    if value is None:
        return {}
    return value if isinstance(value, dict) else None


def _valid(model: type[BaseModel], data: dict) -> bool:
    try:
        model.model_validate(data)
    except ValidationError:
        return False
    return True


def drop_section_runtimes(data: dict, sections: tuple[str, ...]) -> dict:
    """A run config's raw mapping without the cluster settings (the fields of :class:`RuntimeConfig`) under the
    ``runtime`` of each of ``sections``: a run declares them once, in its top-level ``runtime``, and hands them to
    each stage (:meth:`schemas.run_config.RunOptions.run_runtime`). A section's value equal to the top-level one or
    to the default is dropped (a run folder's config.json of an earlier version, which copied the run's into every
    section, or spelled out a section's default, still loads); one that differs is an error naming the field and
    the fix. The section's own options (a training section's workers) stay."""
    unset = RuntimeConfig()
    defaults = {field: getattr(unset, field) for field in RuntimeConfig.model_fields}  # the dump leaves some out
    runtime = raw_section(data, "runtime")
    if runtime is None or not _valid(RuntimeConfig, runtime):
        return data  # the model reports the bad runtime once, where it was written
    top = {**defaults, **runtime}
    out = dict(data)
    for name in sections:
        section = raw_section(data, name)
        nested = None if section is None else raw_section(section, "runtime")
        if not nested:
            continue  # none written, or not a mapping (the model reports the wrong type)
        for field in defaults:
            if field in nested and nested[field] not in (top[field], defaults[field]):
                raise ValueError(f"{name}.runtime.{field} ({nested[field]!r}) differs from runtime.{field} "
                                 f"({top[field]!r}); a run has one runtime section, read by all its stages: set "
                                 f"runtime.{field} at the top level and remove {name}.runtime.{field}")
        out[name] = {**section, "runtime": {k: v for k, v in nested.items() if k not in defaults}}
    return out


class RecomputeConfig(AlgorithmConfig):
    """``rollflow recompute``: stored trajectories → rewarded and advantaged tables."""

    group_size: int | None = Field(None, gt=0, description="Trajectories per group; checked when set (required by "
                                                           "group normalisation).")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="Execution settings.")

    @model_validator(mode="after")
    def _group_rules(self) -> "RecomputeConfig":
        rn = self.reward_normalization
        grouped = rn.grouping != "batch" and (rn.method != "identity" or rn.norm_mean_type or rn.norm_std_type)
        if estimator_capabilities(self.adv_estimator).group_relative and grouped and rn.grouping == "traj_group_id" \
                and self.group_size is not None and self.group_size < 2:
            raise ValueError(f"group_size ({self.group_size}) must be at least 2 with adv_estimator "
                             f"{self.adv_estimator} and grouping traj_group_id, because a group of one has no "
                             "variance and every normalised reward would be 0; set group_size: 8")
        return self


# ---- stage sections -------------------------------------------------------------------------------------------
# A section is cut from a validated config, but `rollflow stage --set` changes one directly: a section declares its
# options by the model that declares them for the config (its base), so their bounds hold here too.

class ResponseRewardSection(AgenticRewardOptions):
    """What the response_rewards stage reads: the agentic reward options, and of the advantage options those the
    response rewards need (the RLVR stage reads :class:`schemas.rlvr_config.RLVRRewardSection`)."""

    adv_estimator: AdvEstimator
    reward_clip: float | None
    roll_compat: bool
    group_size: int | None = None


class AdvantageSection(AdvantageOptions):
    """What the advantages stage reads, in both pipelines: exactly the shared advantage options, declared once in
    :class:`AdvantageOptions` with their bounds and rules, which hold for a section ``rollflow stage --set`` changes
    as they do for the config it was cut from (the RLVR stage learns the domains from ``rewarded``)."""


S = TypeVar("S", bound=BaseModel)


def section(config: BaseModel, model: type[S]) -> S:
    """The stage section ``model`` filled from the same-named fields of ``config``."""
    return model.model_validate({k: getattr(config, k) for k in model.model_fields if hasattr(config, k)})


# ---- loading --------------------------------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


class _UniqueKeys:
    """A key written twice in one mapping is an error (PyYAML keeps the last one silently, so the first value a user
    reads in the file is not the one the run uses): mixed into a safe loader."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` merges; its keys may be overridden
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice in one mapping (lines {lines[key]} and {line}), and "
                        "only the last value would be used; remove one of them", key_node.start_mark)
                lines[key] = line
        return super().construct_mapping(node, deep=deep)


class _UniqueKeyLoader(_UniqueKeys, yaml.SafeLoader):
    """PyYAML's safe loader (pure Python) with unique keys: its errors name the offending character and show the
    line."""


class _FastUniqueKeyLoader(_UniqueKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """The same on libyaml's parser (the same constructor and resolver, so the same values), about 9 times faster: a
    shipped config parses in under 1 ms instead of 7 ms, and the commands and tests load configs thousands of times."""


def _yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_FastUniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError:  # the pure-Python parser's error, as the user has always read it
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for depth, k in enumerate(keys[:-1]):
        if node.get(k) is None:  # absent, or an empty section (`rollout:` with nothing under it)
            node[k] = {}
        node = node[k]
        if not isinstance(node, dict):
            kind = "a list" if isinstance(node, list) else f"the value {node!r}"
            raise ConfigError(f"override '{dotted}': '{k}' is not a section but {kind}, which has no options inside; "
                              f"set it whole (--set '{'.'.join(keys[:depth + 1])}=...'), or check the key path")
    node[keys[-1]] = value


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["gamma=0.9", "reward_normalization.method=mean_std"]`` → a dict of dotted keys to YAML-parsed values."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value (e.g. adv_estimator=grpo)")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = _yaml(raw)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"override '{item}': the value {raw!r} is not valid YAML ({mark}); quote it as a "
                              f"string (--set '{key.strip()}=\"...\"') or fix the brackets/quotes") from None
    return out


def _field_path(loc: tuple[int | str, ...]) -> str:
    """``("train", "filters", 0, "agg_type")`` → ``train.filters[0].agg_type``."""
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    return path or "(top level)"


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = _field_path(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown option; check the spelling against configs/ and docs (ROLL option names)"
        elif e["type"] == "finite_number":
            msg = (f"must be a finite number, not {e['input']!r}, because no option means anything with nan or "
                   "infinity (a nan bound or coefficient turns what it touches into nan); write a number, or null "
                   "where the option can be switched off")
        lines.append(f"  field '{loc}': {msg}")
    return "\n".join(lines)


@dataclass(frozen=True)
class CommandConfig:
    """The config model of a command: ``model`` (``module:class``), the ``command`` that takes it, what such a config
    describes, and where examples of it are."""

    model: str
    command: str
    what: str
    examples: str

    def resolve(self) -> type[BaseModel]:
        module, name = self.model.split(":")
        return getattr(importlib.import_module(module), name)


# Every command's config model, most specific first (a scoring config's options are a subset of an RLVR training
# config's). Looked up only by :func:`other_command_config`; named by path because those modules import this one.
COMMAND_CONFIGS = (
    CommandConfig("schemas.config:RecomputeConfig", "rollflow recompute", "rewards and advantages of stored "
                  "trajectories", "configs/recompute_*.yaml"),
    CommandConfig("schemas.rollout_config:RolloutConfig", "rollflow rollout", "episodes played by a policy",
                  "configs/rollout_*.yaml"),
    CommandConfig("schemas.train_config:ForwardConfig", "rollflow logprobs or rollflow values", "a forward pass "
                  "over a samples table", "schemas/train_config.py ForwardConfig"),
    CommandConfig("schemas.rlvr_config:RLVRConfig", "rollflow score", "scoring of stored responses by reward "
                  "workers", "configs/rlvr_math.yaml"),
    CommandConfig("schemas.train_config:TrainStepConfig", "rollflow train-step", "one training step",
                  "schemas/train_config.py TrainStepConfig"),
    CommandConfig("schemas.train_flow_config:TrainFlowConfig", "rollflow train, plan or eval", "an agentic "
                  "training run", "configs/train_*.yaml"),
    CommandConfig("schemas.rlvr_train_config:RLVRTrainConfig", "rollflow train, plan or eval with pipeline: rlvr",
                  "an RLVR training run", "configs/rlvr_train_*.yaml"),
)


def _option_names(model: type[BaseModel]) -> set[str]:
    """The top-level options ``model`` takes: its fields, and the retired copies a run config still accepts (and
    drops: :class:`schemas.run_config.RunOptions`)."""
    retired = {path for path, _ in getattr(model, "retired_copies", ()) if "." not in path}
    return {f.alias or name for name, f in model.model_fields.items()} | retired


def other_command_config(model: type[BaseModel], data: dict) -> tuple[CommandConfig, CommandConfig] | None:
    """(the config kind ``data`` is, the kind ``model`` is) when ``data`` has options ``model`` does not know, they
    are all options of another command's config, and most of its options are that command's (a ``--set`` of the
    command's own option on another command's config is still that config; one stray option is not)."""
    kinds = [(kind, kind.resolve()) for kind in COMMAND_CONFIGS]
    own = next((kind for kind, m in kinds if m is model), None)
    if own is None:  # a section's model (rollflow stage --set), which need not be a pydantic model
        return None
    keys = {k for k in data if isinstance(k, str)}
    foreign = keys - _option_names(model)
    if not foreign:
        return None
    other = next((kind for kind, m in kinds if m is not model and foreign <= _option_names(m)
                  and len(keys & _option_names(m)) > len(keys - _option_names(m))), None)
    return (other, own) if other is not None else None


def validate_config(model: type[M], data: dict, source: str = "(dict)") -> M:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        kinds = other_command_config(model, data)
        if kinds is not None:
            other, own = kinds
            foreign = sorted(k for k in data if isinstance(k, str) and k not in _option_names(model))
            options = f"options {', '.join(foreign)} are not options" if len(foreign) > 1 else \
                f"option {foreign[0]} is not an option"
            raise ConfigError(f"config {source} is a config of {other.command} ({other.what}): its {options} of "
                              f"{own.command}; use it with {other.command}, or pass a config of {own.command} "
                              f"({own.examples})") from None
        raise ConfigError(format_validation_error(err, source)) from None


def load_config(model: type[M], path: str | Path | None, overrides: dict[str, Any] | None = None) -> M:
    """Read YAML ``path`` (or nothing), apply dotted ``overrides``, validate into the frozen ``model``."""
    return validate_config(model, load_config_data(path, overrides), str(path) if path else "(defaults)")


def load_config_data(path: str | Path | None, overrides: dict[str, Any] | None = None) -> dict:
    """The raw mapping of YAML ``path`` (or {}) with dotted ``overrides`` applied, not yet validated. The one place a
    command's config file is opened: it must exist, be a file, be UTF-8 text, parse as YAML and hold a non-empty
    mapping of options; else a ConfigError naming the file and the fix."""
    data = read_config_file(Path(path)) if path is not None else {}
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    return data


def read_config_file(path: Path) -> dict:
    """The options of the YAML config file ``path`` (see :func:`load_config_data`)."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; pass a YAML file (e.g. one from configs/)")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass a file from configs/") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read ({err.strerror}); pass a file you can read") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start}); "
                          "a config is YAML text: save it as UTF-8, or pass the YAML file instead") from None
    try:
        loaded = _yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if loaded is None or loaded == {}:
        raise ConfigError(f"config file {path} holds no options (it is empty or only comments), so the command "
                          "would run on defaults it was not asked for; write its options (see configs/), or leave "
                          "out --config to use the defaults on purpose")
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of options at the top level")
    return loaded
