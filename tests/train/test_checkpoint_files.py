"""The files of a model folder are checked before anything loads them (stages/model_files.py), by both readers of
model folders — ``check_model_dir`` (engines, ``rollflow eval``/``rollout``, a run's ``pretrain``) and
``read_checkpoint`` (training, log-probs, values, a resumed run's last checkpoint): whole folders pass (the default
model, the tiny model, a run checkpoint's layout with LoRA adapters and DeepSpeed state), a damaged file is named with
what is wrong and the fix."""

from __future__ import annotations

import json
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from schemas.errors import RollflowError, SchemaError
import stages.generation.engines as engines
from stages.generation.engines import check_model_dir, preflight_model_dir
import stages.model_files as model_files
import stages.model_load_check as model_load_check
from stages.model_files import safetensors_problem
from stages.train.checkpoint import read_checkpoint

FIX = "restore the folder from a copy"


def _checkpoint(folder: Path, model: Path) -> Path:
    """A run checkpoint's layout around the weights of ``model``: train state, manifest, a LoRA adapter and DeepSpeed
    state (small stand-ins for the last two, whole files of their formats)."""
    import numpy as np
    from safetensors.numpy import save_file

    shutil.copytree(model, folder)
    (folder / "lora/actor").mkdir(parents=True)
    (folder / "deepspeed/actor/state").mkdir(parents=True)
    save_file({"lora_A": np.zeros((4, 2), np.float32)}, str(folder / "lora/actor/adapter_model.safetensors"))
    (folder / "lora/actor/adapter_config.json").write_text(json.dumps({"r": 4}))
    with zipfile.ZipFile(folder / "deepspeed/actor/state/mp_rank_00_model_states.pt", "w") as state:
        state.writestr("archive/data.pkl", b"x" * 64)
    (folder / "train_state.json").write_text(json.dumps({"global_step": 1, "optimizer_steps": 1, "world_size": 1,
                                                         "zero_stage": 2, "replay": None, "lora": {"actor": {}}}))
    (folder / "manifest.json").write_text(json.dumps({"stage": "train_step", "fingerprint": "0" * 64}))
    return folder


def test_whole_model_folders_pass(default_model, tiny_model, tmp_path):
    for model in (default_model, tiny_model):
        assert check_model_dir(model) == model
        assert read_checkpoint(str(model)).global_step == 0
    ckpt = _checkpoint(tmp_path / "ckpt", tiny_model)
    check_model_dir(ckpt)
    for model in (default_model, tiny_model, ckpt):  # and an engine can load them (config, weights, tokenizer)
        assert preflight_model_dir(model) == model
    assert read_checkpoint(str(ckpt)).global_step == 1
    shutil.rmtree(ckpt / "deepspeed")  # a weights-only checkpoint: its replay record
    replay = {"from": str(tiny_model), "steps": [{"samples": str(tmp_path), "fingerprint": "f", "section": {}}]}
    (ckpt / "train_state.json").write_text(json.dumps({"global_step": 1, "replay": replay}))
    assert read_checkpoint(str(ckpt)).replay == replay


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _replace(text: bytes):
    return lambda path: path.write_bytes(text)


def _shard_index(path: Path) -> None:
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (path.parent / "model.safetensors.index.json").write_text(json.dumps(index))


# damage -> (the file, how it is damaged, what the message says of it)
DAMAGES = {
    "weights-cut-short": ("model.safetensors", _cut, "model.safetensors holds 13175104 bytes where its header says "
                                                     "26350208 (cut short)"),
    "weights-bytes-after": ("model.safetensors", lambda p: p.write_bytes(p.read_bytes() + b"x"),
                            "(bytes after its tensors)"),
    "weights-header-not-json": ("model.safetensors", _replace((9).to_bytes(8, "little") + b"not json!"),
                                "model.safetensors has a header that is not valid JSON"),
    "weights-shorter-than-a-header": ("model.safetensors", _replace(b"\x10\x00"),
                                      "model.safetensors is cut short or not a safetensors file: 2 bytes"),
    "weights-without-offsets": ("model.safetensors", _replace((15).to_bytes(8, "little") + b'{"w": {"x": 1}}'),
                                "a tensor entry without two integer data_offsets"),
    "config-not-json": ("config.json", _replace(b'{"model_type": '), "config.json is not valid JSON"),
    "tokenizer-not-json": ("tokenizer.json", _cut, "tokenizer.json is not valid JSON"),
    "tokenizer-a-list": ("tokenizer.json", _replace(b"[]"), "tokenizer.json holds a list, not a JSON object"),
    "shard-missing": ("model.safetensors", _shard_index, "model.safetensors.index.json lists the shard "
                                                         "model-00002-of-00002.safetensors, which is missing"),
    "train-state-not-json": ("train_state.json", _cut, "train_state.json is not valid JSON"),
    "train-state-step-text": ("train_state.json", _replace(b'{"global_step": "one"}'),
                              "train_state.json field 'global_step' is a string, expected an integer"),
    "train-state-replay-without-steps": ("train_state.json", _replace(b'{"replay": {"from": "/x"}}'),
                                         "train_state.json field 'replay' is not an object with a string 'from'"),
    "adapter-cut-short": ("lora/actor/adapter_model.safetensors", _cut,
                          "lora/actor/adapter_model.safetensors is cut short"),
    "deepspeed-state-cut-short": ("deepspeed/actor/state/mp_rank_00_model_states.pt", _cut,
                                  "deepspeed/actor/state/mp_rank_00_model_states.pt is not a whole torch file"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_file_is_named_with_the_fix(damage, tiny_model, tmp_path):
    name, spoil, phrase = DAMAGES[damage]
    ckpt = _checkpoint(tmp_path / "ckpt", tiny_model)
    spoil(ckpt / name)
    for check in (check_model_dir, lambda folder: read_checkpoint(str(folder))):
        with pytest.raises(SchemaError) as err:
            check(ckpt)
        assert f"model folder {ckpt}: " in str(err.value) and phrase in str(err.value) and FIX in str(err.value)


def test_a_damaged_manifest_gets_the_manifest_readers_error(tiny_model, tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt", tiny_model)
    (ckpt / "manifest.json").write_text('{"stage": "train_step", "fingerprint": 7}')
    with pytest.raises(RollflowError, match="manifest .*/ckpt/manifest.json is damaged: field 'fingerprint' is an "
                                            "integer, expected a string; delete the folder"):
        check_model_dir(ckpt)


def _counting(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a wrapper that records each call's first argument."""
    calls, inner = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda first, *rest: (calls.append(first), inner(first, *rest))[1])
    return calls


def test_a_folder_is_checked_once_while_its_files_are_unchanged(tiny_model, tmp_path, monkeypatch):
    """A run checks its model folder at every turn, pass and step: a folder that passed is read again only when a
    file changed since (contents, size, replaced, added or removed: its ctime, size, inode and the list of files),
    or when its files changed too recently to tell a second write within the file system's time granularity from
    none (``SETTLED_S``, 2 s; 0.2 here). A failed check is not remembered. The pre-flight's load check
    (config, architecture, tokenizer) likewise. A pass is also remembered for later processes (a file in the
    rollflow cache): a process that has not checked the folder itself finds it, unless the check's version
    (transformers' for the load check) changed; the cache keeps at most ``MARKERS_KEPT`` such files."""
    monkeypatch.setenv("ROLLFLOW_CACHE", str(tmp_path / "cache"))
    files, loads = _counting(monkeypatch, model_files, "_file_problem"), _counting(monkeypatch, model_load_check,
                                                                                   "check_model_loads")
    folder = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    monkeypatch.setattr(model_files, "SETTLED_S", 3600.0)  # every file is too recent
    preflight_model_dir(folder)
    preflight_model_dir(folder)
    assert len(files) == 2 * 7 and len(loads) == 2, "just written: checked each time"
    monkeypatch.setattr(model_files, "SETTLED_S", 0.2)
    time.sleep(0.3)
    for _ in range(3):
        preflight_model_dir(folder)
        assert read_checkpoint(str(folder)).global_step == 0
    assert len(files) == 3 * 7 and len(loads) == 3, "settled: checked once"
    tokenizer = folder / "tokenizer.json"
    good = tokenizer.read_bytes()
    tokenizer.write_bytes(b"[" + b" " * (len(good) - 1))  # in place, same size: not valid JSON
    time.sleep(0.3)
    for _ in range(2):
        with pytest.raises(SchemaError, match="tokenizer.json is not valid JSON"):
            check_model_dir(folder)
    tokenizer.write_bytes(good)
    (folder / "notes.json").write_text("{}")
    time.sleep(0.3)
    check_model_dir(folder)
    check_model_dir(folder)
    # the damaged folder each time (up to tokenizer.json, its sixth file), the mended one with its new file once
    assert len(files) == 3 * 7 + 2 * 6 + 8
    (folder / "notes.json").unlink()
    time.sleep(0.3)
    check_model_dir(folder)
    assert len(files) == 3 * 7 + 2 * 6 + 8 + 7, "a file removed"
    preflight_model_dir(folder)
    assert len(files) == 3 * 7 + 2 * 6 + 8 + 7 and len(loads) == 4, "the load check of this state: once"
    # another process: nothing remembered in it, the cache's files say the folder passed
    for check in (engines._LOADS_CHECKED, model_files._FILES_CHECKED):
        monkeypatch.setattr(check, "passed", type(check.passed)())
    preflight_model_dir(folder)
    assert len(files) == 3 * 7 + 2 * 6 + 8 + 7 and len(loads) == 4
    monkeypatch.setattr(engines._LOADS_CHECKED, "passed", type(engines._LOADS_CHECKED.passed)())
    monkeypatch.setattr(engines._LOADS_CHECKED, "version", lambda: "another")  # what the check depends on changed
    preflight_model_dir(folder)
    assert len(loads) == 5
    monkeypatch.setattr(model_files, "MARKERS_KEPT", 4)
    for n in range(5):
        model_files._write_marker(tmp_path / "markers" / f"m{n}")
        time.sleep(0.01)
    assert sorted(p.name for p in (tmp_path / "markers").iterdir()) == ["m3", "m4"], "the older half deleted"


def test_safetensors_of_no_tensors_is_whole(tmp_path):
    path = tmp_path / "empty.safetensors"
    path.write_bytes((2).to_bytes(8, "little") + b"{}")
    assert safetensors_problem(path) is None
    path.write_bytes((2).to_bytes(8, "little") + b"{}\0")
    assert "holds 11 bytes where its header says 10" in safetensors_problem(path)


def test_a_large_json_text_is_parsed_once_whatever_folder_holds_it(tiny_model, tmp_path, monkeypatch):
    """Every checkpoint holds the model's tokenizer.json (3.5 MB) and is read as soon as it is written, before its
    folder's signature settles: a large JSON text that parsed to an object is remembered by its SHA-256, in the
    process and in the cache (``BIG_JSON_BYTES``); any other text is parsed, a damaged one each time it is read."""
    monkeypatch.setenv("ROLLFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model_files, "SETTLED_S", 3600.0)  # every file is too recent: no folder is remembered
    monkeypatch.setattr(model_files, "_JSON_OBJECTS", set())
    texts = _counting(monkeypatch, model_files, "_read_json")
    large = lambda: [t for t in texts if len(t) >= model_files.BIG_JSON_BYTES]  # noqa: E731
    folders = [Path(shutil.copytree(tiny_model, tmp_path / f"ckpt{k}")) for k in range(2)]
    for folder in folders + folders:
        check_model_dir(folder)
    assert len(large()) == 1 and len(texts) == 1 + 4 * 4, "the tokenizer once, the four small JSON files each time"
    monkeypatch.setattr(model_files, "_JSON_OBJECTS", set())  # another process: the cache's file says it parsed
    check_model_dir(folders[0])
    assert len(large()) == 1
    tokenizer = folders[1] / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:-1])  # one byte short: another text, not valid JSON
    for _ in range(2):
        with pytest.raises(SchemaError, match="tokenizer.json is not valid JSON"):
            check_model_dir(folders[1])
    assert len(large()) == 3, "a damaged text is parsed each time"
