"""Config models of the training, log-prob and values stages, with ROLL's option names (spec §6, §7.1).

A ROLL user recognises the layout: loss options (``pg_clip``, ``loss_agg_mode``, ``use_kl_loss``, ..., declared in
schemas/loss_config.py) and ``ppo_epochs`` at the top level; per-worker sections ``actor_train`` / ``critic_train``
with ``model_args``, ``training_args`` (Hugging Face TrainingArguments names: ``learning_rate``,
``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``lr_scheduler_type``, ``warmup_steps``,
``max_grad_norm``), ``strategy_args`` (``strategy_name: deepspeed_train`` and the ZeRO stage), and the
dynamic-batching switches ``use_dynamic_batching_in_train`` / ``max_tokens_per_microbatch_in_train`` /
``max_tokens_per_microbatch_in_infer``.

Each model is frozen with ``extra="forbid"``; the fingerprint of a stage hashes its section (``runtime`` excluded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AliasChoices, BeforeValidator, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from schemas.capabilities import POLICY_LOSS_CAPABILITIES, estimator_capabilities, policy_loss_capabilities
from schemas.config import AdvEstimator, Frozen, OmitDefaults, RuntimeConfig, refuse_unless_above
from schemas.devices import DeviceMapping
from schemas.loss_config import LossOptions
from schemas.precision import short_validator
from schemas.toolchain import (forward_fused_output_layer, forward_fused_output_layer_validator,
                               fused_output_layer_choice, optimizer_validator, torch_compile_validator)

# ``auto`` (accepted on input) becomes bf16 where the hardware computes bf16 natively, else fp32 (schemas/precision.py)
Precision = Annotated[Literal["fp32", "bf16", "fp16"], BeforeValidator(short_validator)]
ForwardPrecision = Annotated[Literal["fp32", "bf16"], BeforeValidator(short_validator)]


# the linear layers of a Llama-style decoder layer (attention and MLP projections): LoRA's default targets
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_target_modules")


def _attn_alias(value: Any) -> Any:
    """ROLL turns ``fa2`` into Hugging Face's ``flash_attention_2``; both name the variable-length attention here."""
    return "fa2" if value == "flash_attention_2" else value


# model_args.attn_implementation (ROLL's option and values) and the log-prob pass's: auto, sdpa, fa2
AttnImplementation = Annotated[Literal["auto", "sdpa", "fa2"], BeforeValidator(_attn_alias)]
ATTN_DESCRIPTION = (
    "Attention of packed micro-batches (ROLL's option): auto (fa2 on CUDA with use_sequence_packing, else sdpa), "
    "sdpa (Hugging Face's: a packed row gets a block-diagonal T x T mask) or fa2 (also read as flash_attention_2: "
    "variable-length attention from the packed position ids, no T x T mask; on CUDA in bf16/fp16 torch's "
    "FlashAttention-2 varlen kernel, elsewhere causal SDPA per packed row; stages/train/packed_attention.py). "
    "Rows that are not packed run sdpa either way. fa2 needs use_sequence_packing: true.")


def refuse_fa2_unpacked(where: str, choice: str, packed: bool) -> None:
    """fa2 without packing: no micro-batch would use it."""
    if choice == "fa2" and not packed:
        raise ValueError(f"{where}attn_implementation fa2 is the variable-length attention of packed micro-batches, "
                         "and use_sequence_packing is false, so every micro-batch would run sdpa; set "
                         "use_sequence_packing: true, or attn_implementation: auto")


def _module_names(value: Any) -> Any:
    """ROLL writes ``lora_target`` as one comma-separated string (``q_proj,v_proj``): split it into names."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",")]
    return value


class ModelArgs(Frozen):
    """``<worker>.model_args``: how the model is loaded."""

    dtype: Precision = Field("fp32", description="Training precision: auto (bf16 where the GPU or CPU computes bf16 "
                                                 "natively, else fp32; the shipped configs' choice), fp32, bf16 (DeepSpeed bf16 with fp32 master "
                                                 "weights) or fp16 (GPU only, dynamic loss scaling).")
    disable_gradient_checkpointing: bool = Field(True, description="ROLL's switch; false turns activation "
                                                                   "checkpointing on (less memory, ~30% slower).")
    lora_rank: int | None = Field(None, description="LoRA rank r (ROLL's name; null: LoRA off, every weight trains). "
                                  "With a rank, the model is wrapped with peft's LoRA adapters on "
                                  "lora_target_modules, only the adapters (and a critic's value head) train, the "
                                  "optimizer state holds them alone, and checkpoints hold the merged weights plus "
                                  "the adapter (docs/training.md, LoRA).")
    lora_alpha: float | None = Field(None, description="LoRA scaling numerator: the update is (lora_alpha / "
                                     "lora_rank) x B A (ROLL's name; null: 2 x lora_rank, ROLL's default).")
    lora_target_modules: Annotated[list[str], BeforeValidator(_module_names)] = Field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS),
        validation_alias=AliasChoices("lora_target_modules", "lora_target"),
        description="Names of the linear layers that get adapters (peft matches a name against the end of each "
                    "module path); also read as ROLL's lora_target, a comma-separated string; [all] (ROLL's 'all') "
                    "means every linear layer but the output head. Default: the attention and MLP projections of "
                    "Llama-style models.")

    attn_implementation: AttnImplementation = Field("auto", description=ATTN_DESCRIPTION)

    @model_validator(mode="after")
    def _lora_rules(self) -> "ModelArgs":
        if self.lora_rank is None:
            if self.lora_alpha is not None:
                raise ValueError(f"lora_alpha ({self.lora_alpha}) is set but lora_rank is not, so LoRA is off and "
                                 "lora_alpha would be ignored; set lora_rank (e.g. 8) to train LoRA adapters, or "
                                 "remove lora_alpha")
            if list(self.lora_target_modules) != list(LORA_DEFAULT_TARGETS):
                raise ValueError("lora_target_modules is set but lora_rank is not, so LoRA is off and the list would "
                                 "be ignored; set lora_rank (e.g. 8) to train LoRA adapters, or remove "
                                 "lora_target_modules")
            return self
        if self.lora_rank <= 0:
            raise ValueError(f"lora_rank ({self.lora_rank}) must be > 0, because it is the inner size of the "
                             "adapter matrices B (d x r) and A (r x k); use e.g. 8, or null for full training")
        refuse_unless_above("lora_alpha", self.lora_alpha, 0, why=(
            "because the adapter update is scaled by "
            "lora_alpha / lora_rank; use e.g. 2 x lora_rank, or null for lora_rank"))
        if not self.lora_target_modules or any(not str(m).strip() for m in self.lora_target_modules):
            raise ValueError(f"lora_target_modules ({list(self.lora_target_modules)}) must name at least one linear "
                             "layer and no empty name, because LoRA adds its adapters there; use e.g. [q_proj, "
                             "v_proj], or leave it out for the attention and MLP projections")
        return self

    @property
    def lora(self) -> bool:
        """Whether this model trains LoRA adapters instead of its weights."""
        return self.lora_rank is not None

    @property
    def lora_scale(self) -> float:
        """The adapter update's factor lora_alpha / lora_rank (1 when lora_alpha is not set)."""
        if self.lora_rank is None:
            raise ValueError("lora_scale: LoRA is off (model_args.lora_rank is not set)")
        return self.effective_lora_alpha / self.lora_rank

    @property
    def effective_lora_alpha(self) -> float:
        """lora_alpha, or ROLL's default 2 x lora_rank when it is not set."""
        if self.lora_rank is None:
            raise ValueError("lora_alpha: LoRA is off (model_args.lora_rank is not set)")
        return float(self.lora_alpha) if self.lora_alpha is not None else 2.0 * self.lora_rank

    def lora_options(self) -> dict[str, Any] | None:
        """The LoRA options as a checkpoint records them (None: LoRA off)."""
        if self.lora_rank is None:
            return None
        return {"lora_rank": self.lora_rank, "lora_alpha": self.effective_lora_alpha,
                "lora_target_modules": list(self.lora_target_modules)}

    @model_serializer(mode="wrap")
    def _without_lora_when_off(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """With LoRA off the LoRA options are left out of the dump, so the training section's fingerprint and a
        run's config.json stay what they were before the options existed (loading fills in the defaults again)."""
        data = handler(self)
        if self.lora_rank is None and isinstance(data, dict):
            for name in LORA_FIELDS:
                data.pop(name, None)
        if self.attn_implementation == "auto" and isinstance(data, dict):  # fingerprints as before the option
            data.pop("attn_implementation", None)
        return data


class TrainingArgs(Frozen):
    """``<worker>.training_args`` (Hugging Face TrainingArguments names, as in ROLL)."""

    learning_rate: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine"] = Field(
        "constant", description="LR schedule over optimizer steps (HF semantics); warmup is linear from 0.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    max_steps: int | None = Field(None, gt=0, description="Total optimizer steps of the schedule (linear/cosine decay "
                                                          "to 0 at this step); required by linear and cosine.")
    per_device_train_batch_size: int = Field(2, gt=0, description="Rows per micro-batch when dynamic batching is off; "
                                                                  "with gradient_accumulation_steps it sets the "
                                                                  "mini-batch (rows per rank per optimizer step).")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step (mini-batch = "
                                                                  "per_device_train_batch_size x this, per rank).")
    max_grad_norm: float | None = Field(1.0, description="Clip the global gradient norm to this (null: no clipping).")
    seed: int = Field(42, description="Seed of the mini-batch shuffle and of a new critic's value head.")

    @model_validator(mode="after")
    def _rules(self) -> "TrainingArgs":
        if self.lr_scheduler_type in ("linear", "cosine") and self.max_steps is None:
            raise ValueError(f"lr_scheduler_type {self.lr_scheduler_type} decays to 0 at max_steps, which is not set; "
                             "set training_args.max_steps to the total optimizer steps of the run, or use constant")
        if self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps}), "
                             "because the schedule would end before warmup does; lower warmup_steps")
        if self.lr_scheduler_type == "constant" and self.warmup_steps:
            raise ValueError(f"lr_scheduler_type constant has no warmup but warmup_steps is {self.warmup_steps}; use "
                             "constant_with_warmup (or linear/cosine), or set warmup_steps: 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm ({self.max_grad_norm}) must be > 0 or null (no clipping)")
        return self


OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# DeepSpeed's offload sections under zero_optimization and the lowest ZeRO stage each works with
OFFLOAD_MIN_STAGE = {"offload_optimizer": 1, "offload_param": 3}


class StrategyArgs(OmitDefaults):
    """``<worker>.strategy_args``: the DeepSpeed engine."""

    omit_when_default: ClassVar[dict[str, Any]] = {"optimizer": "torch_adamw"}  # fingerprints as before it

    strategy_name: Literal["deepspeed_train"] = Field("deepspeed_train", description="Training backend.")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage: 0 (plain data parallel), 1 (optimizer "
                                            "state sharded over the workers), 2 (and gradients), 3 (and the "
                                            "parameters themselves, gathered layer by layer in the passes and in "
                                            "full for the saved Hugging Face weights).")
    deepspeed_config: dict[str, Any] = Field(default_factory=dict, description="Extra DeepSpeed config keys merged "
                                             "over the generated one; expert use. Offloading goes here: "
                                             "zero_optimization.offload_optimizer (ZeRO >= 1) and "
                                             "zero_optimization.offload_param (ZeRO 3), each {device: cpu|nvme|none, "
                                             "nvme_path: ... for nvme}, on GPU workers only.")
    torch_compile: Annotated[bool, BeforeValidator(torch_compile_validator)] = Field(
        False, description="Compile each decoder layer with torch.compile (fuses the norm, rotary and gated-MLP "
        "element-wise work; the first micro-batches of a new shape pay the compile). It needs a C compiler and "
        "Python's headers: on a host without them true becomes false, with one warning, and the run's config "
        "records false (schemas/toolchain.py).")
    optimizer: Annotated[Literal["torch_adamw", "fused_adam"], BeforeValidator(optimizer_validator)] = Field(
        "torch_adamw", description="The AdamW implementation: torch_adamw (torch.optim.AdamW through DeepSpeed, "
        "fused on CUDA: nothing to build), fused_adam (DeepSpeed's FusedAdam, or its CPU Adam with "
        "offload_optimizer: compiled on first use unless prebuilt, so it needs nvcc of torch's CUDA major version "
        "or a C++ compiler; the GPU pre-flight checks) or auto (the _h100 configs' choice: fused_adam where "
        "DeepSpeed's kernel is already built on this host, else torch_adamw). auto is resolved when the config is "
        "loaded and the run's config records the choice, as dtype auto's: a config without the option means "
        "torch_adamw, so a resumed run keeps torch_adamw even where the kernel was built since. On CPU workers "
        "DeepSpeed runs torch's AdamW either way.")

    @model_validator(mode="after")
    def _zero_rules(self) -> "StrategyArgs":
        zero = self.deepspeed_config.get("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ValueError(f"deepspeed_config.zero_optimization must be a mapping of DeepSpeed's ZeRO options, got "
                             f"{zero!r}; write e.g. {{offload_optimizer: {{device: cpu}}}}, or remove it")
        if "stage" in zero and zero["stage"] != self.zero_stage:
            raise ValueError(f"deepspeed_config.zero_optimization.stage ({zero['stage']}) differs from zero_stage "
                             f"({self.zero_stage}), and the engine would run the former while the checkpoint and the "
                             "resource plan record the latter; set the stage once, in strategy_args.zero_stage")
        for key in self.offloads():
            option = zero[key]
            device = option.get("device") if isinstance(option, dict) else None
            if device not in OFFLOAD_DEVICES:
                raise ValueError(f"deepspeed_config.zero_optimization.{key}.device is {device!r}; DeepSpeed offloads "
                                 f"to one of {list(OFFLOAD_DEVICES)}; write {key}: {{device: cpu}}")
            if device == "nvme" and not option.get("nvme_path"):
                raise ValueError(f"deepspeed_config.zero_optimization.{key}: device nvme needs nvme_path, the folder "
                                 "on the NVMe drive DeepSpeed swaps to; add nvme_path: /local_nvme, or use device: "
                                 "cpu")
            if self.zero_stage < OFFLOAD_MIN_STAGE[key]:
                raise ValueError(f"deepspeed_config.zero_optimization.{key} needs zero_stage >= "
                                 f"{OFFLOAD_MIN_STAGE[key]} (DeepSpeed offloads only what that stage partitions), "
                                 f"but zero_stage is {self.zero_stage}; set zero_stage: {OFFLOAD_MIN_STAGE[key]}, or "
                                 f"remove {key}")
        return self

    def offloads(self) -> list[str]:
        """The offload sections set in deepspeed_config.zero_optimization (device other than none counts)."""
        zero = self.deepspeed_config.get("zero_optimization", {})
        return [k for k in OFFLOAD_MIN_STAGE if k in zero and not (isinstance(zero[k], dict)
                                                                   and zero[k].get("device") == "none")]


class WorkerTrainConfig(OmitDefaults):
    """``actor_train`` / ``critic_train``: one trained model."""

    omit_when_default: ClassVar[dict[str, Any]] = {"use_sequence_packing": False,  # fingerprints as before them
                                                   "fused_output_layer": False}

    model_args: ModelArgs = Field(default_factory=ModelArgs, description="Model loading and precision.")
    training_args: TrainingArgs = Field(default_factory=TrainingArgs, description="Optimizer, schedule, batches.")
    strategy_args: StrategyArgs = Field(default_factory=StrategyArgs, description="DeepSpeed engine settings.")
    use_dynamic_batching_in_train: bool = Field(True, description="Form micro-batches by a token budget instead of "
                                                                  "per_device_train_batch_size rows.")
    max_tokens_per_microbatch_in_train: int = Field(4096, gt=0, description="Token budget of a training micro-batch "
                                                    "(rows x padded length; real tokens with use_sequence_packing); a "
                                                    "longer single row gets its own.")
    use_sequence_packing: bool = Field(False, description="Run each micro-batch's rows packed into one row without "
                                       "padding, forward and backward (ROLL's name; positions restart per row, so "
                                       "each row attends to itself only); with dynamic batching the token budget then "
                                       "counts real tokens. The same loss and gradients up to float rounding.")
    fused_output_layer: bool = Field("auto", description="The training step's log-probs and entropy (actor) straight "
                                     "from the output layer, a chunk of tokens at a time, its backward recomputing each chunk, so "
                                     "the (tokens, vocabulary) logits are never held (stages/losses/fused_output.py; "
                                     "the same values up to float32 rounding): auto (true on a CUDA host unless "
                                     "zero_stage is 3; the run's config records the choice), true or false. Needs a "
                                     "plain linear output layer and ZeRO 0-2.")

    @model_validator(mode="before")
    @classmethod
    def _resolve_fused_output_layer(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("fused_output_layer", "auto") == "auto":
            strategy = data.get("strategy_args") or {}
            zero = strategy.get("zero_stage", 2) if isinstance(strategy, dict) else strategy.zero_stage
            data = {**data, "fused_output_layer": fused_output_layer_choice("auto", zero)}
        return data

    @model_validator(mode="after")
    def _fused_zero3(self) -> "WorkerTrainConfig":
        if self.fused_output_layer and self.strategy_args.zero_stage == 3:
            raise ValueError("fused_output_layer: true with strategy_args.zero_stage 3 is not supported: ZeRO-3 "
                             "gathers the output layer's weight only inside the layer's own forward, which the fused "
                             "path bypasses; set fused_output_layer: false (or auto), or zero_stage: 2")
        return self

    @model_validator(mode="after")
    def _fa2_needs_packing(self) -> "WorkerTrainConfig":
        refuse_fa2_unpacked("model_args.", self.model_args.attn_implementation, self.use_sequence_packing)
        return self

    @model_validator(mode="after")
    def _lora_zero3(self) -> "WorkerTrainConfig":
        if self.model_args.lora and self.strategy_args.zero_stage == 3:
            raise ValueError("model_args.lora_rank with strategy_args.zero_stage 3 is not supported: the merged "
                             "LoRA weights a checkpoint holds are built from whole base weights, which ZeRO-3 "
                             "partitions; LoRA trains few parameters, so ZeRO-2 shards almost everything there is "
                             "to shard: set zero_stage: 2")
        return self


class TrainOptions(LossOptions):
    """The options of a PPO training step of the actor (and the critic), whoever sets the estimator: the loss options
    (``pg_clip``, ``loss_agg_mode``, ``train_infer_correction``, ...) are :class:`LossOptions`'s."""

    policy_loss: Literal[tuple(POLICY_LOSS_CAPABILITIES)] = Field(  # type: ignore[valid-type]
        "agentic", description="Actor loss (registry POLICY_LOSSES): agentic §6.3, base §6.4, rlvr §6.5.")
    ppo_epochs: int = Field(1, gt=0, description="Passes over the table per training step.")
    value_clip: float | None = Field(None, description="Critic value clipping (null: off).")
    critic_warmup: int = Field(0, ge=0, description="Train only the critic while the step count is below this.")
    compute_entropy_metric: bool = Field(True, description="Report actor/entropy (one more pass over the logits).")
    actor_train: WorkerTrainConfig = Field(default_factory=WorkerTrainConfig, description="The trained policy.")
    critic_train: WorkerTrainConfig = Field(default_factory=WorkerTrainConfig, description="The critic (gae only).")

    @model_validator(mode="after")
    def _value_clip_rule(self) -> "TrainOptions":
        refuse_unless_above("value_clip", self.value_clip, 0, null_ok=True, why=(
            "because the critic's values are "
            f"clipped to old value ± value_clip and a bound <= 0 leaves no range; set value_clip: "
            "null to turn value clipping off, or e.g. 0.5"))
        return self

    @model_validator(mode="after")
    def _options_of_another_loss(self) -> "TrainOptions":
        for loss in POLICY_LOSS_CAPABILITIES.values():
            for name in loss.own_options:
                value, default = getattr(self, name), type(self).model_fields[name].default
                if loss.name != self.policy_loss and value != default:
                    raise ValueError(f"{name} ({value}) is read only by the {loss.name} policy loss, but policy_loss "
                                     f"is {self.policy_loss}, which ignores it (as ROLL's agentic and base actor "
                                     f"losses do, spec §6.3-6.5), so it would change nothing; set policy_loss: "
                                     f"{loss.name}, or remove {name} (default {default})")
        return self

    @model_validator(mode="after")
    def _ratio_level_of_another_loss(self) -> "TrainOptions":
        """ratio_type: segment (the agentic loss) and importance_sampling: seq (the rlvr loss) with a policy loss that
        has no such ratio: that loss computes per-token ratios whatever they say (spec §6.3-6.5)."""
        ours = policy_loss_capabilities(self.policy_loss)
        for loss in POLICY_LOSS_CAPABILITIES.values():
            field = loss.level_field
            if field is not None and not ours.offers_level(field, getattr(self, field)):
                raise ValueError(f"{field} {getattr(self, field)} is a ratio of the {loss.name} policy loss, but "
                                 f"policy_loss is {self.policy_loss}, whose ratios are per token whatever {field} "
                                 f"says (spec §6.3-6.5), so it would change nothing; set policy_loss: {loss.name}, "
                                 f"or {field}: token")
        return self

    def loss_config(self) -> LossOptions:
        """The loss options alone (what ``stages.losses`` reads), without the section's own fields."""
        return LossOptions.model_validate({name: getattr(self, name) for name in LossOptions.model_fields})


class TrainSection(TrainOptions):
    """What one PPO training step of the actor (and the critic for gae) reads: the section its fingerprint hashes.
    A training run's estimator is its top-level ``adv_estimator`` (:meth:`RunOptions.train_step_config`)."""

    adv_estimator: AdvEstimator = Field("gae", description="Only to know whether a critic is trained (gae).")

    @property
    def needs_critic(self) -> bool:
        """Whether the estimator uses critic values (the table's capability, not a name test)."""
        return estimator_capabilities(self.adv_estimator).needs_critic

    @property
    def table_needs(self) -> tuple[str, ...]:
        """The optional columns of the advantaged table this section trains on: the critic's ``values``, and the
        per-row ``difficulty`` that difficulty_loss_weight weighs rows by (spec §6.5; off under roll_compat, where
        ROLL never applies it [BUG-8])."""
        critic = ("values",) if self.needs_critic else ()
        weighted = self.difficulty_loss_weight and self.policy_loss == "rlvr" and not self.roll_compat
        return critic + (("difficulty",) if weighted else ())


def _threads_field(per: str) -> Any:
    """The ``threads`` option of a stage whose ``per`` (worker, actor) reserves ``cpus_per_<per>`` CPUs."""
    return Field(None, gt=0, description=f"torch threads per {per} (default: max(1, floor(cpus_per_{per}))). More "
                                         "threads than reserved CPUs borrow CPUs that idle during this stage (e.g. "
                                         "the idle engine's).")


class TrainRuntimeConfig(RuntimeConfig):
    """Where the training step runs (not part of its fingerprint)."""

    omit_when_default: ClassVar[dict[str, Any]] = {**RuntimeConfig.omit_when_default, "device_mapping": None,
                                                   "placement_timeout_s": 600.0, "engine_build_timeout_s": 1200.0,
                                                   "step_timeout_s": 7200.0}

    num_workers: int = Field(2, gt=0, description="Training workers: Ray actors, one per data-parallel rank.")
    use_gpu: bool = Field(False, description="One GPU per worker and the nccl backend (else gloo on CPU).")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs reserved per worker; torch threads = max(1, floor).")
    threads: int | None = _threads_field("worker")
    keep_workers: bool = Field(True, description="A training flow keeps its worker group and their DeepSpeed engines "
                                                 "across steps (started once; a step that starts from the checkpoint "
                                                 "the previous one wrote reuses the engines in memory). Kept workers "
                                                 "reserve no Ray CPUs: they compute only inside the training step, "
                                                 "when the flow runs no other stage. false: a group per step that "
                                                 "reserves cpus_per_worker.")
    device_mapping: DeviceMapping = Field(None, description="ROLL's device_mapping of actor_train: the GPU "
                                          "indexes of the training workers (one per worker, use_gpu: true). Equal to "
                                          "the engine's: colocated, generation and training share those GPUs "
                                          "(schemas/devices.py). null: one GPU of their own per worker.")
    placement_timeout_s: float | None = Field(600.0, gt=0, description="Seconds the training workers (and, with "
                                              "keep_workers: false, the run's forward workers) may wait to be "
                                              "placed by Ray (their processes started) before the step fails with "
                                              "what they ask and what the cluster has free (null: wait forever).")
    engine_build_timeout_s: float | None = Field(1200.0, gt=0, description="Seconds a worker may spend building its "
                                                 "DeepSpeed engines (loading the model, the optimizer, a resumed "
                                                 "state) on top of the step limit, before the step fails naming the "
                                                 "stalled worker (null: no limit).")
    step_timeout_s: float | None = Field(7200.0, gt=0, description="Seconds one training step, or one log-prob / "
                                         "values pass, may take on a worker (with keep_workers: false, on a rank "
                                         "of the run's forward group) before it fails naming the stalled worker, "
                                         "its process and host (null: no limit).")

    def torch_threads(self) -> int:
        return self.threads or max(1, int(self.cpus_per_worker))

    def default_gpu_share(self) -> float:
        """Each worker's Ray GPU share where no run decides it (colocation, stages.plan.gpu_shares): one GPU with
        ``use_gpu``, else none."""
        return 1.0 if self.use_gpu else 0.0


TIMEOUT_FIELDS = ("placement_timeout_s", "engine_build_timeout_s", "step_timeout_s")  # TrainRuntimeConfig's limits


class StepSettings(Frozen):
    """Where training steps run and what they keep: beside the training options, in ``rollflow train-step``'s config
    and in a training run's ``train`` section."""

    max_ckpt_to_keep: int | None = Field(None, gt=0, description="Keep only the newest K training checkpoints "
                                          "(null: keep all): rollflow train-step deletes older ones beside the "
                                          "output; a training run drops the DeepSpeed state of its older "
                                          "iterations' checkpoints and keeps their weights (evaluation, resume).")
    save_steps: int = Field(10, gt=0, description="A training run writes DeepSpeed's state (optimizer moments, ~7x "
                            "the weights with Adam) every save_steps iterations and at its last (ROLL's name); the "
                            "checkpoints between hold the weights and a replay record, from which a resumed run "
                            "rebuilds the state exactly by replaying at most save_steps - 1 training steps. "
                            "rollflow train-step always writes the state.")
    runtime: TrainRuntimeConfig = Field(default_factory=TrainRuntimeConfig, description="Ray and worker settings.")

    def full_state_at(self, iteration: int, iterations: int) -> bool:
        """Whether a run's 0-based ``iteration`` (of ``iterations``) writes DeepSpeed's state."""
        return (iteration + 1) % self.save_steps == 0 or iteration + 1 == iterations

    @model_validator(mode="after")
    def _device_rules(self) -> "StepSettings":
        if not self.runtime.use_gpu and "fp16" in (self.actor_train.model_args.dtype,
                                                   self.critic_train.model_args.dtype):
            raise ValueError("model_args.dtype fp16 needs a GPU (DeepSpeed's fp16 loss scaling is not available on "
                             "CPU); use bf16 or fp32, or set runtime.use_gpu: true")
        for role in ("actor_train", "critic_train"):
            offloads = getattr(self, role).strategy_args.offloads()
            if offloads and not self.runtime.use_gpu:
                raise ValueError(f"{role}.strategy_args.deepspeed_config.zero_optimization.{offloads[0]} moves GPU "
                                 "state to host memory, but the workers train on CPU (runtime.use_gpu: false), where "
                                 "it already lives (and DeepSpeed's offloaded Adam would need a C++ build); remove "
                                 f"{offloads[0]}, or set runtime.use_gpu: true")
        return self


class TrainStepConfig(TrainSection, StepSettings):
    """``rollflow train-step --config FILE``: the training section plus where it runs and what it keeps."""

    def worker_asks(self) -> tuple[int, float, float, tuple[str, str, str, str]]:
        """What the command's group of training workers asks of Ray (stages/train/group.py: not kept, one GPU per
        worker with ``use_gpu``): workers, CPUs and GPUs each, and the fields that set them and that train on CPU."""
        rt = self.runtime
        return (rt.num_workers, rt.cpus_per_worker, rt.default_gpu_share(),
                ("runtime.num_workers", "runtime.cpus_per_worker", "runtime.use_gpu", "runtime.use_gpu=false"))


class RunTrainConfig(TrainOptions, StepSettings):
    """A training run's ``train`` section: :class:`TrainStepConfig` but for the estimator, which the run sets once at
    its top level (``adv_estimator``, read by the rewards and advantages too); the step's own config is
    :meth:`schemas.run_config.RunOptions.train_step_config`."""


@dataclass(frozen=True)
class PassOptions:
    """How a log-prob or values pass runs, one value made from its section (:meth:`ForwardConfig.pass_options`) and
    handed whole to the ranks of the actor group that run the pass (the run's training workers, a run's forward
    group, or a one-request group of a stage run alone; pickled through Ray). Each gives the same values up to float
    rounding, so none is part of a stage's fingerprint.

    ``packed``: micro-batches of at most the token budget of real tokens, run as one row without padding
    (``use_sequence_packing``); ``attention``: ``attn_implementation`` as written (auto, sdpa, fa2: ``auto`` is
    resolved where the pass runs, by the device it runs on, :func:`stages.train.packed_attention.attention_for`);
    ``fused``: the output layer fused with the log-prob and entropy reduction (``fused_output_layer``, ``auto``
    already resolved by the section's device)."""

    packed: bool = False
    attention: Literal["auto", "sdpa", "fa2"] = "auto"
    fused: bool = False


class ForwardConfig(OmitDefaults):
    """``rollflow logprobs`` / ``rollflow values``: forward passes over a samples table on ``num_actors``
    data-parallel ranks (an actor group started for the stage, :meth:`group_runtime`)."""

    omit_when_default: ClassVar[dict[str, Any]] = {"device_mapping": None, "attn_implementation": "auto"}

    enable_reference: bool = Field(True, description="Also compute ref_log_probs under the reference model (ROLL "
                                                     "turns it on when use_kl_loss or init_kl_coef > 0).")
    compute_entropy: bool = Field(False, description="Also write the per-token entropy column.")
    dtype: ForwardPrecision = Field("fp32", description="Forward precision: auto (bf16 where the hardware computes bf16 "
                                                        "natively, else fp32; the shipped configs' choice), fp32 or bf16 (log-probs are float32 "
                                                        "either way).")
    max_tokens_per_microbatch_in_infer: int = Field(8192, gt=0, description="Token budget of one forward micro-batch "
                                                    "(rows x padded length).")
    rows_per_batch: int = Field(64, gt=0, description="Rows a worker runs at once (one batch, micro-batched by the "
                                "token budget).")
    num_actors: int = Field(1, gt=0, description="Data-parallel ranks of rollflow logprobs / values (each loads the "
                            "model and computes a contiguous slice of the rows); a training run with "
                            "train.runtime.keep_workers: false keeps a forward group of this many ranks.")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs reserved per actor; torch threads = max(1, floor). "
                                  "Forward workers only (rollflow logprobs / values, a training run with "
                                  "train.runtime.keep_workers: false); a kept-group training run refuses another "
                                  "value: its training workers compute the log-probs.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the forward models run: cpu, or cuda (each "
                                           "actor reserves gpus_per_actor of a Ray GPU and uses the one Ray assigns). "
                                           "A kept-group training run computes the log-probs where its training "
                                           "workers run and refuses cuda without train.runtime.use_gpu.")
    gpus_per_actor: float = Field(1.0, gt=0, le=1, description="GPU share reserved per actor with device: cuda (a "
                                  "fraction lets actors, or other stages, share one GPU).")
    use_sequence_packing: bool = Field(False, description="Run each micro-batch's rows packed into one row without "
                                       "padding (ROLL's name; positions restart per row, so each attends to itself "
                                       "only); max_tokens_per_microbatch_in_infer then counts real tokens. The same "
                                       "values up to float rounding, so not part of the stage's fingerprint.")
    attn_implementation: AttnImplementation = Field("auto", description=ATTN_DESCRIPTION + " On the actor group's "
                                                    "held engines too, for the pass (not part of the fingerprint).")
    fused_output_layer: Annotated[bool, BeforeValidator(forward_fused_output_layer_validator)] = Field(
        "auto", validate_default=True, description="The log-prob pass's log-probs and entropy (old and reference, "
        "the LoRA base pass too) straight from the output layer, a chunk of tokens at a time, so the (tokens, "
        "vocabulary) logits are never held (stages/losses/fused_output.py; the same values up to float32 "
        "rounding, so not part of the stage's fingerprint): auto (true with device: cuda, false with device: "
        "cpu), true or false; the same option as actor_train.fused_output_layer, for the pass outside training. "
        "Needs a plain linear output layer (a LoRA adapter on the output layer is refused at the first batch). "
        "The values pass (a critic head) is not affected.")
    threads: int | None = _threads_field("actor")
    device_mapping: DeviceMapping = Field(None, description="ROLL's device_mapping of the reference/old-log-prob "
                                          "workers: their GPU indexes (one per actor; device: cuda). Equal to the "
                                          "engine's and training's: colocated on those GPUs (schemas/devices.py). "
                                          "null: each actor reserves gpus_per_actor of a GPU of its own.")
    seed: int = Field(42, description="Seed of a new critic's value head (values stage, before any training).")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="Ray cluster settings.")

    @model_validator(mode="after")
    def _fa2_needs_packing(self) -> "ForwardConfig":
        refuse_fa2_unpacked("", self.attn_implementation, self.use_sequence_packing)
        return self

    def omit_unused(self, data: Any) -> Any:
        """The dump without ``fused_output_layer`` while it is what ``auto`` gives on this section's device (read
        back, ``auto`` gives it again): every config without the option dumps, and hashes, as before it existed."""
        data = super().omit_unused(data)
        if isinstance(data, dict) and data.get("fused_output_layer") == forward_fused_output_layer("auto", self.device):
            del data["fused_output_layer"]
        return data

    def pass_options(self) -> PassOptions:
        """The options of this section's passes, as one value."""
        return PassOptions(packed=self.use_sequence_packing, attention=self.attn_implementation,
                           fused=self.fused_output_layer)

    def torch_threads(self) -> int:
        return self.threads or max(1, int(self.cpus_per_actor))

    def worker_asks(self) -> tuple[int, float, float, tuple[str, str, str, str]]:
        """What a stage run on its own asks of Ray for its group (stages/train/stage.py ``forward_group``): actors,
        CPUs and GPUs each, and the fields that set them and that run the passes on CPU."""
        return (self.num_actors, self.cpus_per_actor, self.gpus_per_actor_reserved() or 0.0,
                ("num_actors", "cpus_per_actor", "gpus_per_actor", "device=cpu"))

    def gpus_per_actor_reserved(self) -> float | None:
        """The Ray GPU share an actor asks for: gpus_per_actor with device cuda, none on cpu."""
        return self.gpus_per_actor if self.device == "cuda" else None

    def group_runtime(self, kept: bool = False, limits: TrainRuntimeConfig | None = None) -> TrainRuntimeConfig:
        """The runtime of the actor group that computes this section's passes where no training group does
        (stages/train/stage.py ``forward_group``): ``num_actors`` data-parallel ranks of ``cpus_per_actor`` CPUs and
        ``threads`` torch threads each, on GPUs with device cuda, pinned by ``runtime.stage_resources.logprobs`` (the
        group pins its ranks by its runtime's ``train_step`` entry), the cluster settings as given. ``kept``: kept
        across requests (a training run's, ``train.runtime.keep_workers: false``), else one request's (a stage run
        on its own). ``limits``: the runtime whose timeouts bound the ranks (a training run's ``train.runtime``;
        default: a training runtime's defaults)."""
        pinned = self.runtime.resources_for("logprobs")
        cluster = {name: getattr(self.runtime, name) for name in RuntimeConfig.model_fields
                   if name != "stage_resources"}
        timeouts = {name: getattr(limits, name) for name in TIMEOUT_FIELDS} if limits is not None else {}
        return TrainRuntimeConfig(**cluster, **timeouts, num_workers=self.num_actors, use_gpu=self.device == "cuda",
                                  cpus_per_worker=self.cpus_per_actor, threads=self.threads, keep_workers=kept,
                                  stage_resources={"train_step": pinned} if pinned else {})


class LogProbSection(Frozen):
    """What the log-prob stage hashes (the models' contents enter through their fingerprints in the stage state)."""

    checkpoint: str = Field(description="Model folder of old_log_probs.")
    reference: str | None = Field(description="Model folder of ref_log_probs (None: no reference column).")
    compute_entropy: bool = Field(description="Whether the entropy column is written.")
    dtype: str = Field(description="Forward precision.")
    max_tokens_per_microbatch_in_infer: int = Field(description="Token budget of a forward micro-batch.")


class ValuesSection(Frozen):
    """What the values stage hashes."""

    critic: str = Field(description="Checkpoint folder whose critic/ (or, before training, seeded new head) runs.")
    seed: int = Field(description="Seed of a new value head; equal to critic_train.training_args.seed of training.")
    dtype: str = Field(description="Forward precision.")
    max_tokens_per_microbatch_in_infer: int = Field(description="Token budget of a forward micro-batch.")
