"""Re-running one stage of a past run with changed settings, keeping the old output (``rollflow stage``)."""

from __future__ import annotations

from schemas.config import parse_overrides, validate_config
from schemas.errors import RollflowError
from stages.runner import Stage, run_stage
from stages.storage import Location, read_manifest


def _stages() -> dict[str, Stage]:
    from stages.advantages import AdvantagesStage
    from stages.response_rewards import ResponseRewardsStage

    return {s.name: s for s in (ResponseRewardsStage(), AdvantagesStage())}


# which stages read a stage's output, and under which input name
DOWNSTREAM = {"response_rewards": [("advantages", "rewarded")]}


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


def rerun_stage(name: str, old_output: str, overrides: list[str], output: str | None, downstream: bool,
                force: bool) -> list[str]:
    """Re-run stage ``name`` on the inputs recorded in ``old_output``'s manifest with ``overrides`` applied to its
    config section; write to ``output`` (default ``<old>@<fingerprint>``). Returns lines to print."""
    stages = _stages()
    if name not in stages:
        raise RollflowError(f"unknown stage '{name}'; known: {', '.join(stages)}")
    stage = stages[name]
    old = Location.of(old_output)
    manifest = read_manifest(old)
    if manifest is None or manifest.get("stage") != name:
        raise RollflowError(f"{old.path} is not an output of stage {name} (no matching manifest.json); pass the "
                            f"folder the stage wrote, e.g. runs/<run>/recompute/rewarded")
    section = validate_config(stage.section_model, _apply(manifest["section"], parse_overrides(overrides)),
                              f"{old.path}/manifest.json + overrides")
    inputs = {k: v["path"] for k, v in manifest["inputs"].items()}
    from stages.runner import stage_fingerprint

    fp = stage_fingerprint(stage, section, {k: Location.of(v) for k, v in inputs.items()}, manifest["state_in"])
    target = output or f"{old.path}@{fp[:8]}"
    from stages.cluster import ensure_ray

    ensure_ray()  # once the request is valid (the manifest holds no runtime settings: $RAY_ADDRESS or a local cluster)
    result = run_stage(stage, section, inputs, target, force=force, state_in=manifest["state_in"])
    lines = [f"{name}: {'up to date' if result.skipped else 'wrote'} {result.rows:,} rows to {result.output} "
             f"(old output kept at {old.path})"]
    if downstream:
        for child_name, input_name in DOWNSTREAM.get(name, []):
            child_out = _find_child(old, child_name, input_name)
            if child_out is None:
                lines.append(f"{child_name}: no output reading {old.path} was found beside it; nothing to recompute")
                continue
            child_manifest = read_manifest(child_out)
            child = stages[child_name]
            child_section = validate_config(child.section_model, child_manifest["section"], str(child_out.path))
            child_inputs = {k: v["path"] for k, v in child_manifest["inputs"].items()} | {input_name: result.output}
            r = run_stage(child, child_section, child_inputs, f"{child_out.path}@{fp[:8]}", force=force,
                          state_in=child_manifest["state_in"])
            lines.append(f"{child_name}: {'up to date' if r.skipped else 'wrote'} {r.rows:,} rows to {r.output} "
                         f"(old output kept at {child_out.path})")
    return lines


def _find_child(old: Location, child_name: str, input_name: str) -> Location | None:
    for info in old.parent.list():
        loc = Location(old.parent.fs, info.path)
        m = read_manifest(loc) if loc.is_dir() else None
        if m and m.get("stage") == child_name and m["inputs"].get(input_name, {}).get("path") == old.path:
            return loc
    return None
