"""GPU placement of a run's roles, with ROLL's ``device_mapping``: which GPUs the generation engines, the forward
(log-prob, values) workers and the training workers use, and which of them share GPUs (colocation).

ROLL colocates the worker clusters whose ``device_mapping`` lists overlap (``actor_infer`` and ``actor_train`` on
``list(range(0,8))`` share eight GPUs) and separates those whose lists are disjoint. rollflow has the same three
roles, each configured in the section that holds its resources (so placement never enters a stage fingerprint):

====================  ==================================  ===========================================
role                  section                             units (one GPU each)
====================  ==================================  ===========================================
generation engines    ``rollout.engine`` (RLVR: ``engine``)  ``num_engines`` x ``num_gpus_per_engine: 1``
forward workers       ``logprobs`` (``device: cuda``)     ``num_actors``
training workers      ``train.runtime`` (``use_gpu``)     ``num_workers``
====================  ==================================  ===========================================

Rules (checked at load time, :func:`check_device_mappings`): a list names each GPU once and has one entry per unit;
two roles' lists are equal (colocated) or disjoint (a partial overlap cannot be expressed as equal Ray shares); an
engine colocated with another role gives its GPU memory back between rollouts (``sleep_level`` 1 or 2), otherwise
the training step would find the GPU full. How Ray reserves the shared GPUs is :func:`stages.plan.gpu_shares`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator

_LABELS = {"engine": "the generation engines", "forward": "the forward workers", "train": "the training workers"}
_ROLL_RANGE = re.compile(r"^\s*list\(\s*range\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)\s*\)\s*$")


def parse_device_mapping(value: Any) -> Any:
    """ROLL writes ``device_mapping: list(range(0,8))`` (a string ROLL evaluates); accept that form (without
    evaluating anything) besides a YAML list of GPU indexes. Returns a tuple of ints, or the value for pydantic to
    reject."""
    if isinstance(value, str):
        found = _ROLL_RANGE.match(value)
        if not found:
            raise ValueError(f"device_mapping {value!r} is not a list of GPU indexes; write e.g. [0, 1] or ROLL's "
                             "list(range(0,2))")
        start, stop = (0, int(found.group(1))) if found.group(2) is None else (int(found.group(1)),
                                                                                int(found.group(2)))
        return tuple(range(start, stop))
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("device_mapping is empty; list the GPU indexes the role uses (e.g. [0]) or remove it")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
            raise ValueError(f"device_mapping {list(value)} must list GPU indexes (integers >= 0), e.g. [0, 1]")
        if len(set(value)) != len(value):
            raise ValueError(f"device_mapping {list(value)} names a GPU more than once; list each GPU once")
        return tuple(value)
    return value


DeviceMapping = Annotated[tuple[int, ...] | None, BeforeValidator(parse_device_mapping)]


@dataclass(frozen=True)
class Role:
    """One GPU role of a run: its name, the config field of its ``device_mapping``, the list, and its units."""

    name: str  # "engine" | "forward" | "train"
    field: str  # e.g. "rollout.engine.device_mapping"
    mapping: tuple[int, ...] | None
    units: int


def roles_of(config) -> list[Role]:
    """The three GPU roles of a training config (either pipeline)."""
    engine, fwd, rt = config.generation_engine(), config.logprobs, config.train_step_config().runtime
    prefix = config.engine_field
    return [Role("engine", f"{prefix}.device_mapping", engine.device_mapping, engine.num_engines),
            Role("forward", "logprobs.device_mapping", fwd.device_mapping, fwd.num_actors),
            Role("train", "train.runtime.device_mapping", rt.device_mapping, rt.num_workers)]


def colocated_with(roles: list[Role], name: str) -> list[Role]:
    """The other roles whose ``device_mapping`` equals ``name``'s (empty when it has none or shares no GPU)."""
    me = next(r for r in roles if r.name == name)
    if me.mapping is None:
        return []
    return [r for r in roles if r.name != name and r.mapping is not None and set(r.mapping) == set(me.mapping)]


def check_device_mappings(config) -> None:
    """Load-time rules of the run's device mappings (module docstring); raises ValueError with the fix."""
    engine, fwd, rt = config.generation_engine(), config.logprobs, config.train_step_config().runtime
    prefix = config.engine_field
    if engine.device_mapping is not None and engine.num_gpus_per_engine != 1:
        raise ValueError(f"{prefix}.device_mapping puts each engine on one GPU of the list, but "
                         f"{prefix}.num_gpus_per_engine is {engine.num_gpus_per_engine:g}; set num_gpus_per_engine: 1 "
                         "(an engine over several GPUs, tensor parallel, is not placed by device_mapping yet) or "
                         "remove device_mapping")
    if fwd.device_mapping is not None and (fwd.device != "cuda" or fwd.gpus_per_actor != 1):
        raise ValueError("logprobs.device_mapping places the forward workers on GPUs, so it needs logprobs.device: "
                         "cuda and gpus_per_actor: 1 (the share Ray reserves follows from the colocation); set them, "
                         "or remove logprobs.device_mapping")
    if rt.device_mapping is not None and not rt.use_gpu:
        raise ValueError("train.runtime.device_mapping places the training workers on GPUs, so it needs "
                         "train.runtime.use_gpu: true; set it, or remove train.runtime.device_mapping")
    roles = roles_of(config)
    for role in roles:
        if role.mapping is not None and len(role.mapping) != role.units:
            unit = {"engine": f"{prefix}.num_engines", "forward": "logprobs.num_actors",
                    "train": "train.runtime.num_workers"}[role.name]
            raise ValueError(f"{role.field} lists {len(role.mapping)} GPUs but {unit} is {role.units}, and each unit "
                             f"uses one GPU of the list; set {unit}: {len(role.mapping)} or list {role.units} GPUs")
    for i, a in enumerate(roles):
        for b in roles[i + 1:]:
            if a.mapping and b.mapping and set(a.mapping) & set(b.mapping) and set(a.mapping) != set(b.mapping):
                raise ValueError(f"{a.field} {list(a.mapping)} and {b.field} {list(b.mapping)} overlap in part; "
                                 "roles share GPUs only as a whole (equal lists: colocated) or not at all (disjoint "
                                 "lists), because Ray reserves an equal share of each shared GPU; make them equal or "
                                 "disjoint")
    partners = colocated_with(roles, "engine")
    if partners and engine.sleep_level == 0:
        names = " and ".join(r.field for r in partners)
        raise ValueError(f"{prefix}.device_mapping equals {names}, so the engines share their GPUs with "
                         f"{' and '.join(_LABELS[r.name] for r in partners)}, but {prefix}.sleep_level is 0: the "
                         "engines would keep their weights and KV cache on the GPU while those run; set "
                         f"{prefix}.sleep_level: 1 (weights offloaded to host memory, KV cache freed between "
                         "rollouts) or 2 (both discarded; the next weights are loaded on waking)")


def check_async_placement(config) -> None:
    """``async_generation_ratio > 0`` generates while the log-prob and training stages run, so the engines must not
    share their GPUs with those roles (a colocated engine sleeps while they run); raises ValueError with the fix. A
    run without ``device_mapping`` (the CPU, or GPUs Ray hands out whole) may overlap."""
    ratio = getattr(config, "async_generation_ratio", 0)
    partners = colocated_with(roles_of(config), "engine") if ratio > 0 else []
    if partners:
        prefix = config.engine_field
        names = " and ".join(r.field for r in partners)
        raise ValueError(f"async_generation_ratio is {ratio:g}, so the engines generate the next rollout while "
                         f"{' and '.join(_LABELS[r.name] for r in partners)} run, but {prefix}.device_mapping equals "
                         f"{names}: they share the GPUs; give the engines GPUs of their own (a {prefix}.device_mapping "
                         "disjoint from the others), or set async_generation_ratio: 0 (colocated, in turn)")
