"""Training checkpoints: the folder layout, reading one back, publishing one atomically, keeping the newest K.

A checkpoint folder is itself a Hugging Face folder of the actor, so the generation stage (and
``AutoModelForCausalLM.from_pretrained``) loads it as is; the rest sits beside the weights::

    <ckpt>/config.json, model.safetensors, tokenizer files   the actor (HF format)
    <ckpt>/critic/                                           the critic, HF token-classification folder (gae)
    <ckpt>/deepspeed/actor/state/, deepspeed/critic/state/   DeepSpeed's engine state: resumes training exactly
    <ckpt>/lora/actor/, lora/critic/                         with LoRA: the adapter alone (peft's folder)
    <ckpt>/train_state.json                                  training steps done, optimizer steps, world size,
                                                             the replay record of a weights-only checkpoint,
                                                             with LoRA the base folder each adapter applies to
    <ckpt>/manifest.json                                     written last by the stage (fingerprint, metrics)

A plain HF folder (the default model) is a valid input checkpoint: training starts at step 0 with a fresh optimizer.

With LoRA (``model_args.lora_rank``) the weights files still hold the whole model, merged (``W + s B A``), so every
reader of a checkpoint is unchanged; the DeepSpeed state holds the adapters and their optimizer moments only, and
training resumes on the recorded base folder (``train_state.json`` ``lora``: the options and the base of each role)
plus the adapter (stages/train/lora.py ``lora_bases``), checking that they give the saved merged weights.

A run writes DeepSpeed's state (about 7x the weights with Adam) only every ``save_steps`` iterations and at its
last one; the checkpoints between are *weights-only*. Their ``train_state.json`` holds a replay record: the newest
checkpoint with a state (``from``) and, per training step since, the advantaged table it trained on (path and
fingerprint) and its training section. Training from a weights-only checkpoint first replays those steps on the
engines of ``from`` (stages/train/resume.py ``load_engines``): the same inputs from the same state give the same
engines, so a resumed run equals an uninterrupted one (tests/trainflow), while the steps between write only
their weights.
Checkpoints are written into a temporary sibling and renamed into place with the manifest last, like every stage
output (stages/commit.py). Local checkpoint folders must be on a filesystem every worker can write (local or
shared): DeepSpeed and Hugging Face write files with local paths. A checkpoint on an object store (``s3://...``) is
written into a local staging folder and uploaded under the runner's attempt protocol (manifest last); read back, it
is downloaded once into the rollflow cache (:func:`local_path`; docs/object-storage.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.errors import RollflowError, SchemaError
from stages.model_files import check_model_files
from stages.paths import cache_root_path
from stages.storage import MANIFEST, Location, fetch_committed, is_uri, manifest_field, read_manifest

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rollflow.checkpoint")

CRITIC_DIR = "critic"
TRAINING_STATE = "deepspeed"  # every DeepSpeed engine state of the checkpoint (keep_training_state drops it)
ACTOR_STATE = f"{TRAINING_STATE}/actor"
CRITIC_STATE = f"{TRAINING_STATE}/critic"
ACTOR_ADAPTER = "lora/actor"  # LoRA only: the adapter alone, peft's format
CRITIC_ADAPTER = "lora/critic"
TRAIN_STATE = "train_state.json"
STAGE_NAME = "train_step"
WEIGHT_SUFFIXES = (".safetensors", ".bin")
# the files of a Hugging Face tokenizer that a checkpoint copies from the folder it trained from (copy_tokenizer);
# the first two: one of them makes a tokenizer (fast; or the config of a slow one, with its vocabulary files below)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint folder holds. ``global_step``: training steps done; ``*_state``: DeepSpeed state folders
    (None for a plain HF folder); ``critic_dir``: the critic's HF folder, if one was trained."""

    path: str
    global_step: int
    optimizer_steps: int
    world_size: int | None
    zero_stage: int | None
    actor_state: str | None
    critic_dir: str | None
    critic_state: str | None
    replay: dict | None = None  # weights-only: {"from": path, "steps": [{"samples", "fingerprint", "section"}]}
    lora: dict | None = None  # LoRA: {"actor"/"critic": {"options", "base", ...}} (stages/train/lora.py lora_bases)

    @property
    def has_state(self) -> bool:
        """Training continues from this checkpoint without replaying: it holds its state, or it is untrained."""
        return self.actor_state is not None or self.global_step == 0


def local_path(path: str) -> Path:
    """The local folder of the checkpoint ``path``; a checkpoint on an object store (``s3://...``) is downloaded
    once into the rollflow cache (``objstore/<fingerprint>-<attempt>``: what its manifest lists), since DeepSpeed and
    Hugging Face read local files."""
    if is_uri(path):
        return Path(fetch_committed(Location.of(path), str(cache_root_path() / "objstore")))
    return Path(path).resolve()


def _has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir())


def read_checkpoint(path: str) -> CheckpointInfo:
    """Inspect a checkpoint (a training output or a plain HF model folder). Raises SchemaError naming the folder
    and what is missing, or the file that is damaged (stages/model_files.py)."""
    folder = local_path(path)
    if not folder.is_dir() or not _has_weights(folder):
        raise SchemaError(f"checkpoint {folder} is not a Hugging Face model folder (config.json plus *.safetensors); "
                          "pass the default model folder or an earlier train-step output")
    check_model_files(folder)
    state = {}
    if (folder / TRAIN_STATE).is_file():
        state = json.loads((folder / TRAIN_STATE).read_text())
    actor_state = folder / ACTOR_STATE
    critic_dir, critic_state = folder / CRITIC_DIR, folder / CRITIC_STATE
    return CheckpointInfo(
        path=str(folder), global_step=int(state.get("global_step", 0)),
        optimizer_steps=int(state.get("optimizer_steps", 0)), world_size=state.get("world_size"),
        zero_stage=state.get("zero_stage"),
        actor_state=str(actor_state) if state and actor_state.is_dir() else None,
        critic_dir=str(critic_dir) if critic_dir.is_dir() and _has_weights(critic_dir) else None,
        critic_state=str(critic_state) if state and critic_state.is_dir() else None,
        replay=state.get("replay") if not actor_state.is_dir() else None, lora=state.get("lora"))


def check_trainable(info: CheckpointInfo) -> None:
    """Training continues exactly from a trained checkpoint only with its DeepSpeed state (optimizer moments, step
    counts), or, for a weights-only checkpoint, by replaying its steps from the state it names. Raises
    RollflowError naming the folder and the fix when neither is there."""
    if info.has_state:
        return
    if info.replay is None:
        raise RollflowError(f"checkpoint {info.path} has no DeepSpeed state ({ACTOR_STATE}/), so training cannot "
                            "continue exactly from it: a run keeps that state only for its newest "
                            "train.max_ckpt_to_keep checkpoints (older ones keep their weights for evaluation and "
                            "resume). Train from the run's newest checkpoint, or raise train.max_ckpt_to_keep")
    origin = info.replay["from"]
    if not read_checkpoint(origin).has_state:
        raise RollflowError(f"checkpoint {info.path} holds weights only and is rebuilt by replaying its training "
                            f"steps from {origin}, whose DeepSpeed state is gone (train.max_ckpt_to_keep). Train "
                            "from a checkpoint of the run that holds its state, or raise train.max_ckpt_to_keep")
    for step in info.replay["steps"]:
        if not Location.of(step["samples"]).exists():
            raise RollflowError(f"checkpoint {info.path} holds weights only and is rebuilt by replaying its training "
                                f"steps, but the table {step['samples']} one of them trained on is gone. Keep a "
                                "run's iteration folders, or train from a checkpoint that holds its state")


def replay_record(info: CheckpointInfo, samples: str, fingerprint: str, section: dict) -> dict:
    """The replay record of a weights-only checkpoint trained from ``info`` on the table ``samples``."""
    step = {"samples": samples, "fingerprint": fingerprint, "section": section}
    if info.has_state:
        return {"from": info.path, "steps": [step]}
    return {"from": info.replay["from"], "steps": [*info.replay["steps"], step]}


def disk_full_error(folder: str, checkpoint: str, err: BaseException) -> RollflowError | None:
    """When writing a checkpoint into ``folder`` failed (``err``) and its disk has less room than a checkpoint of
    the model in ``checkpoint`` needs (about 8x its weights: weights, fp32 master copy and Adam moments), the error
    that says so and how to fix it; None otherwise (torch reports a full disk as "iostream error")."""
    weights = sum(p.stat().st_size for p in Path(checkpoint).iterdir() if p.suffix in WEIGHT_SUFFIXES)
    free = shutil.disk_usage(folder).free
    if free >= 8 * weights:
        return None
    return RollflowError(f"writing the checkpoint into {folder} failed ({type(err).__name__}) with {free / 2**20:.0f} "
                         f"MiB free on its disk; a checkpoint of this model needs about {8 * weights / 2**20:.0f} MiB "
                         "(weights and DeepSpeed state). Free disk space, or set train.max_ckpt_to_keep so that a "
                         "run keeps the training state of fewer checkpoints, then resume")


def keep_training_state(checkpoints: list[str], keep: int | None) -> list[str]:
    """Drop the DeepSpeed state (``deepspeed/``, ~7x the weights with Adam) of all but the newest ``keep`` of a
    run's checkpoints that hold one (``checkpoints`` oldest first; None keeps all): the newest one with a state is
    what the weights-only checkpoints after it replay from. Weights, manifest and train state stay, so every stage
    fingerprint and a resumed run are unchanged. Returns the folders whose state was dropped now."""
    holders = [path for path in checkpoints if _holds_state(path)]
    dropped = []
    for path in (holders[:-keep] if keep else []):
        log.info("dropping the DeepSpeed state of %s (train.max_ckpt_to_keep=%d)", path, keep)
        if is_uri(path):
            _drop_store_state(Location.of(path))
        else:
            Location.of(str(Path(path) / TRAINING_STATE)).rmtree()
        dropped.append(path)
    return dropped


def _store_state_prefix(manifest: dict) -> str:
    """Where a checkpoint committed on an object store keeps its DeepSpeed state: ``<attempt>/deepspeed/``."""
    return f"{manifest['attempt']}/{TRAINING_STATE}/"


def _holds_state(path: str) -> bool:
    if not is_uri(path):
        return (Path(path) / TRAINING_STATE).is_dir()
    manifest = read_manifest(Location.of(path)) or {}
    return "attempt" in manifest and any(o["name"].startswith(_store_state_prefix(manifest))
                                         for o in manifest.get("objects", []))


def _drop_store_state(loc: Location) -> None:
    """Drop the DeepSpeed state of a checkpoint on an object store: its manifest is rewritten without those objects
    first (one PUT; its fingerprint is unchanged), then they are deleted, so a reader never sees a manifest that
    lists a missing object."""
    manifest = read_manifest(loc)
    prefix = _store_state_prefix(manifest)
    kept = [o for o in manifest["objects"] if not o["name"].startswith(prefix)]
    loc.child(MANIFEST).write_text(json.dumps({**manifest, "objects": kept}, indent=1, sort_keys=True))
    Location(loc.fs, f"{loc.path}/{prefix.rstrip('/')}").rmtree()


def checkpoint_fingerprint(path: str) -> str:
    """The manifest fingerprint of a training checkpoint; for a plain model folder, a hash of its config and of the
    names, sizes and modification times of its files (so replaced weights give a new fingerprint)."""
    loc = Location.of(path if is_uri(path) else str(local_path(path)))
    manifest = read_manifest(loc)
    if manifest is not None:
        return manifest_field(loc, manifest, "fingerprint")
    folder = Path(loc.path)
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(folder)}:{st.st_size}:{st.st_mtime_ns}".encode())
            if p.name == "config.json":
                h.update(p.read_bytes())
    return h.hexdigest()


def copy_tokenizer(source: str, dest: str) -> None:
    """Copy the tokenizer files of the model folder ``source`` into ``dest`` (the generation stage loads both from
    one folder): the files as they are, which is what a load and save wrote (byte for byte for the default and the
    tiny model) without 0.25-0.5 CPU-s of loading and re-saving the tokenizer at every checkpoint, nor its import in
    a training worker. A folder without a tokenizer is refused, as a load of it was."""
    found = [name for name in TOKENIZER_FILES if (Path(source) / name).is_file()]
    if not any(name in found for name in TOKENIZER_FILES[:2]):
        raise SchemaError(f"model folder {source} has no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}); the "
                          "checkpoint folder carries its tokenizer for generation: save the base model's tokenizer "
                          "into it (tokenizer.save_pretrained)")
    Path(dest).mkdir(parents=True, exist_ok=True)
    for name in found:
        shutil.copyfile(Path(source) / name, Path(dest) / name)


def load_weights(folder: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors files in ``folder`` (name -> tensor)."""
    from safetensors.torch import load_file

    saved: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        saved.update(load_file(str(path)))
    return saved


def write_train_state(folder: str, state: dict) -> None:
    Path(folder, TRAIN_STATE).write_text(json.dumps(state, indent=1, sort_keys=True))


def check_complete(folder: str, with_critic: bool) -> None:
    """The invariants of a freshly written checkpoint, before its manifest is written: weights, train state, and
    DeepSpeed's state or a replay record."""
    f = Path(folder)
    missing = [p for p in ("config.json", TRAIN_STATE) if not (f / p).exists()]
    if not any(p.suffix == ".safetensors" for p in f.iterdir()):
        missing.append("*.safetensors")
    if with_critic and not (f / CRITIC_DIR / "config.json").exists():
        missing.append(f"{CRITIC_DIR}/config.json")
    if (f / TRAIN_STATE).exists() and not (f / ACTOR_STATE).exists() \
            and not json.loads((f / TRAIN_STATE).read_text()).get("replay"):
        missing.append(f"{ACTOR_STATE} (or a replay record)")
    if missing:
        raise RollflowError(f"training wrote an incomplete checkpoint in {folder}: missing {', '.join(missing)}")


def list_checkpoints(parent: Location) -> list[tuple[int, float, Location]]:
    """Training checkpoints directly in ``parent``: (global step, creation time, folder), oldest first. Re-runs of a
    step (``<folder>@<tag>``, written by ``rollflow stage train_step``) are not the run's own and are left out, so
    pruning never removes one, nor an original because of one."""
    found = []
    if not parent.exists():
        return found
    for info in parent.list():
        if info.base_name.startswith(".") or "@" in info.base_name:
            continue
        loc = Location(parent.fs, info.path)
        if not loc.is_dir():
            continue
        try:
            manifest = read_manifest(loc)
        except SchemaError:
            continue
        if manifest and manifest.get("stage") == STAGE_NAME:
            found.append((int(manifest.get("state", {}).get("global_step", 0)),
                          float(manifest.get("created_unix", 0.0)), loc))
    return sorted(found, key=lambda t: (t[0], t[1]))


def prune_checkpoints(parent: Location, keep: int, protect: Location | None = None) -> list[str]:
    """Delete all but the newest ``keep`` training checkpoints in ``parent`` (never ``protect``); return the
    deleted paths."""
    found = list_checkpoints(parent)
    doomed = [loc for _, _, loc in found[:max(0, len(found) - keep)] if protect is None or loc.path != protect.path]
    for loc in doomed:
        log.info("removing old checkpoint %s (max_ckpt_to_keep=%d)", loc.path, keep)
        loc.rmtree()
    return [loc.path for loc in doomed]


def manifest_path(folder: str) -> Path:
    return Path(folder) / MANIFEST
