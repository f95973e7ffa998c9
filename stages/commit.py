"""The two commit protocols of an output folder (DESIGN.md "One runner for every stage", steps 2-4): what makes a
folder appear whole or not at all, for the runner's stages and for folders written by other code (a training
checkpoint, an evaluation's record).

* A local folder (atomic rename): the folder is written under a temporary sibling, its manifest last, and renamed
  into place (:func:`commit_folder`); a crash leaves a temporary sibling, removed on the next write
  (:func:`cleanup_leftovers`), and a previous output is untouched.
* An object store (no atomic rename): the files go under a unique attempt prefix inside the output folder, staged
  locally where needed, and the manifest, written last in one PUT, names the attempt and its files
  (:func:`_commit_attempt`, docs/object-storage.md); the other attempts are deleted.

A folder whose parts are committed one by one gets its own manifest, last, from :func:`commit_record`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from typing import Any, Callable

import pyarrow.fs as pafs

from schemas.errors import RollflowError
from stages.paths import cache_root_path
from stages.ray_errors import unwrapped_errors
from stages.storage import ATTEMPT_KEY, MANIFEST, Location, read_manifest, upload_folder

log = logging.getLogger("rollflow.runner")
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
ATTEMPT_MARK = ".attempt-"  # object stores: the prefix, inside the output folder, of one attempt's files
# every output this process committed or found committed, in that order (an interrupted command says what it has:
# flows/interrupt.py)
COMMITTED: list[str] = []


def _committed(output: Location, result: tuple[dict[str, Any], bool]) -> tuple[dict[str, Any], bool]:
    COMMITTED.append(output.uri())
    return result


def cleanup_leftovers(output: Location) -> None:
    """Remove temporary folders of crashed runs; restore an output moved aside by a crashed replace. On an object
    store: remove the attempt prefixes in ``output`` that its manifest does not name."""
    if not output.atomic_rename:
        _drop_attempts(output, keep=None)
        return
    parent = output.parent
    if not parent.exists():
        return
    prefix_tmp = f".{output.name}{TMP_MARK}"
    prefix_old = f".{output.name}{OLD_MARK}"
    for info in parent.list():
        if info.base_name.startswith(prefix_tmp):
            log.warning("removing leftover temporary folder %s of an interrupted run", info.path)
            parent.fs.delete_dir(info.path)
        elif info.base_name.startswith(prefix_old):
            old = Location(parent.fs, info.path)
            if not output.exists():
                log.warning("restoring %s from an interrupted replace", output.path)
                old.rename(output)
            else:
                old.rmtree()


def _existing_output(output: Location, fingerprint: str, force: bool, who: str, other: str) -> dict | None:
    """A local ``output``: :func:`_up_to_date` with what the folder holds."""
    present = output.exists()
    return _up_to_date(output, read_manifest(output) if present else None, present, fingerprint, force, who, other)


def _up_to_date(output: Location, existing: dict | None, present: bool, fingerprint: str, force: bool, who: str,
                other: str) -> dict | None:
    """The manifest of ``output`` (``existing``, None when it has none) when it has ``fingerprint`` (nothing to do),
    None when the output is to be written; raises when ``output`` holds something (``present``) else and ``force``
    is not set."""
    if existing is not None and existing.get("fingerprint") == fingerprint and not force:
        log.info("%s: %s is up to date (fingerprint %s), skipping", who, output.path, fingerprint[:12])
        return existing
    if present and not force:
        what = f"{other.format_map(existing)} (fingerprint {existing['fingerprint'][:12]})" if existing \
            else "files without a rollflow manifest"
        raise RollflowError(f"{who}: {output.path} already holds {what}; pass --force to replace it, or choose "
                            "another output folder to keep both")
    return None


def _replace(tmp: Location, output: Location, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` into ``tmp`` (last), then rename ``tmp`` to ``output``; a previous output is moved aside
    first and removed only after the rename (:func:`cleanup_leftovers` restores it after a crash in between)."""
    tmp.child(MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    if output.exists():
        old = output.parent.child(f".{output.name}{OLD_MARK}{uuid.uuid4().hex[:8]}")
        output.rename(old)
        tmp.rename(output)
        old.rmtree()
    else:
        tmp.rename(output)


def commit_folder(output: Location, fingerprint: str, fill: Callable[[Location], dict[str, Any]], *, who: str,
                  other: str, force: bool = False, local: bool = False) -> tuple[dict[str, Any], bool]:
    """Commit the folder ``output``, written by any code (``fill``), the runner's way; return (its manifest, skipped).

    Leftovers of a crashed run are cleaned first. When the manifest of ``output`` has ``fingerprint`` (and not
    ``force``), nothing runs and that manifest comes back with ``skipped`` true. Otherwise ``fill(tmp)`` writes the
    output into ``tmp``, a new empty sibling folder, and returns its manifest (``fingerprint`` is added); the manifest
    is written last and ``tmp`` renamed to ``output``. On any failure ``tmp`` (and an output parent made for it) is
    removed, a previous output is untouched, and a RollflowError raised inside Ray's wrappers is raised as itself.
    ``who`` names the writer in log lines and errors ("stage advantages"); ``other`` says what ``output`` holds when
    its manifest has another fingerprint, formatted with that manifest's fields ("output of stage {stage}").

    On an object store ``tmp`` is an attempt prefix inside ``output`` instead (:func:`_commit_attempt`); with
    ``local`` (``fill`` writes with local paths: DeepSpeed, Hugging Face) ``fill`` gets a local staging folder whose
    files are then uploaded into the attempt."""
    if not output.atomic_rename:
        return _committed(output, _commit_attempt(output, fingerprint, _staged(fill) if local else fill, who=who,
                                                  other=other, force=force))
    cleanup_leftovers(output)
    existing = _existing_output(output, fingerprint, force, who, other)
    if existing is not None:
        return _committed(output, (existing, True))
    tmp = output.parent.child(f".{output.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    created_parent = not output.parent.exists()
    with unwrapped_errors():
        try:
            tmp.fs.create_dir(tmp.path, recursive=True)
            manifest = {**fill(tmp), "fingerprint": fingerprint}
            _replace(tmp, output, manifest)
        except BaseException:
            tmp.rmtree()
            if created_parent and not output.parent.list():  # leave no empty output folder behind either
                output.parent.rmtree()
            raise
    return _committed(output, (manifest, False))


def _current_manifest(output: Location, listed: list[pafs.FileInfo]) -> dict | None:
    """The manifest of ``output`` on an object store, read only when the listing ``listed`` shows one."""
    return read_manifest(output) if any(i.base_name == MANIFEST for i in listed) else None


def _drop_attempts(output: Location, keep: str | None, listed: list[pafs.FileInfo] | None = None,
                   manifest: dict | None = None) -> list[pafs.FileInfo]:
    """Object stores: delete what a crashed or superseded attempt left in ``output``; return what is left of its
    listing. ``keep=None``: every attempt prefix its manifest (``manifest``, read from the listing when not given)
    does not name (a resume's clean-up); otherwise everything but the manifest and ``keep`` (the attempt just
    committed: the previous output's files and any files of a folder replaced with ``force``). ``listed``: the
    folder's listing when the caller has it."""
    listed = output.list(missing_ok=True) if listed is None else listed
    if keep is None and manifest is None:
        manifest = _current_manifest(output, listed)
    named = (manifest or {}).get(ATTEMPT_KEY) if keep is None else keep
    left = []
    for info in listed:
        stale = info.base_name.startswith(ATTEMPT_MARK) if keep is None else info.base_name != MANIFEST
        if not stale or info.base_name == named:
            left.append(info)
            continue
        log.warning("removing %s, left by an earlier or interrupted write of %s", info.path, output.path)
        if info.type == pafs.FileType.Directory:
            output.fs.delete_dir(info.path)
        else:
            output.fs.delete_file(info.path)
    return left


def _attempt_objects(output: Location, attempt: Location) -> list[dict]:
    """Every file under ``attempt`` as ``{"name": <path relative to output>, "bytes": size}``, sorted by name."""
    # allow_not_found: an output of no rows wrote no object, so the attempt prefix does not exist
    infos = attempt.fs.get_file_info(pafs.FileSelector(attempt.path, recursive=True, allow_not_found=True))
    return sorted(({"name": i.path[len(output.path) + 1:], "bytes": i.size} for i in infos
                   if i.type == pafs.FileType.File), key=lambda o: o["name"])


def _staged(fill: Callable[[Location], dict[str, Any]]) -> Callable[[Location], dict[str, Any]]:
    """``fill`` run into a local staging folder (under the rollflow cache) whose files are then uploaded to the
    folder it is given; the staging folder is removed either way."""
    def run(attempt: Location) -> dict[str, Any]:
        root = cache_root_path() / "staging"
        root.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f"{attempt.name}-", dir=root)
        try:
            os.mkdir(f"{staging}/{attempt.parent.name}")
            manifest = fill(Location.of(f"{staging}/{attempt.parent.name}"))
            upload_folder(f"{staging}/{attempt.parent.name}", attempt)
            return manifest
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return run


def _commit_attempt(output: Location, fingerprint: str, fill: Callable[[Location], dict[str, Any]], *, who: str,
                    other: str, force: bool) -> tuple[dict[str, Any], bool]:
    """:func:`commit_folder` on an object store (no atomic rename; docs/object-storage.md): ``fill`` writes into a
    new attempt prefix ``output/.attempt-<pid>-<random>/``; the manifest, written last in one PUT (an object is
    visible whole or not at all), names the attempt (``attempt``), its tables' files (``files``, names relative to
    ``output``) and every object it wrote (``objects``). Readers trust only what a manifest lists, so until that
    PUT they see the previous output (or none); a failure removes the attempt. After the commit the previous
    output's files are deleted; a killed run's attempts are deleted on the next write (:func:`cleanup_leftovers`).
    One listing of ``output`` tells what it holds (an object store keeps an empty "folder" marker after its files are
    deleted: only content counts), its manifest is read once, and only when listed."""
    listed = output.list(missing_ok=True)
    current = _current_manifest(output, listed)
    left = _drop_attempts(output, keep=None, listed=listed, manifest=current)
    existing = _up_to_date(output, current, bool(left), fingerprint, force, who, other)
    if existing is not None:
        return existing, True
    attempt = output.child(f"{ATTEMPT_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with unwrapped_errors():
        try:
            manifest = {**fill(attempt), "fingerprint": fingerprint, ATTEMPT_KEY: attempt.name}
            if "files" in manifest:
                manifest["files"] = [{**f, "name": f"{attempt.name}/{f['name']}"} for f in manifest["files"]]
            manifest["objects"] = _attempt_objects(output, attempt)
            output.child(MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        except BaseException:
            attempt.rmtree()
            if output.is_dir() and not output.list():  # no empty folder marker left behind either
                output.rmtree()
            raise
    _drop_attempts(output, keep=attempt.name)
    return manifest, False


def commit_record(output: Location, fingerprint: str, build: Callable[[], dict[str, Any]], *, force: bool = False
                  ) -> tuple[dict[str, Any], bool]:
    """Write the manifest of the folder ``output`` whose parts were each committed already (by their own stages,
    :func:`commit_folder`), recording what the whole was made from; return (its manifest, skipped).

    :func:`commit_folder` cannot commit such a folder: it writes a whole folder into a temporary sibling, so a killed
    run would start the folder over (not resume at its last committed part), and an existing folder of parts without
    a manifest (a run folder written before these records) would be refused. Here the parts are the content and
    decide by their own fingerprints what is redone; the manifest is written last, atomically (a temporary file
    renamed), once they all are there. A manifest that has ``fingerprint`` (and not ``force``) is kept and comes back
    with ``skipped`` true; one of another fingerprint is replaced (the parts were committed for this one)."""
    if not output.is_dir():
        raise RollflowError(f"{output.path}: the parts of this output are missing; run the stage that writes them")
    existing = read_manifest(output)
    if existing is not None and existing.get("fingerprint") == fingerprint and not force:
        return _committed(output, (existing, True))
    for info in output.list():  # the temporary file of a killed earlier write
        if info.base_name.startswith(f".{MANIFEST}{TMP_MARK}"):
            output.fs.delete_file(info.path)
    manifest = {**build(), "fingerprint": fingerprint}
    if not output.atomic_rename:  # an object store: one PUT is atomic (and a move would be a copy)
        output.child(MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        return _committed(output, (manifest, False))
    tmp = output.child(f".{MANIFEST}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    output.fs.move(tmp.path, output.child(MANIFEST).path)
    return _committed(output, (manifest, False))
