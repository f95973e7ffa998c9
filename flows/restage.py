"""What ``rollflow stage`` and its rollout replay (flows/rerun.py, flows/rerun_rollout.py) share: how each kind of
stage is re-run from its recorded manifest (:data:`RERUNS`, one function per ``StageSpec.rerun`` kind of
schemas/stage_specs.py), the overrides and the tag of a re-run, and the ``--downstream`` walk over the manifests beside
an output. Which stages can be re-run is their declaration's (``rerun``); this module keeps no list of stages.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from typing import Any, Callable

from pydantic import BaseModel

from schemas.config import validate_config
from schemas.errors import RollflowError
from schemas.rollout_config import RolloutConfig
from schemas.stage_specs import is_declared, stage_spec, stage_specs
from schemas.train_config import ForwardConfig, LogProbSection, TrainSection, TrainStepConfig, ValuesSection
from stages.rollout.driver import run_eval
from stages.runner import run_stage
from stages.stage import StageResult
from stages.storage import Location, manifest_field, read_manifest
from stages.train.stage import run_logprobs, run_train_step, run_values

# (section, inputs by name, output folder, force, the old output's manifest) -> the result
Rerun = Callable[[BaseModel, dict[str, str], str, bool, dict], StageResult]


def _runner(spec) -> tuple[type[BaseModel], Rerun]:
    """A stage the runner runs from its section alone (its class, ``spec.runner_class``, takes no arguments)."""
    module, _, name = spec.runner_class.partition(":")
    stage_class = getattr(importlib.import_module(module), name)

    def rerun(section, inputs, output, force, recorded):
        return run_stage(stage_class(), section, inputs, output, force=force, state_in=recorded["state_in"])

    return stage_class.section_model, rerun


def _forward_config(section) -> Any:
    return ForwardConfig(dtype=section.dtype, max_tokens_per_microbatch_in_infer=section.max_tokens_per_microbatch_in_infer,
                         compute_entropy=getattr(section, "compute_entropy", False),
                         enable_reference=getattr(section, "reference", None) is not None,
                         seed=getattr(section, "seed", 42))


def _logprobs(spec) -> tuple[type[BaseModel], Rerun]:
    def rerun(section, inputs, output, force, recorded):  # the models' fingerprints are recomputed from the folders
        return run_logprobs(inputs["samples"], section.checkpoint, _forward_config(section), output,
                            reference=section.reference, force=force)

    return LogProbSection, rerun


def _values(spec) -> tuple[type[BaseModel], Rerun]:
    def rerun(section, inputs, output, force, recorded):
        return run_values(inputs["samples"], section.critic, _forward_config(section), output, force=force)

    return ValuesSection, rerun


def _train_step(spec) -> tuple[type[BaseModel], Rerun]:
    def rerun(section, inputs, output, force, recorded):
        # The record holds no runtime: the step runs on as many workers as the recorded one (its data-parallel split),
        # writes its full DeepSpeed state and prunes nothing (max_ckpt_to_keep unset: the original stays beside it).
        import ray

        world = int(recorded.get("state", {}).get("world_size", 1))
        cfg = TrainStepConfig.model_validate({**section.model_dump(mode="json"), "runtime": {"num_workers": world}})
        cpus = ray.cluster_resources().get("CPU", 0.0)
        if world * cfg.runtime.cpus_per_worker > cpus:  # else the workers would wait for them forever
            raise RollflowError(f"the training step was recorded on {world} workers of "
                                f"{cfg.runtime.cpus_per_worker:g} CPU each and the Ray cluster has {cpus:g} CPUs; "
                                "run rollflow stage against a larger cluster (RAY_ADDRESS=...)")
        return run_train_step(inputs["samples"], inputs["checkpoint"], cfg, output, force=force,
                              label="[rollflow stage] train")

    return TrainSection, rerun


def _eval(spec) -> tuple[type[BaseModel], Rerun]:
    def rerun(section, inputs, output, force, recorded):  # its own engines, built only when a turn is to be played
        return run_eval(section, output, inputs["checkpoint"], force=force, label="[rollflow stage] eval").record

    return RolloutConfig, rerun


# how a stage of each re-run kind (StageSpec.rerun) is re-run: its section model and the function; a rollout
# ("rollout") is replayed by flows/rerun_rollout.py, which plays episodes
RERUNS: dict[str, Callable[[Any], tuple[type[BaseModel], Rerun]]] = {
    "runner": _runner, "logprobs": _logprobs, "values": _values, "train_step": _train_step, "eval": _eval}


def rerun_of(name: str) -> tuple[type[BaseModel], Rerun] | None:
    """The section model and re-run function of stage ``name`` (None: a stage that is not declared, not re-run, or
    a rollout, which flows/rerun_rollout.py replays)."""
    if not is_declared(name):
        return None
    spec = stage_spec(name)
    return RERUNS[spec.rerun](spec) if spec.rerun in RERUNS else None


def reruns_here(name: str) -> bool:
    """Whether :func:`rerun_of` re-runs stage ``name`` (without importing its code)."""
    return is_declared(name) and stage_spec(name).rerun in RERUNS


def known() -> str:
    """The stages rollflow stage re-runs, in their declaration order, as a list for a message."""
    return ", ".join(s.name for s in stage_specs() if s.rerun is not None)


def apply_overrides(section: dict, overrides: dict) -> dict:
    data = dict(section)
    for key, value in overrides.items():
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node[p] = dict(node.get(p) or {})
            node = node[p]
        node[parts[-1]] = value
    return data


def rerun_tag(section: BaseModel, inputs: dict[str, str]) -> str:
    """8 hex digits of what a re-run changes (section and inputs): the same re-run, the same folders. The outputs of
    one ``rollflow stage`` call, downstream ones included, share the tag of the stage it names."""
    payload = json.dumps({"section": section.model_dump(mode="json"), "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:8]


def result_line(name: str, result: StageResult, old: Location) -> str:
    return (f"{name}: {'up to date' if result.skipped else 'wrote'} {result.rows:,} rows to {result.output} "
            f"(old output kept at {old.uri()})")


def siblings(first: Location) -> dict[str, tuple[Location, dict]]:
    """The stage outputs beside ``first`` (folders with a manifest), by path. Re-runs' ``@`` outputs are left out
    when ``first`` is one of the run's own (they are not the run's), and kept when ``first`` is itself a re-run's
    output: what reads it can only be a later re-run's (``rollflow stage train_step --from checkpoint@<tag>``
    re-runs the ``eval@<tag>`` that read it)."""
    found = {}
    chained = "@" in first.name
    for info in first.parent.list():
        loc = Location(first.parent.fs, info.path)
        if ("@" in info.base_name and not chained) or not loc.is_dir():
            continue
        m = read_manifest(loc)
        if m is not None:
            found[loc.uri()] = (loc, m)  # as manifests record their inputs (a URI on an object store)
    return found


def affected(first: Location, reads: str | None = None) -> dict[str, tuple[Location, dict]]:
    """Every output beside ``first`` that reads ``reads`` (default: ``first`` itself; a rollout folder's: its
    samples), or reads one that does (by the manifests' inputs)."""
    beside = siblings(first)
    found: dict[str, tuple[Location, dict]] = {}
    frontier = [reads or first.uri()]
    while frontier:
        read = frontier.pop()
        for path, (loc, m) in sorted(beside.items()):
            if path not in found and any(v.get("path") == read for v in m.get("inputs", {}).values()):
                found[path] = (loc, m)
                frontier.append(path)
    return found


def check_record(loc: Location, manifest: dict) -> None:
    """The fields of the manifest of ``loc`` a re-run of it reads (its section; the state a stage run by the runner
    continues from); a damaged_manifest error naming a missing one."""
    manifest_field(loc, manifest, "section")
    name = manifest.get("stage")
    if is_declared(name) and stage_spec(name).rerun == "runner":
        manifest_field(loc, manifest, "state_in")


def downstream(first: Location, reads: str | None = None) -> dict[str, tuple[Location, dict]]:
    """:func:`affected` (what a downstream walk from ``first`` re-runs), each re-runnable output's manifest holding
    what its re-run reads (:func:`check_record`)."""
    found = affected(first, reads)
    for loc, m in found.values():
        if reruns_here(m.get("stage")):
            check_record(loc, m)
    return found


def rerun_downstream(first_old: Location, first_new: str, tag: str, force: bool,
                      reads: str | None = None) -> list[str]:
    """Re-run every output downstream of ``first_old`` (re-run into ``first_new``) with its recorded section and
    state, re-run inputs in place of the old ones, into ``<its folder>@<tag>``; an output runs after all of its
    inputs that are re-run. One that ``rollflow stage`` cannot re-run is reported stale, and so is what reads it.
    ``reads``: the table of ``first_old`` its readers record (default ``first_old``; a rollout's samples), which
    ``first_new`` replaces."""
    pending = downstream(first_old, reads)
    if not pending:
        return [f"no output beside {first_old.uri()} reads it; nothing downstream to recompute"]
    lines: list[str] = []
    replaced = {reads or first_old.uri(): first_new}
    stale: set[str] = set()
    while pending:
        ready = sorted(path for path, (_, m) in pending.items()
                       if not any(v.get("path") in pending for v in m.get("inputs", {}).values()))
        if not ready:
            raise RollflowError(f"the outputs beside {first_old.path} read each other in a cycle "
                                f"({', '.join(sorted(pending))}); re-run them one by one with rollflow stage --output")
        for path in ready:
            loc, m = pending.pop(path)
            stage, inputs = m.get("stage", "?"), {k: v["path"] for k, v in m.get("inputs", {}).items()}
            if not reruns_here(stage) or stale & set(inputs.values()):
                stale.add(path)
                why = (f"rollflow stage re-runs {known()}" if not reruns_here(stage)
                       else "an input of it could not be re-run")
                lines.append(f"{stage}: {loc.path} reads a re-run output but was not recomputed ({why}); it is now "
                             "stale")
                continue
            section_model, rerun = rerun_of(stage)
            section = validate_config(section_model, manifest_field(loc, m, "section"), f"{loc.path}/manifest.json")
            target = Location(loc.fs, f"{loc.path}@{tag}").uri()
            result = rerun(section, {k: replaced.get(v, v) for k, v in inputs.items()}, target, force, m)
            lines.append(result_line(stage, result, loc))
            replaced[path] = result.output
    return lines

