"""Session fixtures of the RLVR stage tests: one local Ray cluster (2 CPUs) shared by every test that needs Ray."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def ray_cluster():
    import logging

    import ray
    import ray.data  # noqa: F401  (configures its loggers on import)

    from stages.cluster import ensure_ray

    settings = ensure_ray(num_cpus=2, progress=False)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("ray", "filelock", "asyncio")):
            logging.getLogger(name).setLevel(logging.WARNING)
    yield settings
    ray.shutdown()
