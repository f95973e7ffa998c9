"""Where a command may write: the one check of an output folder against the command's inputs and against what the
folder (and the folders above it) already hold, run in every command's pre-flight before anything starts.

A command writes only into a folder that is new, or that holds what this command writes (its own earlier output: a
re-run resumes or skips it, ``--force`` redoes it). It never writes into, over or around one of its own inputs, into
a committed table of another stage, into a folder inside a committed table (a table's folder holds its part files
and manifest, nothing else), or into a folder holding files it did not write (a run folder, a folder of tables, a
user's files), with or without ``--force``.

Paths are compared resolved: a local path with its symlinks and ``..`` resolved (:func:`os.path.realpath`), an
object-store URI by its path components (repeated and trailing slashes dropped; an object store has no links, and a
URI with a ``.`` or ``..`` component is refused where it is opened). Pure pyarrow: no Ray, no Prefect.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Mapping

import pyarrow.fs as pafs

from schemas.errors import ConfigError
from schemas.stage_specs import rollout_children, validation_children
from stages.storage import MANIFEST, Location, is_uri, read_manifest, store_path

# a run's iteration folder: a pipeline's step prefix and the step in four digits (flows/pipeline_specs.py step_dir)
ITERATION_FOLDER = re.compile(r"[a-z]+_\d{4,}")


@dataclass(frozen=True)
class Writes:
    """What a command writes into its output folder. ``stages``: the stages whose manifest it writes at the folder's
    top (a table, a checkpoint, an evaluation record); a folder holding one of theirs is this command's own earlier
    output. ``children``: the folders it writes inside, by name, each with the stages whose manifest that folder may
    hold (empty: a folder of tables, e.g. a rollout's turns/). ``loose``: the command writes files of its own beside
    whatever the folder holds (a report's plots), so only tables and runs are refused there."""

    who: str
    stages: tuple[str, ...] = ()
    children: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    loose: bool = False


def resolved(where: str) -> str:
    """The key a path is compared by: a local path (or ``file://`` URI) made absolute with its symlinks and ``..``
    resolved; an object-store URI with its repeated and trailing slashes dropped (``s3://bucket/a//b/`` ->
    ``s3://bucket/a/b``, :func:`stages.storage.store_path`). An object store has no links, and its keys are plain
    strings: ``s3://b/run`` and ``s3://b/run2`` are two folders (:func:`_inside` compares whole components), and a
    ``.`` or ``..`` component is refused where a command opens the URI (``Location.of``), never resolved here."""
    where = str(where)
    if where.startswith("file://"):
        where = where[len("file://"):]
    elif is_uri(where):
        return f"{where.split('://', 1)[0]}://{store_path(where, strict=False)}"
    return os.path.realpath(os.path.abspath(where))


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def check_against_inputs(output: str, inputs: Mapping[str, str], flag: str = "--output") -> None:
    """Refuse an ``output`` that is one of ``inputs`` (name -> path), lies inside one, or contains one (resolved, see
    :func:`resolved`): writing there would overwrite, nest into, or replace an input of the command."""
    out = resolved(output)
    for name, path in inputs.items():
        if path is None:
            continue
        key = resolved(path)
        if out == key:
            how = "is"
        elif _inside(out, key):
            how = "lies inside"
        elif _inside(key, out):
            how = "contains"
        else:
            continue
        raise ConfigError(f"{flag} {output} {how} the command's input {name} ({path}; resolved {key}): writing there "
                          "would overwrite or replace what the command reads, and nothing could be recomputed from "
                          f"it; pass a new {flag} folder outside {path}")


def _committed_ancestor(loc: Location) -> Location | None:
    """The nearest folder above ``loc`` that holds a manifest (a committed table, checkpoint or record)."""
    parent = loc.parent
    while parent.path.strip("/") and parent.path != loc.path:
        if parent.fs.get_file_info(parent.child(MANIFEST).path).type != pafs.FileType.NotFound:
            return parent
        loc, parent = parent, parent.parent
    return None


def _holds(manifest: dict | None, loc: Location) -> str:
    if manifest is not None:
        return f"a committed output of stage {manifest.get('stage', '?')} ({loc.child(MANIFEST).path})"
    return "files"


def _refuse(output: str, holds: str, writes: Writes) -> ConfigError:
    return ConfigError(f"output {output} holds {holds}, which {writes.who} did not write; it writes only into a new "
                       "folder or its own earlier output, with or without --force, so that nothing it did not write "
                       "is replaced; pass a new --output folder (or move that folder away first)")


def _other_inputs(manifest: dict, records: Mapping[str, str]) -> str | None:
    """How the inputs ``manifest`` records differ from ``records`` (input name -> path, what this command's stage
    records): another name, another folder (resolved), or the same folder holding another stage output than the one
    it read (the fingerprint in the input's manifest against the recorded one; a folder without a manifest, a plain
    table or model folder, is fingerprinted by each reader its own way and compared by path only). None when they
    are the same."""
    recorded = manifest.get("inputs") or {}
    if not isinstance(recorded, dict) or sorted(recorded) != sorted(records):
        return f"inputs {sorted(recorded) if isinstance(recorded, dict) else '?'} (this command's: {sorted(records)})"
    for name, path in sorted(records.items()):
        entry = recorded[name] if isinstance(recorded[name], dict) else {}
        if resolved(str(entry.get("path", ""))) != resolved(path):
            return f"input '{name}' from {entry.get('path')} (this command's: {path})"
        then = entry.get("fingerprint")
        now = (read_manifest(Location.of(path)) or {}).get("fingerprint") if Location.of(path).is_dir() else None
        if isinstance(then, str) and isinstance(now, str) and now != then:
            return f"input '{name}' from {path} as it was before it changed (fingerprint {then[:12]}, now {now[:12]})"
    return None


def _run_folder(loc: Location) -> Location | None:
    """The training run folder (one holding config.json and metrics/, see stages/run_folder.py) above ``loc`` whose own
    folder ``loc`` is: inside one of the run's iteration folders (``<prefix><k:04d>``, as flows/pipeline_specs.py
    names them: iter_0001, step_0001) and no folder name between the run and ``loc`` has an ``@`` (``rollflow
    stage`` writes ``<folder>@<tag>``), e.g. runs/<run>/iter_0001/advantaged. None when ``loc`` is no run's own
    folder: a folder a user names beside the iterations (README's ``rollflow eval --output runs/<run>/eval_1``) is
    the user's, and resumes."""
    names, parent = [loc.name], loc.parent
    while parent.path.strip("/") and parent.path != loc.path:
        if parent.child("config.json").exists() and parent.child("metrics").is_dir():
            own = ITERATION_FOLDER.fullmatch(names[-1]) and not any("@" in name for name in names)
            return parent if own else None
        names.append(parent.name)
        loc, parent = parent, parent.parent
    return None


def _check_contents(output: str, loc: Location, writes: Writes, records: Mapping[str, str] | None) -> None:
    """What the existing folder ``loc`` holds must be this command's own earlier output (see :class:`Writes`): of its
    stage and, with ``records`` (see :func:`check_output`), from the same inputs."""
    manifest = read_manifest(loc)
    if manifest is not None and manifest.get("stage") in writes.stages:
        other = _other_inputs(manifest, records) if records is not None else None
        if other is not None:
            raise _refuse(output, f"{_holds(manifest, loc)} from other inputs ({other})", writes)
        return
    if manifest is not None:
        raise _refuse(output, _holds(manifest, loc), writes)
    for info in loc.fs.get_file_info(pafs.FileSelector(loc.path)):
        name = info.base_name
        if name.startswith("."):  # a killed attempt's leftovers (cleaned up by the next write)
            continue
        if writes.loose:
            if name == "config.json" or name == "metrics":
                raise _refuse(output, f"a run folder ({info.path})", writes)
            continue
        if name not in writes.children:
            raise _refuse(output, f"'{name}'", writes)
        child = Location(loc.fs, info.path)
        if info.type == pafs.FileType.Directory:
            inner = read_manifest(child)
            if inner is not None and writes.children[name] and inner.get("stage") not in writes.children[name]:
                raise _refuse(output, _holds(inner, child), writes)
        else:
            raise _refuse(output, f"a file '{name}'", writes)


def check_output_location(output: str) -> None:
    """``output`` must be a folder or not exist yet, under a folder this process may write into (local paths; an
    object store's permissions show at the first write)."""
    loc = Location.of(output)
    if loc.fs.get_file_info(loc.path).type == pafs.FileType.File:
        raise ConfigError(f"output {loc.path} is an existing file; pass a folder (new or a stage output) instead")
    ancestor = loc.parent
    while ancestor.path.strip("/") and ancestor.fs.get_file_info(ancestor.path).type == pafs.FileType.NotFound:
        ancestor = ancestor.parent
    if ancestor.fs.get_file_info(ancestor.path).type == pafs.FileType.File:
        raise ConfigError(f"output {loc.path} lies under {ancestor.path}, which is a file; pass a folder path")
    if isinstance(loc.fs, pafs.LocalFileSystem):
        target = loc.path if loc.is_dir() else (ancestor.path or "/")
        if not os.access(target, os.W_OK | os.X_OK):
            raise ConfigError(f"output {loc.path}: this user may not write into {target}; pass a folder you can "
                              "write (or fix its permissions)")


def check_output(output: str, writes: Writes | None, inputs: Mapping[str, str | None] | None = None,
                 flag: str = "--output", records: Mapping[str, str] | None = None) -> None:
    """The pre-flight check of a command's ``output`` folder: not a file and writable
    (:func:`check_output_location`), none of the command's ``inputs`` (name -> path; equal,
    inside, containing: :func:`check_against_inputs`), not inside a committed table, and (``writes``; None: the
    caller checks the folder's contents itself, a run folder) holding nothing the command did not write: an output
    of its stage counts as its own only when it records the inputs in ``records`` (input name -> path, the inputs
    the stage records in its manifest; None: not compared), and a training run's own folder that already holds
    something (runs/<run>/iter_0001/rollout; see :func:`_run_folder`) never does, as the run wrote it. Raises a
    ConfigError naming the folder, what it holds and the fix."""
    check_output_location(output)
    check_against_inputs(output, {k: v for k, v in (inputs or {}).items() if v is not None}, flag)
    loc = Location.of(output)
    if not is_uri(output):
        loc = Location(loc.fs, resolved(output))
    owner = _committed_ancestor(loc)
    if owner is not None:
        raise ConfigError(f"{flag} {output} lies inside {owner.path}, a committed output of stage "
                          f"{(read_manifest(owner) or {}).get('stage', '?')}: a table's folder holds its files and "
                          "manifest only, and anything written into it would damage it; pass a folder outside "
                          f"{owner.path}")
    if writes is not None and loc.is_dir():
        run = None if writes.loose else _run_folder(loc)
        if run is not None and any(not i.base_name.startswith(".")
                                   for i in loc.fs.get_file_info(pafs.FileSelector(loc.path))):
            raise _refuse(output, f"what training run {run.path} wrote", writes)
        _check_contents(output, loc, writes, records)


# the folders a rollout writes inside its output folder, with the stages of their manifests (turns/: a folder of
# them), from the stage declarations (schemas/stage_specs.py)
ROLLOUT_CHILDREN = rollout_children()
# what an evaluation writes: an agentic one its rollout and record (stage eval), an RLVR one its prompts, responses
# and scores
EVAL_WRITES = Writes("rollflow eval", ("eval",), {**ROLLOUT_CHILDREN, **validation_children()})


def stage_writes(who: str, stage: str) -> Writes:
    """What a command writing one stage's output writes: that stage's table (or checkpoint, or record)."""
    return EVAL_WRITES if stage == "eval" else Writes(who, (stage,))


def container_writes(who: str, outputs: Mapping[str, str], top: str) -> Writes:
    """What a command of several stages writes into ``top``: a folder per stage (``outputs``: output folder ->
    stage name), e.g. recompute's rewarded/ and advantaged/."""
    prefix = top.rstrip("/") + "/"
    children = {path[len(prefix):].split("/")[0]: (stage,) for path, stage in outputs.items() if path.startswith(prefix)}
    return Writes(who, (), children)
