"""A training run keeps the DeepSpeed state only for its newest checkpoints (train.max_ckpt_to_keep); the weights
of every checkpoint stay, and training from a checkpoint without its state is refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.errors import RollflowError
from stages.train import checkpoint as ckpt


def _trained_checkpoint(folder: Path, step: int) -> str:
    """The files of a trained checkpoint, as the training step lays them out (contents do not matter here)."""
    (folder / ckpt.ACTOR_STATE / "state").mkdir(parents=True)
    (folder / ckpt.ACTOR_STATE / "state" / "optim.pt").write_bytes(b"x" * 64)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"w")
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


def test_a_plain_model_folder_trains_from_a_fresh_optimizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"w")
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
