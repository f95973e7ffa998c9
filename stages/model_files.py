"""Cheap checks of the files of a model folder before anything loads it: a plain HF folder (the default model, the
tiny model), a run's checkpoint (train_state.json, manifest.json, LoRA adapters, DeepSpeed state) or a critic inside
one. Each file is checked as far as it can be without torch or transformers: every JSON file parses to an object (a
checkpoint's train_state.json and manifest.json to their shapes), a safetensors file's header parses and the file is
as long as the header says (an 8-byte little-endian header length, the JSON header, then the tensors' bytes up to
the largest ``data_offsets`` end), the shards a ``*.safetensors.index.json`` lists are there, and a DeepSpeed state
file (torch's zip format) ends in its zip directory. A damaged file is reported with the folder, the file, what is
wrong and the fix, before Prefect and Ray start (stages/generation/engines.py ``check_model_dir``,
stages/train/checkpoint.py ``read_checkpoint``).

A folder that passed is not checked again while its files are as they were (:class:`OnceChecked`), in the process or
by a later command on this machine: a run reads its model folder and checkpoints at every rollout turn, log-prob
pass and training step (parsing the 3.5 MB tokenizer.json each time cost a tiny run's driver a third of its CPU),
and the pre-flight's load check imports transformers, about 4 CPU-s of every command's start."""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from schemas.errors import SchemaError
from stages.paths import cache_root_path
from stages.storage import JSON_TYPE_NAMES, MANIFEST, Location, is_json_type, json_type_name, read_manifest

TRAIN_STATE = "train_state.json"  # stages/train/checkpoint.py TRAIN_STATE
INDEX_SUFFIX = ".safetensors.index.json"
DEEPSPEED_DIR = "deepspeed"
# the fields of train_state.json that readers use (stages/train/checkpoint.py read_checkpoint, check_trainable) and
# their JSON types; null is allowed where a checkpoint may have no replay record or no DeepSpeed stage
_NULL = type(None)
_TRAIN_STATE_FIELDS = {"global_step": (int,), "optimizer_steps": (int,), "world_size": (int, _NULL),
                       "zero_stage": (int, _NULL), "replay": (dict, _NULL), "lora": (dict, _NULL)}


# a file changed less than this long ago does not count as unchanged by its signature: file systems stamp times at a
# coarse granularity (a kernel tick), so a second write within it could leave size, times and inode as they were
SETTLED_S = 2.0


def file_states(folder: str | os.PathLike) -> dict[str, tuple[int, int, int, int]]:
    """``path relative to folder → (size, inode, mtime ns, ctime ns)`` of every file under ``folder`` (symlinked
    folders walked, as the check's rglob walks them), read from the file system without opening a file. Any write,
    replacement, ``chmod`` or ``os.utime`` of a file sets its ctime to the time of the change."""
    found = {}
    for root, _dirs, files in os.walk(folder, followlinks=True):
        for name in files:
            st = os.stat(os.path.join(root, name))
            found[os.path.relpath(os.path.join(root, name), folder)] = (st.st_size, st.st_ino, st.st_mtime_ns,
                                                                         st.st_ctime_ns)
    return found


def folder_signature(folder: Path) -> tuple | None:
    """The :func:`file_states` of ``folder`` as a sorted tuple; None when a file changed less than :data:`SETTLED_S`
    ago (or carries a time ahead of this machine's clock), so that a folder being written is checked every time."""
    settled_before, states = time.time_ns() - int(SETTLED_S * 1e9), file_states(folder)
    if any(max(mtime, ctime) > settled_before for _size, _ino, mtime, ctime in states.values()):
        return None
    return tuple(sorted(states.items()))


# bumped when a check of this module or the load check changes what it accepts: folders passed before are checked again
CHECKS_VERSION = 1
CHECKED_DIR = "checked"  # under the rollflow cache: one empty file per folder state a check passed
MARKERS_KEPT = 4096  # the newest half is kept when there are more


class OnceChecked:
    """A check of a model folder that runs once for each state of the folder's files (:func:`folder_signature`):
    it runs again when a file was added, removed or written since it passed, or when the folder was written too
    recently to tell. A pass is remembered in this process (the last ``limit`` folders) and, for later processes, as
    an empty file in the rollflow cache named by a hash of the check, the folder, its signature and ``version()``
    (what the check depends on: :data:`CHECKS_VERSION`, a library's version); a cache that cannot be written only
    costs the check. A check that raises is not remembered."""

    def __init__(self, check: Callable[[Path], None], name: str, version: Callable[[], str] = lambda: "",
                 limit: int = 256):
        self.check, self.name, self.version, self.limit = check, name, version, limit
        self.passed: OrderedDict[str, tuple] = OrderedDict()

    def __call__(self, folder: Path) -> None:
        key, signature = os.path.realpath(folder), folder_signature(folder)
        if signature is not None and (self.passed.get(key) == signature or self._marker(key, signature).exists()):
            self._remember(key, signature)
            return
        self.check(folder)
        if signature is not None:
            self._remember(key, signature)
            _write_marker(self._marker(key, signature))

    def _marker(self, key: str, signature: tuple) -> Path:
        text = json.dumps([CHECKS_VERSION, self.name, self.version(), key, signature])
        return cache_root_path() / CHECKED_DIR / f"{self.name}-{hashlib.sha256(text.encode()).hexdigest()[:40]}"

    def _remember(self, key: str, signature: tuple) -> None:
        self.passed[key] = signature
        self.passed.move_to_end(key)
        while len(self.passed) > self.limit:
            self.passed.popitem(last=False)


def _write_marker(marker: Path) -> None:
    """Create the empty file ``marker``; past :data:`MARKERS_KEPT` files, delete the older half. Best effort."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        markers = list(os.scandir(marker.parent))
        if len(markers) > MARKERS_KEPT:
            for old in sorted(markers, key=lambda m: m.stat().st_mtime_ns)[:len(markers) - MARKERS_KEPT // 2]:
                os.unlink(old.path)
    except OSError:  # a read-only or vanishing cache: the check just runs again next time
        pass


def check_model_files(folder: Path) -> None:
    """Raise a SchemaError naming the first damaged file of the model folder ``folder`` (see the module
    docstring); the files that are there only: which ones a folder must hold is for its reader to say. A damaged
    manifest.json gets the error of every manifest reader (stages/storage.py ``read_manifest``). Once per state of
    the folder's files (:class:`OnceChecked`)."""
    _FILES_CHECKED(Path(folder))


def _check_model_files(folder: Path) -> None:
    read_manifest(Location.of(str(folder)))
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST):
        problem = _file_problem(folder, path)
        if problem is not None:
            raise SchemaError(f"model folder {folder}: {path.relative_to(folder)} {problem}; restore the folder "
                              "from a copy, or make it again: a run's checkpoint (runs/<run>/iter_<k>/checkpoint) by "
                              "deleting iter_<k> and the iterations after it and resuming the run, the default model "
                              "by deleting its folder (it is converted again on next use)")


_FILES_CHECKED = OnceChecked(_check_model_files, "files")


def _file_problem(folder: Path, path: Path) -> str | None:
    """What is wrong with the file ``path`` of the model folder ``folder``, or None."""
    if path.suffix == ".json":
        return _json_problem(path)
    if path.suffix == ".safetensors":
        return safetensors_problem(path)
    if path.suffix == ".pt" and path.relative_to(folder).parts[0] == DEEPSPEED_DIR and not zipfile.is_zipfile(path):
        return "is not a whole torch file (it does not end in its zip directory: cut short?)"
    return None


def _read_json(raw: bytes) -> tuple[object, str | None]:
    """The parsed JSON text ``raw``, or (None, what is wrong)."""
    try:
        return json.loads(raw), None
    except (ValueError, UnicodeDecodeError) as err:
        return None, f"is not valid JSON ({err})"


# A large JSON file whose only check is "parses to an object" (a tokenizer.json: 3.5 MB, 40-60 ms to parse) is
# remembered by the SHA-256 of its bytes (2-3 ms), here and as an empty file in the cache's checked folder: every new
# checkpoint holds the same tokenizer files, and it is read as soon as it is written, before its folder's signature
# settles (:func:`folder_signature`).
BIG_JSON_BYTES = 256 * 1024
_JSON_OBJECTS: set[str] = set()  # digests of large JSON texts that parsed to an object, in this process


def _json_problem(path: Path) -> str | None:
    raw = path.read_bytes()
    plain = len(raw) >= BIG_JSON_BYTES and path.name != TRAIN_STATE and not path.name.endswith(INDEX_SUFFIX)
    if plain:
        digest = hashlib.sha256(raw).hexdigest()
        marker = cache_root_path() / CHECKED_DIR / f"json{CHECKS_VERSION}-{digest[:40]}"
        if digest in _JSON_OBJECTS or marker.exists():
            _JSON_OBJECTS.add(digest)
            return None
    data, problem = _read_json(raw)
    if problem is not None:
        return problem
    if not isinstance(data, dict):
        return f"holds {json_type_name(data)}, not a JSON object"
    if plain:
        _JSON_OBJECTS.add(digest)
        _write_marker(marker)
    if path.name == TRAIN_STATE:
        return _train_state_problem(data)
    if path.name.endswith(INDEX_SUFFIX):
        return _index_problem(path, data)
    return None


def _train_state_problem(state: dict) -> str | None:
    """The fields of a checkpoint's train state that readers use: their types, and a replay record's shape."""
    for key, kinds in _TRAIN_STATE_FIELDS.items():
        if key in state and not any(is_json_type(state[key], kind) for kind in kinds):
            expected = " or ".join(JSON_TYPE_NAMES[kind] for kind in kinds)
            return f"field '{key}' is {json_type_name(state[key])}, expected {expected}"
    replay = state.get("replay")
    if replay is not None and not (isinstance(replay.get("from"), str) and isinstance(replay.get("steps"), list)
                                   and all(isinstance(s, dict) and isinstance(s.get("samples"), str)
                                           for s in replay["steps"])):
        return "field 'replay' is not an object with a string 'from' and a list of 'steps' that name their 'samples'"
    return None


def _index_problem(path: Path, index: dict) -> str | None:
    """A sharded model's index: a ``weight_map`` of tensor name -> shard file, every shard there."""
    shards = index.get("weight_map")
    if not isinstance(shards, dict) or not all(isinstance(f, str) for f in shards.values()):
        return "has no 'weight_map' object of tensor names to shard files"
    missing = sorted({f for f in shards.values() if not (path.parent / f).is_file()})
    return f"lists the shard {missing[0]}, which is missing" if missing else None


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file ``path`` as far as its header tells, without reading the tensors: an
    8-byte little-endian header length, a JSON object of tensors with ``data_offsets``, then exactly the bytes up to
    the largest end offset (safetensors refuses a file longer or shorter than that)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or 8 + length > size:
            return f"is cut short or not a safetensors file: {size} bytes, fewer than the header it announces"
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as err:
            return f"has a header that is not valid JSON ({err})"
    if not isinstance(header, dict):
        return "has a header that is not a JSON object"
    ends = [_data_end(entry) for name, entry in header.items() if name != "__metadata__"]
    if None in ends:
        return "has a tensor entry without two integer data_offsets in its header"
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        how = "cut short" if size < expected else "bytes after its tensors"
        return f"holds {size} bytes where its header says {expected} ({how})"
    return None


def _data_end(entry) -> int | None:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_json_type(o, int) for o in offsets)):
        return None
    return offsets[1]
