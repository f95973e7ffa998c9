"""Fixtures of the training tests: one DeepSpeed world of one in this process, small tables,
one local Ray cluster (2 CPUs) shared with the other test folders."""

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
    from stages.train.core import init_distributed

    return init_distributed(threads=2)


@pytest.fixture(scope="session")
def ray_cluster():
    import logging

    import ray.data  # noqa: F401  (configures its loggers on import)

    from stages.cluster import ensure_ray

    settings = ensure_ray(num_cpus=2, progress=False)
    for name in list(logging.root.manager.loggerDict):  # Ray Data's DEBUG reports would flood failing output
        if name.startswith(("ray", "filelock", "asyncio")):
            logging.getLogger(name).setLevel(logging.WARNING)
    return settings
