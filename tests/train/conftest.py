"""Fixtures of the training tests: one DeepSpeed world of one in this process, small tables,
the local Ray cluster is tests/conftest.py's ray_cluster."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def dist():
    """This process as a DeepSpeed world of one (gloo, CPU accelerator)."""
    from stages.train.distributed import init_distributed

    return init_distributed(threads=2)
