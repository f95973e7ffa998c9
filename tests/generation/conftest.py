"""Fixtures for the generation engine tests: the cached default model, the tiny random model, modified copies."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network, ever


@pytest.fixture(scope="session")
def default_model() -> Path:
    from stages.generation.model_store import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from stages.generation.model_store import tiny_random_model_dir

    return tiny_random_model_dir()


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
