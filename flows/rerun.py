"""Re-running one stage of a past run with changed settings, keeping the old output (``rollflow stage``).

A stage output's manifest records its stage, section, inputs and state; a re-run applies ``--set`` overrides to the
section and runs the stage again on the same inputs into a new folder beside the old one (``<old>@<fingerprint>``).
``--downstream`` then re-runs every output in the same folder that read it (found through the manifests' inputs,
breadth first: a re-run of the log-probs re-runs the rewards and advantages that read them), each into its own
``@<fingerprint>`` folder. The originals are never touched.

Which stages can be re-run is the table of :func:`_rerunnable` (one entry per stage name): a function that runs the
stage from its section, its inputs and the rest of its old manifest. That includes the training step (a new
checkpoint beside the old one, e.g. with another learning rate) and an evaluation (its own manifest records the
checkpoint it read), so a walk from the log-probs goes through rewards, advantages and training to the evaluation.
A rollout is replayed from one of its turns (``rollout_turn``) or from its episodes (``rollout_reset``) by
:mod:`flows.rerun_rollout` into a new rollout folder beside the old one; its downstream walk starts at the rollout's
samples, from the outputs beside the rollout folder. RLVR generation is not re-run (the error names the command that
redoes it), and a downstream walk that reaches an output it cannot re-run reports it stale.
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel

from schemas.config import parse_overrides, validate_config
from schemas.errors import RollflowError
from stages.runner import StageResult
from stages.storage import Location, manifest_field, read_manifest

# (section, inputs by name, output folder, force, the old output's manifest) -> the result
Rerun = Callable[[BaseModel, dict[str, str], str, bool, dict], StageResult]
RUNNER_STAGES = ("response_rewards", "advantages", "rewards", "rlvr_samples")  # re-run by _runner_stage (state_in)


def _runner_stage(stage_class: Any) -> tuple[type[BaseModel], Rerun]:
    """A stage the runner runs from its section alone (its class takes no arguments)."""
    from stages.runner import run_stage

    def rerun(section, inputs, output, force, recorded):
        return run_stage(stage_class(), section, inputs, output, force=force, state_in=recorded["state_in"])

    return stage_class.section_model, rerun


def _forward_config(section) -> Any:
    from schemas.train_config import ForwardConfig

    return ForwardConfig(dtype=section.dtype, max_tokens_per_microbatch_in_infer=section.max_tokens_per_microbatch_in_infer,
                         compute_entropy=getattr(section, "compute_entropy", False),
                         enable_reference=getattr(section, "reference", None) is not None,
                         seed=getattr(section, "seed", 42))


def _logprobs() -> tuple[type[BaseModel], Rerun]:
    from schemas.train_config import LogProbSection
    from stages.train.stage import run_logprobs

    def rerun(section, inputs, output, force, recorded):  # the models' fingerprints are recomputed from the folders
        return run_logprobs(inputs["samples"], section.checkpoint, _forward_config(section), output,
                            reference=section.reference, force=force)

    return LogProbSection, rerun


def _values() -> tuple[type[BaseModel], Rerun]:
    from schemas.train_config import ValuesSection
    from stages.train.stage import run_values

    def rerun(section, inputs, output, force, recorded):
        return run_values(inputs["samples"], section.critic, _forward_config(section), output, force=force)

    return ValuesSection, rerun


def _train_step() -> tuple[type[BaseModel], Rerun]:
    from schemas.train_config import TrainSection, TrainStepConfig
    from stages.train.stage import run_train_step

    def rerun(section, inputs, output, force, recorded):
        # The record holds no runtime: the step runs on as many workers as the recorded one (its data-parallel split),
        # writes its full DeepSpeed state and prunes nothing (max_ckpt_to_keep unset: the original stays beside it).
        import ray

        world = int(recorded.get("state", {}).get("world_size", 1))
        cfg = TrainStepConfig.model_validate({**section.model_dump(mode="json"), "runtime": {"num_workers": world}})
        cpus = ray.cluster_resources().get("CPU", 0.0)
        if world * cfg.runtime.cpus_per_worker > cpus:  # else Ray Train would wait for them forever
            raise RollflowError(f"the training step was recorded on {world} workers of "
                                f"{cfg.runtime.cpus_per_worker:g} CPU each and the Ray cluster has {cpus:g} CPUs; "
                                "run rollflow stage against a larger cluster (RAY_ADDRESS=...)")
        return run_train_step(inputs["samples"], inputs["checkpoint"], cfg, output, force=force,
                              label="[rollflow stage] train")

    return TrainSection, rerun


def _eval() -> tuple[type[BaseModel], Rerun]:
    from schemas.rollout_config import RolloutConfig
    from stages.rollout.driver import run_eval

    def rerun(section, inputs, output, force, recorded):  # its own engines, built only when a turn is to be played
        return run_eval(section, output, inputs["checkpoint"], force=force, label="[rollflow stage] eval").record

    return RolloutConfig, rerun


def _rerunnable() -> dict[str, Callable[[], tuple[type[BaseModel], Rerun]]]:
    from stages.advantages import AdvantagesStage
    from stages.response_rewards import ResponseRewardsStage
    from stages.rlvr.stages import RewardStage, SamplesStage

    return {"response_rewards": lambda: _runner_stage(ResponseRewardsStage),
            "advantages": lambda: _runner_stage(AdvantagesStage),
            "rewards": lambda: _runner_stage(RewardStage),  # rule workers; an LLM judge needs rollflow score
            "rlvr_samples": lambda: _runner_stage(SamplesStage),
            "logprobs": _logprobs, "values": _values,
            "train_step": _train_step, "eval": _eval}


def _known() -> str:
    from flows.rerun_rollout import ROLLOUT_STAGES

    return ", ".join([*_rerunnable(), *ROLLOUT_STAGES])


def _apply(section: dict, overrides: dict) -> dict:
    data = dict(section)
    for key, value in overrides.items():
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node[p] = dict(node.get(p) or {})
            node = node[p]
        node[parts[-1]] = value
    return data


def _tag(section: BaseModel, inputs: dict[str, str]) -> str:
    """8 hex digits of what a re-run changes (section and inputs): the same re-run, the same folders. The outputs of
    one ``rollflow stage`` call, downstream ones included, share the tag of the stage it names."""
    import hashlib
    import json

    payload = json.dumps({"section": section.model_dump(mode="json"), "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:8]


def _line(name: str, result: StageResult, old: Location) -> str:
    return (f"{name}: {'up to date' if result.skipped else 'wrote'} {result.rows:,} rows to {result.output} "
            f"(old output kept at {old.uri()})")


def rerun_stage(name: str, old_output: str, overrides: list[str], output: str | None, downstream: bool,
                force: bool, checkpoint: str | None = None) -> list[str]:
    """Re-run stage ``name`` on the inputs recorded in ``old_output``'s manifest with ``overrides`` applied to its
    config section; write to ``output`` (default ``<old>@<fingerprint>``). Returns lines to print. A rollout
    (``rollout_turn``, ``rollout_reset``) is replayed by :func:`flows.rerun_rollout.rerun_rollout`; ``checkpoint``
    (a copy of the checkpoint it was played with) is for it alone."""
    from flows.rerun_rollout import ROLLOUT_STAGES, rerun_rollout

    if name in ROLLOUT_STAGES:
        return rerun_rollout(name, old_output, overrides, output, downstream, force, checkpoint)
    table = _rerunnable()
    if name not in table:
        raise RollflowError(
            f"unknown stage '{name}'; rollflow stage re-runs {_known()}. A rollout's samples (rollout_samples) are "
            "made again by replaying its last turn (rollflow stage rollout_turn --from <rollout>/turns/turn_<last>); "
            "RLVR generation (rlvr_prompts, rlvr_generate) is not re-run: redo a run's generation with rollflow "
            "train --config FILE --set run_name=NEW, then rollflow stage NAME --from ... re-runs what reads it")
    if checkpoint is not None:
        raise RollflowError(f"--checkpoint is for a rollout replay ({', '.join(ROLLOUT_STAGES)}); stage {name} "
                            "re-runs on the inputs its manifest records: leave --checkpoint out")
    old = Location.of(old_output)
    manifest = read_manifest(old) if old.is_dir() else None
    if manifest is None or manifest.get("stage") != name:
        holds = (f"it holds an output of stage {manifest.get('stage')}" if manifest is not None
                 else "it has no manifest.json" if old.is_dir() else "it is not a folder")
        raise RollflowError(f"{old.path} is not an output of stage {name} ({holds}); pass the folder the stage "
                            "wrote, e.g. runs/<run>/iter_0000/rewarded for response_rewards, "
                            "runs/<run>/iter_0000/checkpoint for train_step, runs/<run>/iter_0000/eval for eval")
    _check_record(old, manifest)
    section_model, rerun = table[name]()
    section = validate_config(section_model, _apply(manifest_field(old, manifest, "section"),
                                                    parse_overrides(overrides)), f"{old.path}/manifest.json + overrides")
    inputs = {k: v["path"] for k, v in manifest_field(old, manifest, "inputs").items()}
    for key, path in inputs.items():
        if not Location.of(path).is_dir():
            raise RollflowError(f"input '{key}' of {old.path} (recorded in its manifest.json) no longer exists at "
                                f"{path}; restore it, or re-run the command that wrote it first")
    _check_models(section, inputs)
    if downstream:
        _downstream(old)  # a damaged manifest there is refused before anything runs
    tag = _tag(section, inputs)
    target = output or Location(old.fs, f"{old.path}@{tag}").uri()
    from stages.outputs import check_output, stage_writes

    check_output(target, stage_writes(f"rollflow stage {name}", name),
                 {"--from": old.uri(), **{f"'{key}' (recorded in {old.path}/manifest.json)": path
                                          for key, path in inputs.items()}})
    from stages.cluster import ensure_ray

    ensure_ray()  # once the request is valid (the manifest holds no runtime settings: $RAY_ADDRESS or a local cluster)
    result = rerun(section, inputs, target, force, manifest)
    lines = [_line(name, result, old)]
    if downstream:
        lines += _rerun_downstream(old, result.output, tag, force)
    return lines


def _check_models(section: BaseModel, inputs: dict[str, str]) -> None:
    """The model folders a re-run reads (a recorded checkpoint input: training step, evaluation; a log-prob section's
    checkpoint and reference, a values section's critic) must be whole, before Ray starts: read_checkpoint names a
    damaged file. Folders on an object store are left to their download."""
    from stages.storage import is_uri
    from stages.train.checkpoint import read_checkpoint

    named = [inputs.get("checkpoint"), *(getattr(section, key, None) for key in ("checkpoint", "reference", "critic"))]
    for folder in named:
        if isinstance(folder, str) and not is_uri(folder):
            read_checkpoint(folder)


def _siblings(first: Location) -> dict[str, tuple[Location, dict]]:
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


def _affected(first: Location, reads: str | None = None) -> dict[str, tuple[Location, dict]]:
    """Every output beside ``first`` that reads ``reads`` (default: ``first`` itself; a rollout folder's: its
    samples), or reads one that does (by the manifests' inputs)."""
    siblings = _siblings(first)
    affected: dict[str, tuple[Location, dict]] = {}
    frontier = [reads or first.uri()]
    while frontier:
        read = frontier.pop()
        for path, (loc, m) in sorted(siblings.items()):
            if path not in affected and any(v.get("path") == read for v in m.get("inputs", {}).values()):
                affected[path] = (loc, m)
                frontier.append(path)
    return affected


def _check_record(loc: Location, manifest: dict) -> None:
    """The fields of the manifest of ``loc`` a re-run of it reads (its section; the state a stage run by the runner
    continues from); a damaged_manifest error naming a missing one."""
    manifest_field(loc, manifest, "section")
    if manifest.get("stage") in RUNNER_STAGES:
        manifest_field(loc, manifest, "state_in")


def _downstream(first: Location, reads: str | None = None) -> dict[str, tuple[Location, dict]]:
    """:func:`_affected` (what a downstream walk from ``first`` re-runs), each re-runnable output's manifest holding
    what its re-run reads (:func:`_check_record`)."""
    table = _rerunnable()
    affected = _affected(first, reads)
    for loc, m in affected.values():
        if m.get("stage") in table:
            _check_record(loc, m)
    return affected


def _rerun_downstream(first_old: Location, first_new: str, tag: str, force: bool,
                      reads: str | None = None) -> list[str]:
    """Re-run every output downstream of ``first_old`` (re-run into ``first_new``) with its recorded section and
    state, re-run inputs in place of the old ones, into ``<its folder>@<tag>``; an output runs after all of its
    inputs that are re-run. One that ``rollflow stage`` cannot re-run is reported stale, and so is what reads it.
    ``reads``: the table of ``first_old`` its readers record (default ``first_old``; a rollout's samples), which
    ``first_new`` replaces."""
    table = _rerunnable()
    pending = _downstream(first_old, reads)
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
            if stage not in table or stale & set(inputs.values()):
                stale.add(path)
                why = (f"rollflow stage re-runs {_known()}" if stage not in table
                       else "an input of it could not be re-run")
                lines.append(f"{stage}: {loc.path} reads a re-run output but was not recomputed ({why}); it is now "
                             "stale")
                continue
            section_model, rerun = table[stage]()
            section = validate_config(section_model, manifest_field(loc, m, "section"), f"{loc.path}/manifest.json")
            target = Location(loc.fs, f"{loc.path}@{tag}").uri()
            result = rerun(section, {k: replaced.get(v, v) for k, v in inputs.items()}, target, force, m)
            lines.append(_line(stage, result, loc))
            replaced[path] = result.output
    return lines
