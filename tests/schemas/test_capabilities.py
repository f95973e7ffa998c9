"""The capability tables of estimators and losses (schemas/capabilities.py) and the one-way import rule of schemas/."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

import schemas
from schemas.capabilities import (ESTIMATOR_CAPABILITIES, POLICY_LOSS_CAPABILITIES, estimator_capabilities,
                                  policy_loss_capabilities)
from schemas.config import AdvEstimator
from schemas.train_config import TrainSection

ROOT = Path(__file__).resolve().parents[2]


# Imports every schemas module, then runs every config model's validators with every estimator (a lazy import inside
# a validator would load stages/ only then), and prints the stages modules loaded.
_ISOLATION_PROBE = """
import importlib, pkgutil, sys
from typing import get_args
from pydantic import ValidationError
import schemas
for info in pkgutil.iter_modules(schemas.__path__):
    importlib.import_module("schemas." + info.name)
from schemas.config import AdvEstimator, RecomputeConfig
from schemas.rlvr_config import RLVRConfig
from schemas.rlvr_train_config import RLVRTrainConfig
from schemas.train_config import TrainSection
from schemas.train_flow_config import TrainFlowConfig
rewards = {"routes": {"*": {"worker": "math_rule"}}}
for name in get_args(AdvEstimator):
    for model, extra in ((RecomputeConfig, {}), (RLVRConfig, {"rewards": rewards}),
                         (RLVRTrainConfig, {"rewards": rewards}), (TrainFlowConfig, {"train": {"ratio_type": "segment"}}),
                         (TrainSection, {})):
        try:
            model.model_validate({"adv_estimator": name, **extra})
        except ValidationError:
            pass
    TrainSection(adv_estimator=name).needs_critic
print(sorted(m for m in sys.modules if m == "stages" or m.startswith("stages.")))
"""


def test_no_schemas_module_loads_stages():
    """schemas/ is the bottom layer. That no import statement of it names stages (lazy ones included) is the layers
    contract of pyproject.toml (tests/test_import_contracts.py); here: importing every module and running every config
    validator loads no ``stages`` module (nor through ``importlib``)."""
    names = sorted(info.name for info in pkgutil.iter_modules(schemas.__path__))
    assert "capabilities" in names and "train_flow_config" in names
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _ISOLATION_PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_the_configs_accept_exactly_the_table_rows():
    assert get_args(AdvEstimator) == tuple(ESTIMATOR_CAPABILITIES)
    assert get_args(TrainSection.model_fields["policy_loss"].annotation) == tuple(POLICY_LOSS_CAPABILITIES)
    assert all(row.name == name for name, row in ESTIMATOR_CAPABILITIES.items())
    assert all(row.name == name for name, row in POLICY_LOSS_CAPABILITIES.items())


def test_lookups_name_the_known_rows():
    assert estimator_capabilities("grpo").forces_group_norm
    assert policy_loss_capabilities("rlvr").uses_final_mask
    with pytest.raises(KeyError, match="unknown advantage estimator 'ppo'; known: agentic_reinforce, gae"):
        estimator_capabilities("ppo")
    with pytest.raises(KeyError, match="unknown policy loss 'ppo'; known: agentic, base, rlvr"):
        policy_loss_capabilities("ppo")


def test_a_loss_offers_token_and_its_own_levels():
    agentic, base, rlvr = (policy_loss_capabilities(n) for n in ("agentic", "base", "rlvr"))
    assert agentic.offers_level("ratio_type", "segment") and agentic.offers_level("ratio_type", "token")
    assert not base.offers_level("ratio_type", "segment") and not rlvr.offers_level("ratio_type", "segment")
    assert rlvr.offers_level("importance_sampling", "seq") and not agentic.offers_level("importance_sampling", "seq")
