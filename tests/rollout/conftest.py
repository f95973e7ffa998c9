"""Fixtures for the rollout tests: the tiny random model (plumbing), its tokenizer, small configs, fake replies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from stages.generation.model_store import tiny_random_model_dir

    return tiny_random_model_dir()


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from stages.generation.engines import load_tokenizer

    return load_tokenizer(tiny_model)
