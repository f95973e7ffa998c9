"""Fixtures for the generation engine tests: modified model copies (the models themselves: tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network, ever


def save_perturbed_copy(source: Path, target: Path, relative_scale: float = 0.05, seed: int = 0) -> Path:
    """Copy an HF safetensors folder with every tensor moved by ``relative_scale * std * N(0, 1)`` noise."""
    import torch
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, target / path.name)
    generator = torch.Generator().manual_seed(seed)
    for path in source.glob("*.safetensors"):
        state = load_file(str(path))
        noisy = {name: (t + relative_scale * t.float().std() * torch.randn(t.shape, generator=generator)).to(t.dtype)
                 for name, t in state.items()}
        save_file(noisy, str(target / path.name), metadata={"format": "pt"})
    return target
