"""Session fixtures of the spine tests: one local Ray cluster, small generated example sets, one reference run.

Prefect's home and the logging set-up are process-wide: see ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest

from stages.example import ExampleSpec, generate
from tests.spine.helpers import GIGPO, run_recompute

SMALL = dict(response_len=(8, 32), prompt_len=(4, 12))


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("spine-data")


@pytest.fixture(scope="session")
def step_set(data_root) -> str:
    """~400 step-level FrozenLake rows in groups of 8, several Parquet files, short responses."""
    path = str(data_root / "step_set")
    generate(ExampleSpec(samples=400, seed=1, rows_per_file=120, **SMALL), path)
    return path


@pytest.fixture(scope="session")
def traj_set(data_root) -> str:
    """~300 trajectory-level Sokoban rows (multi-turn rows with several response segments)."""
    path = str(data_root / "traj_set")
    generate(ExampleSpec(samples=300, seed=2, env="sokoban", level="trajectory", rows_per_file=100, **SMALL), path)
    return path


@pytest.fixture(scope="session")
def base_run(step_set, data_root, ray_cluster) -> str:
    """The GiGPO recompute of ``step_set`` (rewarded/ and advantaged/ under the returned folder). Read-only."""
    out = str(data_root / "base_run")
    run_recompute(step_set, out, GIGPO)
    return out
