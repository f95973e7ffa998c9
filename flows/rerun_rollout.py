"""Replaying a rollout from one of its turns with changed settings (``rollflow stage rollout_turn``, and
``rollout_reset`` from its episodes): the part of ``rollflow stage`` (:mod:`flows.rerun`) that plays episodes.

``--from <rollout>/turns/turn_<k>``: the reset table and turns 0..k-1 are the old ones, read where they are (not
recomputed, not copied); turns k.. are played anew, with the checkpoint the old rollout played with and the changed
sampling or engine settings, into ``<rollout>@<tag>/turns/turn_<k..>``, then ``<rollout>@<tag>/samples`` from every
turn. The new folder describes itself through its manifests: its turn k records the old turn k-1 as its previous
table, its samples every turn they were made of (``rollflow lineage`` and ``rollflow show`` follow them); the same
call again skips what is committed (the one runner), so a killed replay resumes at its turn. ``--from
<rollout>/episodes`` plays the reset and every turn anew; any key of the turn section may change there.

The checkpoint: each rollout table's manifest records the checkpoint folder it was played with (its path and its
files' sizes and modification times, ``state_in.checkpoint``). That folder is used when its files are unchanged;
``--checkpoint DIR`` names a copy of it (the same files, sizes and times: ``cp -a``) when it moved. The engine
settings beyond the section's identity (engines, threads, backend options) come from the manifest's ``context``.
"""

from __future__ import annotations

from pathlib import Path

from flows.restage import apply_overrides, rerun_downstream, rerun_tag
from flows.restage import downstream as downstream_of
from schemas.config import parse_overrides, validate_config
from schemas.errors import RollflowError
from schemas.rollout_config import RolloutConfig, TurnSection, turn_section
from stages import cluster
from stages.generation.engines import check_model_dir
from stages.outputs import ROLLOUT_CHILDREN, Writes, check_output
from stages.rollout.driver import (EPISODES_DIR, SAMPLES_DIR, TURNS_DIR, Reuse, check_rollout, earlier_tables,
                                   run_rollout)
from stages.rollout.engine_pool import checkpoint_fingerprint
from stages.storage import MANIFEST, Location, is_uri, manifest_field, read_manifest

# what may change from a turn on: the turns before it, which are reused, were played under everything else
FROM_A_TURN = ("generating_args", "engine")
_EXAMPLE = {"rollout_turn": "a rollout's turn folder, e.g. runs/<run>/iter_0000/rollout/turns/turn_001",
            "rollout_reset": "a rollout's episodes folder, e.g. runs/<run>/iter_0000/rollout/episodes"}


def _committed_turns(turns: Location) -> list[str]:
    return sorted(i.base_name for i in turns.list()
                  if i.base_name.startswith("turn_") and read_manifest(Location(turns.fs, i.path)) is not None)


def _old_output(name: str, old_output: str) -> tuple[Location, Location, dict]:
    """The folder given (``--from``), the rollout folder that holds it, and its manifest; a RollflowError naming the
    fix when it is not an output of stage ``name`` inside a rollout folder."""
    old = Location.of(old_output)
    if not old.is_dir() and name == "rollout_turn" and old.parent.name == TURNS_DIR and old.parent.is_dir():
        played = _committed_turns(old.parent)
        rollout = old.parent.parent.path
        raise RollflowError(f"{old.path} does not exist: the rollout {rollout} played "
                            + (f"{len(played)} turn(s), {played[0]} to {played[-1]}; pass one of those" if played
                               else "no turn") + f", or {rollout}/{EPISODES_DIR} to play every turn anew")
    manifest = read_manifest(old) if old.is_dir() else None
    if manifest is None or manifest.get("stage") != name:
        holds = (f"it holds an output of stage {manifest.get('stage')}" if manifest is not None
                 else "it has no manifest.json" if old.is_dir() else "it is not a folder")
        raise RollflowError(f"{old.path} is not an output of stage {name} ({holds}); pass {_EXAMPLE[name]}")
    if name == "rollout_turn" and old.parent.name != TURNS_DIR:
        raise RollflowError(f"{old.path} is a turn table outside a rollout folder (its parent is not {TURNS_DIR}/); "
                            f"pass {_EXAMPLE[name]}")
    return old, (old.parent.parent if name == "rollout_turn" else old.parent), manifest


def _reuse(old: Location, manifest: dict) -> Reuse:
    """The reset table and turns 0..k-1 turn ``old`` (turn k) was played from, found through the manifests."""
    chain = earlier_tables(old)
    turn = manifest.get("state_in", {}).get("turn")
    if turn != len(chain) - 1:
        raise RollflowError(f"{old.path}: its manifest records turn {turn}, but it was played from {len(chain) - 1} "
                            "earlier turn table(s); the rollout folder was edited by hand — replay from its episodes")
    return Reuse(chain[0].path, tuple(t.path for t in chain[1:]))


def _section(name: str, old: Location, rollout: Location, manifest: dict, overrides: list[str]) -> TurnSection:
    """The old turn section with ``overrides`` (dotted keys of the turn section) applied, validated; from a turn only
    the keys of :data:`FROM_A_TURN` may change."""
    changes = parse_overrides(overrides)
    section = validate_config(TurnSection, apply_overrides(manifest_field(old, manifest, "section"), changes),
                              f"{old.path}/manifest.json + --set")
    fixed = sorted(k for k in changes if k.split(".")[0] not in FROM_A_TURN)
    if name == "rollout_turn" and fixed:
        raise RollflowError(
            f"--set {', '.join(fixed)}: from a turn on only the sampling (generating_args.*: temperature, top_p, "
            "top_k, max_new_tokens, stop) and the engine (engine.backend, engine.dtype, engine.max_model_len) may "
            "change, because the earlier turns, which are reused, were played under the rest (levels, prompts, "
            f"sequence_length, ...); to change it, play every turn anew: rollflow stage rollout_reset --from "
            f"{rollout.path}/{EPISODES_DIR} --set ...")
    return section


def _config(section: TurnSection, manifest: dict, source: str) -> tuple[RolloutConfig, bool]:
    """The rollout config that plays ``section`` with the engine settings the manifest's context recorded (and
    whether it recorded them: a rollout written before they were recorded gets the defaults)."""
    context = manifest.get("context") or {}
    data = section.model_dump(mode="json")
    data["engine"] = {**(context.get("engine") or {}), **data["engine"]}  # the section's identity decides
    data["runtime"] = {"batch_rows": int(context.get("batch_rows", 1024))}
    return validate_config(RolloutConfig, data, source), "engine" in context


def _difference(recorded: list, now: list) -> str:
    was, cur = ({n: (size, t) for n, size, t in files} for files in (recorded, now))
    for name in sorted(set(was) | set(cur)):
        if name not in cur:
            return f"{name} is missing"
        if name not in was:
            return f"{name} was not there"
        if was[name][0] != cur[name][0]:
            return f"{name} has {cur[name][0]} bytes, it had {was[name][0]}"
        if was[name][1] != cur[name][1]:
            return f"{name} was modified since"
    return "its files are the same"


def _checkpoint(old: Location, manifest: dict, given: str | None) -> str:
    """The checkpoint folder the rollout was played with: the recorded one, its files unchanged, or ``given`` (a copy
    of it: the same files, sizes and modification times)."""
    recorded = manifest.get("state_in", {}).get("checkpoint")
    where = f"{old.path}/manifest.json"
    if isinstance(recorded, dict) and is_uri(recorded.get("path")):  # a checkpoint committed on a store
        return _store_checkpoint(recorded, where, given)
    if not isinstance(recorded, dict) or not {"path", "files"} <= recorded.keys():
        raise RollflowError(f"{where} records no checkpoint folder (state_in.checkpoint); it was not written by a "
                            "rollflow rollout — play it anew with rollflow rollout --checkpoint DIR")
    fix = ("pass --checkpoint DIR with a copy of it (the same files, sizes and modification times, e.g. made with "
           "cp -a), or play a new rollout with rollflow rollout --checkpoint DIR")
    if given is None:
        path = recorded["path"]
        if not Path(path).is_dir():
            raise RollflowError(f"the checkpoint the rollout was played with, {path} (recorded in {where}), is gone; "
                                f"{fix}")
        now = checkpoint_fingerprint(path)["files"]
        if now != recorded["files"]:
            raise RollflowError(f"the checkpoint the rollout was played with, {path} (recorded in {where}), changed "
                                f"since ({_difference(recorded['files'], now)}): the turns would be played by another "
                                f"policy; {fix}")
        return path
    check_model_dir(given)
    now = checkpoint_fingerprint(given)["files"]
    if now != recorded["files"]:
        raise RollflowError(f"--checkpoint {given} is not the checkpoint the rollout was played with "
                            f"({recorded['path']}, recorded in {where}): {_difference(recorded['files'], now)}; pass "
                            "that checkpoint, or a copy with the same files, sizes and modification times (cp -a)")
    return str(Path(given).resolve())


def _store_checkpoint(recorded: dict, where: str, given: str | None) -> str:
    """The checkpoint on an object store a rollout was played with (its URI, manifest fingerprint and attempt), if
    it is still that one; ``given`` must name the same committed checkpoint."""
    path = given or recorded["path"]
    if not Location.of(path).child(MANIFEST).exists():
        raise RollflowError(f"the checkpoint the rollout was played with, {path} (recorded in {where}), is gone; pass "
                            "--checkpoint with a copy of it, or play a new rollout with rollflow rollout --checkpoint")
    now = checkpoint_fingerprint(path)
    if {k: now[k] for k in ("fingerprint", "attempt")} != {k: recorded.get(k) for k in ("fingerprint", "attempt")}:
        raise RollflowError(f"the checkpoint {path} is not the one the rollout was played with ({recorded['path']}, "
                            f"recorded in {where}: fingerprint {recorded.get('fingerprint', '?')[:12]}, attempt "
                            f"{recorded.get('attempt')}); it was re-trained since, so the turns would be played by "
                            "another policy: play a new rollout with rollflow rollout --checkpoint")
    return path


def _target(rollout: Location, output: str | None, tag: str) -> str:
    target = Location.of(output) if output else Location(rollout.fs, f"{rollout.path}@{tag}")
    if target.path == rollout.path or target.path.startswith(rollout.path + "/"):
        raise RollflowError(f"--output {target.path} lies in the rollout being replayed ({rollout.path}), which a "
                            "re-run never touches; pass a folder outside it (or leave --output out)")
    return target.uri()


def _span(first: int, last: int) -> str:
    return f"turn {first}" if first == last else f"turns {first}-{last}"


def rerun_rollout(name: str, old_output: str, overrides: list[str], output: str | None, downstream: bool,
                  force: bool, checkpoint: str | None = None) -> list[str]:
    """Replay the rollout that holds ``old_output`` (a turn folder for ``rollout_turn``, the episodes folder for
    ``rollout_reset``) from there with ``overrides`` applied to its turn section, into ``output`` (default
    ``<rollout>@<tag>``); with ``downstream``, re-run what reads the rollout's samples beside the rollout folder
    (:func:`flows.restage.rerun_downstream`). Returns the lines to print."""
    old, rollout, manifest = _old_output(name, old_output)
    reuse = _reuse(old, manifest) if name == "rollout_turn" else None
    section = _section(name, old, rollout, manifest, overrides)
    config, recorded_engine = _config(section, manifest, f"{old.path}/manifest.json + --set")
    model = _checkpoint(old, manifest, checkpoint)
    check_rollout(config)  # the environments build from the (changed) section
    section = turn_section(config)
    tag = rerun_tag(section, {"previous": reuse.previous if reuse else "", "checkpoint": model})
    target = _target(rollout, output, tag)
    check_output(target, Writes(f"rollflow stage {name}", (), ROLLOUT_CHILDREN),
                 {"--from (its rollout)": rollout.uri(), "checkpoint": model})
    if downstream:
        downstream_of(rollout, reads=rollout.child(SAMPLES_DIR).uri())  # a damaged manifest there: before anything runs
    # once the request is valid (the manifest holds no runtime settings: $RAY_ADDRESS or a local one)
    cluster.ensure_ray()
    result = run_rollout(config, target, model, force=force, reuse=reuse, label=f"[rollflow stage] {name}")
    first = len(reuse.turns) if reuse else 0
    played = _span(first, len(result.turns) - 1)
    state = "up to date" if result.samples.skipped and all(t.skipped for t in result.turns) else "wrote"
    kept = (f"{_span(0, first - 1)} and episodes read from {rollout.path}" if first
            else "episodes played anew" if name == "rollout_reset" else "episodes read from " + rollout.path)
    lines = [f"{name}: {state} {result.samples.rows:,} rows to {result.samples.output} ({played} played anew into "
             f"{target}/{TURNS_DIR}, {kept}; old output kept at {rollout.path})"]
    if not recorded_engine:
        lines.append(f"  (the rollout recorded no engine settings beyond backend, dtype and max_model_len: the "
                     f"engine ran with the defaults, {config.engine.num_engines} engine(s))")
    if downstream:
        lines += rerun_downstream(rollout, result.samples.output, tag, force,
                                   reads=rollout.child(SAMPLES_DIR).uri())
    return lines

