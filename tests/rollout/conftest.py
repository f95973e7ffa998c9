"""Fixtures for the rollout tests: the tiny random model's tokenizer (the models: tests/conftest.py), small configs, fake replies."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from stages.generation.engines import load_tokenizer

    return load_tokenizer(tiny_model)
