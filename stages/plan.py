"""The resource plan of a training run: what each stage reserves, when, and whether the cluster can schedule it.

Pure (no Ray import): from a validated training config (either pipeline) and the cluster's resources
(``{"CPU": n, "GPU": g, ...}``, e.g. ``ray.cluster_resources()``) it lists the reservations the run's stages make
and checks them before anything starts. ``rollflow plan`` prints it; ``start_run`` (flows/runkit.py) refuses a run
whose plan does not fit, with the rule, the numbers and the fix.

The rules (what today's code reserves; see the stages cited):

* **Held for the whole run** ("resident"): the generation engines and an LLM judge's engines
  (stages/rollout/engine_pool.py: ``num_cpus_per_engine`` / ``num_gpus_per_engine`` per engine; the pool closes when
  the flow ends); the kept forward workers' GPU share with ``logprobs.device: cuda`` (stages/train/stage.py
  ``forward_group``, a kept group of ``num_actors`` ranks x ``gpus_per_actor``, no CPU) in a run whose training
  group is not kept (a kept group, the actor group, computes the log-prob and values stages itself:
  :func:`forward_on_actor`, issue 44); the kept training workers' GPUs with ``train.runtime.use_gpu``
  (stages/train/group.py: the group reserves one GPU per worker, and a kept group lives until the flow ends).
  Colocated roles reserve their equal share of a GPU instead (:func:`gpu_shares`).
* **Held during one stage** ("phase"): generation's Ray Data tasks (``TASK_CPUS``, 0.25 CPU); the log-prob / values
  stage: the kept forward group's ``num_actors`` x ``logprobs.cpus_per_actor`` (it reserves none in Ray, but its
  threads compute on them during the stage) plus half a CPU for Ray Data's read/write tasks; the training step:
  ``num_workers`` x ``cpus_per_worker`` CPUs (a kept group reserves none in Ray, but its threads compute on them while
  no other stage runs), and its GPUs when the group is not kept (``keep_workers: false``).
* **The check**: the stages of a run follow each other, and the resident reservations sit beside each of them, so for
  every phase, resident + that phase must fit the cluster. With ``async_generation_ratio > 0`` the generation of
  iteration k + 1 runs beside iteration k's later phases (flows/loop.py), so the generation phase's reservations sit
  beside each of them too (:attr:`Plan.overlapped`), and the plan prints which stages run at once and where. CPUs are
  summed (need = resident + the largest phase); GPUs are packed the way Ray places them: a request of 1 or more takes
  whole free GPUs, a fraction must fit in what is left of one GPU. Roles colocated by ROLL's ``device_mapping``
  (schemas/devices.py) reserve equal shares of their GPUs (:func:`gpu_shares`): one GPU holds the engine (asleep
  outside generation) and the training workers (which also compute the log-probs and values) at once: two copies of
  the policy; the forward workers of a run without a kept group are a third. Without colocation, engines that hold a
  GPU and training workers that need one cannot both be placed on one GPU, and the plan is refused with the colocation
  settings as the fix.
* **Custom resources** (``runtime.stage_resources``: a stage pinned to the nodes that declare a resource): kept
  forward and training workers hold theirs for the whole run, the reward and advantage map tasks during their phase
  (one task at least); per resource, resident + the largest phase must not exceed what the cluster's nodes declare,
  and a resource no node declares is refused (Ray would keep the stage waiting forever).
* **Memory** (an estimate, shown, not checked; weights and optimizer state only, no activations or KV cache beyond
  vLLM's ``kv_cache_space_gib``): P parameters (from the model's ``config.json``: embeddings, attention and MLP
  projections, norms; the default model's known shape when it is not converted yet) times bytes per parameter:
  an engine or forward model holds P x dtype bytes (bf16/fp16 2, fp32 4) per model; a training worker holds, per
  trained model (the actor, plus the critic for gae), P x w for the weights plus P x (g + o) / s for gradients and
  AdamW state, with w = g = dtype bytes, o = 12 (fp32 master copy, m, v) in bf16/fp16 or 8 (m, v) in fp32, and s the
  number of workers the ZeRO stage shards them over (stage 0: none; stage 1: o only; stage 2: g and o; stage 3: w,
  g and o, so (w + g + o) / s, plus the one layer a pass gathers whole at a time, left out). That is the ZeRO
  paper's 16 bytes per parameter of mixed-precision Adam, divided as DeepSpeed divides it. Offloading
  (``strategy_args.deepspeed_config``) moves part of it from the GPU to host memory; the estimate is the worker's
  total either way. With LoRA only the adapters get gradients and optimizer state (counted as 0).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from schemas.devices import colocated_with, roles_of
from schemas.errors import RollflowError
from schemas.run_config import rollout_lag
from schemas.stage_specs import PHASES, stage_specs
from stages.generation.model_store import DEFAULT_MODEL_NAME
from stages.paths import cache_root_path
from stages.storage import is_uri

ROLLOUT_TASK_CPUS = 0.25  # stages/rollout/stages.py: TASK_CPUS of the generation tasks
DATA_TASK_SHARE = 0.5  # Ray Data's read/write tasks beside the log-prob actors
GIB = 2**30
_EPS = 1e-9

# SmolLM2-135M-Instruct, the default policy (stages/generation/model_store.py), before its first conversion
DEFAULT_MODEL_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                       "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}

_PIN = "runtime.stage_resources.{}"
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2}


class PlanError(RollflowError):
    """The run's resource plan cannot be scheduled on the cluster."""


@dataclass(frozen=True)
class EngineUse:
    """Engines a run keeps for its whole length: what they are, the config section that sets them, the settings."""

    label: str  # e.g. "generation engine"
    section: str  # the config path of the engine section, e.g. "rollout.engine"
    engine: Any  # schemas.rollout_config.EngineConfig


@dataclass(frozen=True)
class Need:
    """One kind of actor or task of a run: ``count`` units of ``cpus`` and ``gpus`` each, held for the whole run
    (``phase`` None) or during one phase."""

    stage: str
    count: int
    cpus: float
    gpus: float
    phase: str | None  # None: the whole run
    memory_gib: float | None = None  # per unit, an estimate
    note: str = ""
    section: str = ""  # the engine section that sets it (the GPU fix names it)
    custom: dict[str, float] = field(default_factory=dict)  # custom Ray resources per unit (runtime.stage_resources)
    policies: int = 0  # copies of the policy's weights (or a reference model of its size) a unit holds
    generates: bool = False  # the policy's generation engines (they play the next rollout beside training, r > 0)

    @property
    def total_cpus(self) -> float:
        return self.count * self.cpus

    @property
    def total_gpus(self) -> float:
        return self.count * self.gpus


@dataclass
class Plan:
    """The reservations of a run on a cluster, and the verdict."""

    needs: list[Need]
    resources: dict[str, float]
    fixes: dict[str, str] = field(default_factory=dict)  # resource -> the fix sentence
    cpu_parts: str = ""
    placement: dict[int, str] = field(default_factory=dict)  # index in needs -> where its units go
    problems: list[str] = field(default_factory=list)
    # the phases that run beside every other phase (async_generation_ratio > 0: generation), and that ratio
    overlapped: tuple[str, ...] = ()
    async_ratio: float = 0.0

    @property
    def fits(self) -> bool:
        return not self.problems

    def resident(self) -> list[Need]:
        return [n for n in self.needs if n.phase is None]

    def during(self, phase: str) -> list[Need]:
        return [n for n in self.needs if n.phase == phase]

    def in_turn(self) -> tuple[str, ...]:
        """The phases that follow each other (all of them, but those :attr:`overlapped`)."""
        return tuple(p for p in PHASES if p not in self.overlapped) or PHASES

    def _at_once(self, amount) -> float:
        """Resident plus the overlapped phases' plus the largest other phase's ``amount(need)``."""
        resident = sum(amount(n) for n in self.resident())
        beside = sum(amount(n) for p in self.overlapped for n in self.during(p))
        return resident + beside + max(sum(amount(n) for n in self.during(p)) for p in self.in_turn())

    def cpus_needed(self) -> float:
        """Resident CPUs plus the largest phase's: the run's stages follow each other (and the overlapped phases'
        beside them)."""
        return self._at_once(lambda n: n.total_cpus)

    def gpus_needed(self) -> float:
        return self._at_once(lambda n: n.total_gpus)

    def overlap_line(self) -> str | None:
        """With phases overlapped (async_generation_ratio > 0): which stages run at the same time and on what, e.g.
        ``rollout k+1 (generation engines: GPU 1) ‖ log-probs / values → ... → training step of k (...: GPU 0)``."""
        if not self.overlapped:
            return None

        def on(indexes: list[int]) -> str:
            return ", ".join(f"{self.needs[i].stage}: {self.placement.get(i, 'CPU')}" for i in indexes)

        ahead = [i for i, n in enumerate(self.needs) if n.phase in self.overlapped or n.generates]
        behind = [i for i, n in enumerate(self.needs) if i not in ahead]
        lag = rollout_lag(self.async_ratio)
        rollouts = "rollout k+1" if lag == 1 else f"rollouts k+1 .. k+{lag}, one after the other"
        return (f"at the same time (async_generation_ratio {self.async_ratio:g}): {rollouts} ({on(ahead)}) ‖ "
                f"{' → '.join(self.in_turn())} of k ({on(behind)})")

    def lines(self) -> list[str]:
        """The plan as a table: stage, units, resources each, when held, memory, where."""
        cpus, gpus = self.resources.get("CPU", 0.0), self.resources.get("GPU", 0.0)
        out = [f"cluster: {cpus:g} CPUs, {gpus:g} GPUs" + "".join(
            f", {v:g} {k}" for k, v in sorted(self.resources.items())
            if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:")),
            f"{'stage':<28}{'units':>6}{'CPU':>7}{'GPU':>7}  {'held':<26}{'memory/unit':>12}  where"]
        for i, n in enumerate(self.needs):
            mem = f"~{n.memory_gib:.1f} GiB" if n.memory_gib is not None else "-"
            held = "whole run" if n.phase is None else f"during {n.phase}"
            where = self.placement.get(i, "no GPU left" if n.gpus > 0 else "CPU")
            note = ", ".join([n.note] * bool(n.note) + [f"{k} {v:g}" for k, v in sorted(n.custom.items())])
            out.append(f"{n.stage:<28}{n.count:>6}{n.cpus:>7g}{n.gpus:>7g}  {held:<26}{mem:>12}  "
                       f"{where}{'  (' + note + ')' if note else ''}")
        copies = [(n.stage, n.count * n.policies) for n in self.needs if n.gpus > 0 and n.policies]
        if copies:
            out.append(f"policy copies on the GPUs: {sum(c for _, c in copies)} ("
                       + ", ".join(f"{stage} {c}" for stage, c in copies) + ")")
        overlap = self.overlap_line()
        if overlap:
            out.append(overlap)
        out.append(f"needs at once: {self.cpus_needed():g} CPUs (of {cpus:g}), {self.gpus_needed():g} GPUs "
                   f"(of {gpus:g})")
        out.append("fits: yes" if self.fits else f"fits: no ({len(self.problems)} problem(s), below)")
        return out

    def check(self) -> None:
        """Raise a :class:`PlanError` with every problem (rule, numbers, fix) when the plan does not fit."""
        if self.problems:
            raise PlanError("; and ".join(self.problems))


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES.get(str(dtype).lower(), 4)


def parameter_count(shape: dict) -> int | None:
    """Parameters of a Llama/Qwen-style decoder from its HF ``config.json`` values (None when the keys are missing):
    embeddings, per layer the attention (q, k, v, o; biases when ``attention_bias`` or Qwen2) and gated-MLP
    projections and two norms, the final norm, and the output head unless tied."""
    try:
        vocab, hidden, inter = int(shape["vocab_size"]), int(shape["hidden_size"]), int(shape["intermediate_size"])
        layers, heads = int(shape["num_hidden_layers"]), int(shape["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    kv_heads = int(shape.get("num_key_value_heads") or heads)
    head_dim = int(shape.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    if shape.get("attention_bias") or shape.get("model_type") == "qwen2":
        attention += q + 2 * kv
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    head = 0 if shape.get("tie_word_embeddings", True) else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + head


def model_shape(model_dir: str | None) -> dict | None:
    """The ``config.json`` of ``model_dir`` (None: the default model, converted or not); None when unreadable."""
    if model_dir is None:
        converted = cache_root_path() / "models" / DEFAULT_MODEL_NAME / "config.json"
        return _read_json(converted) or dict(DEFAULT_MODEL_SHAPE)
    if is_uri(model_dir):
        return None
    return _read_json(Path(model_dir) / "config.json")


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def training_bytes_per_parameter(dtype: str, zero_stage: int, workers: int, lora: bool) -> float:
    """Bytes per parameter a training worker holds (module docstring, "Memory")."""
    w = dtype_bytes(dtype)
    if lora:
        return float(w)
    g, o = w, (8 if w == 4 else 12)
    shards = max(1, workers)
    if zero_stage >= 3:
        return (w + g + o) / shards
    if zero_stage == 2:
        return w + (g + o) / shards
    if zero_stage == 1:
        return w + g + o / shards
    return float(w + g + o)


def _gib(params: int | None, bytes_per: float, extra_gib: float = 0.0) -> float | None:
    return None if params is None else params * bytes_per / GIB + extra_gib


def default_engines(config) -> list[EngineUse]:
    """The engines a config keeps for the whole run when no list is given: its generation engines (the pipelines'
    own lists, an RLVR judge's engines included, are flows/pipelines.py's ``engines``)."""
    return [EngineUse("generation engine", config.engine_field, config.generation_engine())]


def _equal_share(roles: int) -> float:
    """A GPU divided equally among ``roles``, rounded down to Ray's resource precision (1e-4), so that the shares
    always sum to at most one GPU."""
    return math.floor(1e4 / roles) / 1e4


def forward_on_actor(config) -> bool:
    """Whether a training run computes its log-prob and values stages on its kept actor group (issue 44: the
    training workers hold the policy, and the critic, for their passes as for training; a separate reference model
    is loaded beside them): so with ``train.runtime.keep_workers``. Otherwise the run keeps forward workers of their
    own (``logprobs``' resources)."""
    return bool(config.train_step_config().runtime.keep_workers)


def gpu_roles(config) -> list:
    """The GPU roles that hold GPUs in a training run (schemas/devices.py's roles): the forward workers only when
    they exist (:func:`forward_on_actor`)."""
    roles = roles_of(config)
    return [r for r in roles if r.name != "forward"] if forward_on_actor(config) else roles


def gpu_shares(config) -> dict[str, float]:
    """The Ray GPU reservation of one unit of each GPU role of a training config (either pipeline): ``engine`` (per
    generation engine), ``forward`` (per kept forward worker; 0 when the actor group computes the passes,
    :func:`forward_on_actor`), ``train`` (per training worker); 0 for a role on the CPU. Roles colocated by equal
    ``device_mapping`` lists (schemas/devices.py) reserve an equal share of each GPU they share (two roles: 0.5
    each, three: 0.3333), so all of them are placed at once and none waits for a GPU that a sleeping engine holds;
    the memory is shared in time (the engine sleeps outside generation). A role without a mapping reserves what its
    section says (num_gpus_per_engine, gpus_per_actor, one GPU per training worker). The one place these numbers are
    made: the plan, the engine pool, the forward workers and the training group all read them here."""
    roles = gpu_roles(config)
    engine, fwd, rt = config.generation_engine(), config.logprobs, config.train_step_config().runtime
    own = {"engine": float(engine.num_gpus_per_engine),
           "forward": float(fwd.gpus_per_actor) if fwd.device == "cuda" else 0.0,
           "train": 1.0 if rt.use_gpu else 0.0}
    held = {r.name for r in roles}
    return {name: (0.0 if name not in held else
                   _equal_share(1 + len(colocated_with(roles, name))) if colocated_with(roles, name) else value)
            for name, value in own.items()}


def _colocation_note(config, name: str) -> str:
    roles = gpu_roles(config)
    if name not in {r.name for r in roles}:
        return ""
    partners = colocated_with(roles, name)
    if not partners:
        return ""
    mapping = list(next(r for r in roles if r.name == name).mapping or ())
    note = f"shares GPU {','.join(map(str, mapping))} with {', '.join(r.name for r in partners)}"
    if name == "engine":
        note += f"; asleep outside generation (sleep_level {config.generation_engine().sleep_level})"
    return note


def run_needs(config, engines: Sequence[EngineUse] | None = None) -> list[Need]:
    """What the stages of a training run (``config``: TrainFlowConfig or RLVRTrainConfig) reserve."""
    params = parameter_count(model_shape(config.pretrain) or {})
    shares = gpu_shares(config)
    needs: list[Need] = []
    for use in engines if engines is not None else default_engines(config):
        e = use.engine
        kv = float(e.options.get("kv_cache_space_gib", 0) or 0) if e.backend == "vllm" else 0.0
        generation = e is config.generation_engine()  # the policy's engines (an RLVR judge keeps its own GPUs)
        needs.append(Need(f"{use.label}s", e.num_engines, e.num_cpus_per_engine,
                          shares["engine"] if generation else e.num_gpus_per_engine, None,
                          _gib(params, dtype_bytes(e.dtype), kv),
                          (_colocation_note(config, "engine") if generation else "") or use.section, use.section,
                          policies=int(generation), generates=generation))
    needs.append(Need("generation tasks (Ray Data)", 1, ROLLOUT_TASK_CPUS, 0.0, "generation"))
    fwd, train = config.logprobs, config.train_step_config()
    critic = train.needs_critic
    models = 1 + int(fwd.enable_reference) + int(critic)  # policy, reference, critic
    fwd_gpus = shares["forward"]
    on_actor = forward_on_actor(config)
    if fwd_gpus:  # kept forward workers hold their GPU share for the whole run and reserve no CPU
        needs.append(Need("forward workers (kept)", fwd.num_actors, 0.0, fwd_gpus, None,
                          _gib(params, dtype_bytes(fwd.dtype) * models),
                          _colocation_note(config, "forward") or "logprobs.device: cuda",
                          policies=1 + int(fwd.enable_reference)))
    pins = config.runtime.resources_for
    if pins("logprobs") and not on_actor:  # the kept forward workers hold their custom resources for the whole run
        needs.append(Need("forward workers (kept)", fwd.num_actors, 0.0, 0.0, None, note="pinned",
                          section=_PIN.format("logprobs"), custom=pins("logprobs")))
    if on_actor:  # the kept training group computes them with its threads, reserving no Ray CPU (as between steps)
        needs.append(Need("log-probs / values (actor)", train.runtime.num_workers, 0.0, 0.0, "log-probs / values",
                          None, "on the training workers' engines; memory: theirs"))
    else:  # the run's kept forward group computes them with its ranks' threads, reserving no Ray CPU
        needs.append(Need("log-prob / value ranks", fwd.num_actors, fwd.cpus_per_actor, 0.0, "log-probs / values",
                          None if fwd_gpus else _gib(params, dtype_bytes(fwd.dtype) * models), "kept forward group"))
    for spec in stage_specs():  # the declared pinnable map-task stages: one task at least (CPU beside nothing else)
        if spec.pinnable and spec.phase == "rewards / advantages" and pins(spec.name):
            needs.append(Need(f"{spec.name} tasks", 1, 0.0, 0.0, spec.phase, section=_PIN.format(spec.name),
                              custom=pins(spec.name)))
    needs.append(Need("Ray Data read/write tasks", 1, DATA_TASK_SHARE, 0.0, "log-probs / values"))
    rt = train.runtime
    actor = train.actor_train
    roles = {"actor": _gib(params, training_bytes_per_parameter(actor.model_args.dtype, actor.strategy_args.zero_stage,
                                                                rt.num_workers, actor.model_args.lora))}
    if critic:
        c = train.critic_train
        roles["critic"] = _gib(params, training_bytes_per_parameter(c.model_args.dtype, c.strategy_args.zero_stage,
                                                                    rt.num_workers, c.model_args.lora))
    if on_actor and fwd.enable_reference and not actor.model_args.lora:  # loaded beside the engines for its pass
        roles["reference"] = _gib(params, dtype_bytes(fwd.dtype))
    if on_actor and fwd.dtype != actor.model_args.dtype:  # the passes' policy in its own dtype (actor_forward.py)
        roles["policy in logprobs.dtype"] = _gib(params, dtype_bytes(fwd.dtype))
    policies = 1 + int("reference" in roles) + int("policy in logprobs.dtype" in roles)
    known = None not in roles.values()
    memory = sum(roles.values()) if known else None
    per_role = " + ".join(f"{name} ~{gib:.1f} GiB" for name, gib in roles.items()) if known and len(roles) > 1 else ""

    def noted(note: str) -> str:
        return f"{note}; {per_role}" if per_role else note

    kept = "kept, " if rt.keep_workers else ""
    colocated = _colocation_note(config, "train")
    pinned = {"section": _PIN.format("train_step"), "custom": pins("train_step")}
    if rt.use_gpu and rt.keep_workers:  # the GPUs stay with the kept group; the CPUs compute during the step only
        needs.append(Need("training workers (GPUs)", rt.num_workers, 0.0, shares["train"], None, memory,
                          noted(colocated or "kept across steps"), policies=policies, **pinned))
        needs.append(Need("training workers (CPUs)", rt.num_workers, rt.cpus_per_worker, 0.0, "training step"))
    elif rt.keep_workers and pins("train_step"):  # a kept group holds its custom resources for the whole run
        needs.append(Need("training workers (kept)", rt.num_workers, 0.0, 0.0, None, note="pinned", **pinned))
        needs.append(Need("training workers", rt.num_workers, rt.cpus_per_worker, 0.0, "training step", memory,
                          noted(f"{kept}DeepSpeed ZeRO-{actor.strategy_args.zero_stage}")))
    else:
        needs.append(Need("training workers", rt.num_workers, rt.cpus_per_worker, shares["train"],
                          "training step", memory,
                          noted(colocated or f"{kept}DeepSpeed ZeRO-{actor.strategy_args.zero_stage}"),
                          policies=policies, **pinned))
    return needs


def _pack(requests: Iterable[tuple[int, float]], free: list[float]) -> dict[int, list[int]] | None:
    """Place GPU requests (index, share) on GPUs with ``free`` capacity, as Ray does: a share of 1 or more takes
    whole free GPUs, a fraction the first GPU with room. Largest first. Returns index -> GPUs, or None."""
    placed: dict[int, list[int]] = {}
    for index, share in sorted(requests, key=lambda r: -r[1]):
        if share >= 1 - _EPS:
            whole = [g for g, room in enumerate(free) if room >= 1 - _EPS][:math.ceil(share - _EPS)]
            if len(whole) < math.ceil(share - _EPS):
                return None
            for g in whole:
                free[g] = 0.0
        else:
            whole = [next((g for g, room in enumerate(free) if room >= share - _EPS), -1)]
            if whole[0] < 0:
                return None
            free[whole[0]] -= share
        placed.setdefault(index, []).extend(whole)
    return placed


def _where(gpus: list[int]) -> str:
    return "GPU " + ",".join(str(g) for g in sorted(set(gpus)))


def make_plan(config, resources: dict[str, float], engines: Sequence[EngineUse] | None = None) -> Plan:
    """The plan of a training run on a cluster of ``resources``; ``engines``: the engines its pipeline keeps for the
    whole run (flows/pipelines.py; default: the generation engine)."""
    needs = run_needs(config, engines)
    ratio = float(getattr(config, "async_generation_ratio", 0) or 0)
    plan = Plan(needs, {k: float(v) for k, v in resources.items()}, overlapped=("generation",) if ratio > 0 else (),
                async_ratio=ratio)
    _check_cpus(plan, config)
    _check_gpus(plan, config)
    _check_custom(plan)
    return plan


def custom_needed(plan: Plan) -> dict[str, float]:
    """Custom resource -> the most of it the run holds at once (resident plus the largest phase)."""
    names = sorted({k for n in plan.needs for k in n.custom})
    return {k: sum(n.count * n.custom.get(k, 0.0) for n in plan.resident())
            + max(sum(n.count * n.custom.get(k, 0.0) for n in plan.during(p)) for p in PHASES) for k in names}


def _check_custom(plan: Plan) -> None:
    """Every custom resource a pinned stage asks for must be declared by the cluster's nodes, in the amount the run
    holds at once; otherwise Ray would keep the stage's tasks waiting forever."""
    for name, need in custom_needed(plan).items():
        have = plan.resources.get(name, 0.0)
        if need <= have + _EPS:
            continue
        fields = sorted({n.section for n in plan.needs if name in n.custom})
        plan.problems.append(_custom_problem(name, need, have, fields))


def _custom_problem(name: str, need: float, have: float, fields: Sequence[str]) -> str:
    asked = " and ".join(fields)
    verb = "ask" if len(fields) > 1 else "asks"
    if have <= 0:
        return (f"{asked} {verb} for the custom Ray resource '{name}', which no node of the cluster declares, so the "
                f"stage would wait forever; start a node with ray start --resources='{{\"{name}\": {need:g}}}' and "
                f"set RAY_ADDRESS to its cluster, or remove {asked}")
    return (f"the run holds {need:g} of the custom Ray resource '{name}' at once ({asked}, per task, actor or worker "
            f"times their number), and the cluster's nodes declare {have:g}, so a stage would wait forever; lower the "
            f"amount in {asked}, or declare more on the nodes (ray start --resources)")


def stage_resource_problems(runtime, resources: dict[str, float]) -> list[str]:
    """For a command without a run plan (recompute, logprobs, train-step, ...): each custom resource of
    ``runtime.stage_resources`` that the cluster (``resources``) lacks, as a problem with the fix. One unit of each
    pinned stage must fit."""
    wanted: dict[str, tuple[float, list[str]]] = {}
    for stage, pins in sorted(runtime.stage_resources.items()):
        for name, amount in pins.items():
            most, fields = wanted.get(name, (0.0, []))
            wanted[name] = (max(most, amount), fields + [_PIN.format(stage)])
    return [_custom_problem(name, need, resources.get(name, 0.0), fields)
            for name, (need, fields) in wanted.items() if need > resources.get(name, 0.0) + _EPS]


def group_fit_problems(workers: int, cpus: float, gpus: float, resources: dict[str, float],
                       fields: tuple[str, str, str, str]) -> list[str]:
    """For a command that starts one worker group (``rollflow train-step``: the training workers; ``logprobs`` /
    ``values``: the forward group): whether ``workers`` workers of ``cpus`` CPUs and ``gpus`` GPUs each fit the
    cluster's ``resources`` at all, counted as a run's plan counts them (CPUs summed, GPU shares packed); otherwise
    Ray would keep the group waiting until ``runtime.placement_timeout_s``. ``fields``: the config fields of the
    worker count, the CPUs and the GPUs per worker, and the setting that runs the group on CPU, named in the problems
    with the fix."""
    count, per_cpu, per_gpu, on_cpu = fields
    problems = []
    have = resources.get("CPU", 0.0)
    if workers * cpus > have + _EPS:
        problems.append(f"{count}={workers} workers of {per_cpu}={cpus:g} CPUs need {workers * cpus:g} CPUs and the "
                        f"cluster has {have:g}, so they would wait to be placed until runtime.placement_timeout_s; "
                        f"lower {count} or {per_cpu} (to at most {have / workers:g} each), or join a larger "
                        "cluster (RAY_ADDRESS)")
    gpu_count = int(resources.get("GPU", 0.0) + _EPS)
    if gpus > 0 and _pack([(i, gpus) for i in range(workers)], [1.0] * gpu_count) is None:
        problems.append(f"{count}={workers} workers of {gpus:g} GPU each do not fit the cluster's {gpu_count} GPU(s), "
                        f"so they would wait to be placed until runtime.placement_timeout_s; lower {count} or "
                        f"{per_gpu}, or set {on_cpu}, or join a cluster with more GPUs (RAY_ADDRESS)")
    return problems


def _check_cpus(plan: Plan, config) -> None:
    cpus = plan.resources.get("CPU", 0.0)
    need = plan.cpus_needed()
    if need <= cpus + _EPS:
        return
    engines = sum(n.total_cpus for n in plan.resident())
    forward = sum(n.total_cpus for n in plan.during("log-probs / values") if n.stage != "Ray Data read/write tasks")
    train = sum(n.total_cpus for n in plan.during("training step"))
    plan.problems.append(
        f"the run needs {need:g} CPUs of Ray's {cpus:g}: engines hold {engines:g} for the whole run, "
        f"log-prob actors {forward:g} plus a share for Ray Data's tasks, training workers {train:g}; otherwise "
        "a stage would wait forever. Set num_cpus_per_engine: 0 in the engine sections (an engine idles outside "
        "generation or judging), or lower train.runtime.num_workers / cpus_per_worker, or logprobs.cpus_per_actor")


def _gpu_requests(needs: list[Need], indexes: Iterable[int]) -> list[tuple[int, float]]:
    return [(i, needs[i].gpus) for i in indexes for _ in range(needs[i].count) if needs[i].gpus > 0]


def _check_gpus(plan: Plan, config) -> None:
    gpus = plan.resources.get("GPU", 0.0)
    needs = plan.needs
    resident = [i for i, n in enumerate(needs) if n.phase is None]
    free = [1.0] * int(gpus + _EPS)
    placed = _pack(_gpu_requests(needs, resident), free)
    problem = placed is None
    if placed is not None:
        beside = [i for i, n in enumerate(needs) if n.phase in plan.overlapped]
        for phase in plan.in_turn():
            during = _pack(_gpu_requests(needs, beside + [i for i, n in enumerate(needs) if n.phase == phase]),
                           list(free))
            if during is None:
                problem = True
                break
            placed.update(during)
    if placed:
        for i, where in placed.items():
            plan.placement[i] = _where(where)
    if not problem:
        return
    need = plan.gpus_needed()
    holders = [n for n in needs if n.total_gpus > 0]
    parts = ", ".join(f"{n.stage} {n.total_gpus:g} ({n.count} x {n.gpus:g}, "
                      f"{'whole run' if n.phase is None else 'during ' + n.phase})" for n in holders)
    rule = ("engines and kept workers hold their GPUs for the whole run, and roles share a GPU only when colocated "
            "(equal device_mapping lists, the engine asleep outside generation)")
    if need <= gpus + _EPS:
        rule += f"; the shares sum to {need:g} but cannot be packed onto {gpus:g} GPUs (a fraction must fit in one)"
    engine_fields = sorted({n.section for n in holders if n.section and not n.section.startswith(_PIN.format(""))})
    fixes = []
    if gpus >= 1 - _EPS and config.generation_engine().device_mapping is None and shares_used(config):
        fixes.append(_colocation_fix(config, int(gpus + _EPS)))
    fixes += [f"{f}.num_gpus_per_engine: 0 (generation on the CPU)" for f in engine_fields]
    if config.train_step_config().runtime.use_gpu:
        fixes.append("train.runtime.use_gpu: false")
    if config.logprobs.device == "cuda" and not forward_on_actor(config):
        fixes.append("logprobs.device: cpu")
    target = math.ceil(need - _EPS)
    plan.problems.append(
        f"the run needs {need:g} GPUs of Ray's {gpus:g} at once ({parts}): {rule}; otherwise a stage would wait "
        f"forever for a GPU. Set {' or '.join(fixes) or 'fewer GPU shares'}, or use a machine (or a cluster, "
        f"RAY_ADDRESS) with {max(target, 1)} GPUs (rollflow plan --gpus {max(target, 1)} checks it)")


def shares_used(config) -> bool:
    """Whether the policy's engines and training (or forward) workers both want a GPU: what colocation shares."""
    shares = gpu_shares(config)
    return shares["engine"] > 0 and (shares["train"] > 0 or shares["forward"] > 0)


def _colocation_fix(config, gpus: int) -> str:
    """The settings that colocate the run's GPU roles on ``gpus`` GPUs (ROLL's device_mapping)."""
    mapping = f"[{', '.join(map(str, range(max(gpus, 1))))}]"
    e = config.engine_field
    parts = [f"{e}.device_mapping: {mapping}", f"{e}.sleep_level: 1"]
    if config.train_step_config().runtime.use_gpu:
        parts.append(f"train.runtime.device_mapping: {mapping}")
    if config.logprobs.device == "cuda" and not forward_on_actor(config):
        parts.append(f"logprobs.device_mapping: {mapping}")
    counts = f"; one engine and one worker per GPU: num_engines, num_workers, num_actors {gpus}" if gpus > 1 else ""
    return " and ".join(parts) + f" (colocation: the roles share the GPUs{counts})"


def local_resources(num_cpus: int | None = None) -> dict[str, float]:
    """This machine's resources as a local Ray cluster would declare them: ``num_cpus`` (the config's
    ``runtime.num_cpus``) or the machine's CPUs, and the GPUs torch sees (0 without CUDA or torch)."""
    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 (no torch, or a broken CUDA set-up: plan for the CPU)
        gpus = 0
    return {"CPU": float(num_cpus or os.cpu_count() or 1), "GPU": float(gpus)}
