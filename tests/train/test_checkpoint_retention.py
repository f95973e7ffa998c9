"""A training run keeps the DeepSpeed state only for its newest checkpoints (train.max_ckpt_to_keep); the weights
of every checkpoint stay, and training from a checkpoint without its state is refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.errors import RollflowError
from stages.train import checkpoint as ckpt


def _weights(path: Path) -> None:
    """A whole safetensors file without tensors (its 8-byte header length, then the header ``{}``)."""
    path.write_bytes((2).to_bytes(8, "little") + b"{}")


def _trained_checkpoint(folder: Path, step: int) -> str:
    """The files of a trained checkpoint, as the training step lays them out (their contents do not matter here,
    but they are whole files, as read_checkpoint checks: stages/model_files.py)."""
    import zipfile

    (folder / ckpt.ACTOR_STATE / "state").mkdir(parents=True)
    with zipfile.ZipFile(folder / ckpt.ACTOR_STATE / "state" / "optim.pt", "w") as state:  # torch's zip format
        state.writestr("optim/data.pkl", b"x" * 64)
    (folder / "config.json").write_text("{}")
    _weights(folder / "model.safetensors")
    (folder / ckpt.TRAIN_STATE).write_text(json.dumps({"global_step": step, "optimizer_steps": step,
                                                       "world_size": 1}))
    return str(folder)


def test_only_the_newest_checkpoints_keep_their_training_state(tmp_path):
    trail = [_trained_checkpoint(tmp_path / f"iter_{k}" / "checkpoint", k + 1) for k in range(4)]
    assert ckpt.keep_training_state(trail, None) == []
    assert ckpt.keep_training_state(trail, 2) == trail[:2]
    assert ckpt.keep_training_state(trail, 2) == []  # idempotent (a resumed run calls it again)
    for k, path in enumerate(trail):
        folder = Path(path)
        assert (folder / "model.safetensors").exists() and (folder / ckpt.TRAIN_STATE).exists()
        assert (folder / ckpt.TRAINING_STATE).exists() == (k >= 2)
        info = ckpt.read_checkpoint(path)  # still readable: skipped stages fingerprint it, engines load it
        assert info.global_step == k + 1 and (info.actor_state is None) == (k < 2)


def test_training_from_a_checkpoint_without_its_state_names_the_fix(tmp_path):
    trail = [_trained_checkpoint(tmp_path / f"c{k}", k + 1) for k in range(2)]
    ckpt.keep_training_state(trail, 1)
    ckpt.check_trainable(ckpt.read_checkpoint(trail[1]))
    with pytest.raises(RollflowError) as err:
        ckpt.check_trainable(ckpt.read_checkpoint(trail[0]))
    assert trail[0] in str(err.value) and "max_ckpt_to_keep" in str(err.value) and "newest" in str(err.value)


def _weights_only_checkpoint(folder: Path, step: int, origin: str, samples: list[str]) -> str:
    """A weights-only checkpoint's files: weights and a replay record from ``origin`` over ``samples``."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    _weights(folder / "model.safetensors")
    replay = {"from": origin, "steps": [{"samples": s, "fingerprint": "f", "section": {}} for s in samples]}
    (folder / ckpt.TRAIN_STATE).write_text(json.dumps({"global_step": step, "optimizer_steps": step,
                                                       "world_size": 1, "replay": replay}))
    return str(folder)


def test_weights_only_checkpoints_keep_the_state_they_replay_from(tmp_path):
    """The newest K checkpoints *with* a state keep it (the weights-only ones after them replay from it); a
    weights-only checkpoint whose origin lost its state, or whose table is gone, is refused with the fix."""
    table = tmp_path / "advantaged"
    table.mkdir()
    full = [_trained_checkpoint(tmp_path / f"f{k}", k + 1) for k in range(2)]
    light = _weights_only_checkpoint(tmp_path / "w", 3, full[1], [str(table)])
    assert ckpt.keep_training_state([*full, light], 1) == full[:1]
    info = ckpt.read_checkpoint(light)
    assert info.actor_state is None and not info.has_state and info.replay["from"] == full[1]
    ckpt.check_trainable(info)
    ckpt.check_complete(light, with_critic=False)
    orphan = _weights_only_checkpoint(tmp_path / "o", 2, full[0], [str(table)])
    with pytest.raises(RollflowError, match="state is gone") as err:
        ckpt.check_trainable(ckpt.read_checkpoint(orphan))
    assert full[0] in str(err.value) and "max_ckpt_to_keep" in str(err.value)
    lost = _weights_only_checkpoint(tmp_path / "l", 3, full[1], [str(tmp_path / "gone")])
    with pytest.raises(RollflowError, match="is gone") as err:
        ckpt.check_trainable(ckpt.read_checkpoint(lost))
    assert str(tmp_path / "gone") in str(err.value)


def test_a_plain_model_folder_trains_from_a_fresh_optimizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    _weights(tmp_path / "model.safetensors")
    info = ckpt.read_checkpoint(str(tmp_path))
    assert info.global_step == 0 and info.actor_state is None
    ckpt.check_trainable(info)


def test_a_full_disk_is_named_with_the_fix(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    model = Path(_trained_checkpoint(tmp_path / "c", 1))
    (model / "model.safetensors").write_bytes(b"w" * 1000)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 5000, 5000))
    err = ckpt.disk_full_error(str(tmp_path), str(model), RuntimeError("basic_ios::clear: iostream error"))
    assert err is not None and str(tmp_path) in str(err) and "Free disk space" in str(err)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 0, 10**9))
    assert ckpt.disk_full_error(str(tmp_path), str(model), RuntimeError("other")) is None
