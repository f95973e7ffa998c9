"""What a generation engine will do with a model folder, checked before it starts (the pre-flight of rollout, eval,
train and a rollout's re-run), without loading a weight: transformers reads its config.json, the architecture it names
is built on the meta device (shapes only, no memory), every tensor that architecture has is in the safetensors files
with its shape (read from their headers) and none is there that it lacks, and the tokenizer loads. Before, a folder of
another architecture, or without a tokenizer, passed the file checks (stages/model_files.py) and failed about 45 s
later inside the engine actor with a traceback.

Imports torch and transformers (a few seconds): used only from the pre-flight, after the config is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from schemas.errors import SchemaError

# transformers' own handler writes its warnings (a config's token ids outside a tiny vocabulary, ...) straight to the
# stderr it found first, past the command's logging: route them into the process's log like every library's records
transformers.utils.logging.disable_default_handler()
transformers.utils.logging.enable_propagation()

_FIX = ("pass the folder of a model saved with save_pretrained (config, safetensors weights and tokenizer of one "
        "model), e.g. a run's checkpoint runs/<run>/iter_<k>/checkpoint")


def check_model_loads(folder: Path) -> None:
    """Raise a SchemaError naming the folder, what does not match and the fix (see the module docstring)."""
    config = _config(folder)
    expected = _architecture_shapes(folder, config)
    stored = stored_shapes(folder)
    tied = _tied_names(config, expected)
    missing = sorted(set(expected) - set(stored) - tied)
    unexpected = sorted(set(stored) - set(expected))
    wrong = sorted(n for n in set(expected) & set(stored) if tuple(expected[n]) != tuple(stored[n]))
    arch = (config.architectures or [type(config).__name__])[0]
    if missing or unexpected:
        parts = [f"{len(missing)} tensor(s) of {arch} are missing (e.g. {missing[0]})" if missing else "",
                 f"{len(unexpected)} stored tensor(s) are not {arch}'s (e.g. {unexpected[0]})" if unexpected else ""]
        raise SchemaError(f"model folder {folder}: its weights are not those of the architecture its config.json "
                          f"names: {'; '.join(p for p in parts if p)}; {_FIX}")
    if wrong:
        name = wrong[0]
        raise SchemaError(f"model folder {folder}: tensor {name} has shape {list(stored[name])} in the weights but "
                          f"{list(expected[name])} in {arch} as config.json describes it ({len(wrong)} tensor(s) "
                          f"differ); the weights belong to another model: {_FIX}")
    _check_tokenizer(folder)


def _config(folder: Path):
    try:
        return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise SchemaError(f"model folder {folder}: config.json does not describe a model transformers knows "
                          f"({str(err).splitlines()[0]}); {_FIX}") from None


def _architecture_shapes(folder: Path, config) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the causal LM ``config`` describes, built on the meta device."""
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as err:
        raise SchemaError(f"model folder {folder}: config.json names no causal language model transformers can build "
                          f"({str(err).splitlines()[0]}); {_FIX}") from None
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _tied_names(config, expected: dict) -> set[str]:
    """The output embedding when the config ties it to the input one (save_pretrained leaves it out)."""
    return {n for n in expected if n.endswith("lm_head.weight")} if getattr(config, "tie_word_embeddings", False) \
        else set()


def stored_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over the folder's safetensors files, from their JSON headers (stages/model_files.py has
    checked that they parse)."""
    shapes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        shapes.update({name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"})
    return shapes


def _check_tokenizer(folder: Path) -> None:
    try:
        transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError, AttributeError) as err:
        raise SchemaError(f"model folder {folder}: its tokenizer does not load ({str(err).splitlines()[0]}); the "
                          f"engine needs the tokenizer files beside the weights (tokenizer.json, "
                          f"tokenizer_config.json): {_FIX}") from None
