"""The advantage-estimator registry: one entry per ``adv_estimator`` (spec §4.3-4.5, §5.4).

An entry is the estimator's row of the capability table (:data:`schemas.capabilities.ESTIMATOR_CAPABILITIES`:
``needs_critic``, ``needs_step_rows``, ``response_reward``, ...) plus its token recursion; this module adds only the
recursions, so the registry and the table the config validates against cannot disagree. Code gets an estimator
through :func:`estimator` (the one lookup) and reads its fields; nobody branches on the name. The token recursion of
every entry has one signature::

    token_recursion(rewards, mask, values, gamma, lambd, roll_compat) -> (advantages, returns)

with ``rewards``/``values`` next-token ``Ragged`` columns, ``mask (N,)`` the token mask and ``roll_compat`` the
GAE compatibility switch (ignored by the others).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from schemas.capabilities import ESTIMATOR_CAPABILITIES, EstimatorCapabilities, ResponseReward
from schemas.errors import InvariantError
from stages.algos.ragged import Ragged
from stages.algos.returns import agentic_reinforce_returns, gae, reinforce_returns
from stages.registry import Registry

TokenRecursion = Callable[[Ragged, np.ndarray, "Ragged | None", float, float, bool], tuple[Ragged, Ragged]]

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "ResponseReward", "TokenRecursion", "estimator"]


@dataclass(frozen=True)
class AdvantageEstimator(EstimatorCapabilities):
    """An estimator's capabilities (its table row) and its ``token_recursion``."""

    token_recursion: TokenRecursion = field(kw_only=True)


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def estimator(name: str) -> AdvantageEstimator:
    """The registered estimator ``name`` (the one lookup; KeyError names the known estimators)."""
    return ADVANTAGE_ESTIMATORS.get(name)


def _gae_recursion(rewards: Ragged, mask: np.ndarray, values: Ragged | None, gamma: float, lambd: float,
                   roll_compat: bool) -> tuple[Ragged, Ragged]:
    if values is None:
        raise InvariantError("adv_estimator 'gae' needs the critic's 'values' column; run the critic value stage "
                             "first or pick an estimator without a critic (reinforce, grpo, ...)")
    return gae(rewards, values, mask, gamma, lambd, roll_compat=roll_compat)


def _reward_to_go(rewards: Ragged, mask: np.ndarray, values: Ragged | None, gamma: float, lambd: float,
                  roll_compat: bool) -> tuple[Ragged, Ragged]:
    g = reinforce_returns(rewards, gamma)
    return g, g


def _segment_returns(rewards: Ragged, mask: np.ndarray, values: Ragged | None, gamma: float, lambd: float,
                     roll_compat: bool) -> tuple[Ragged, Ragged]:
    g = agentic_reinforce_returns(rewards, mask, gamma)
    return g, g


def _register(name: str, token_recursion: TokenRecursion) -> None:
    """Register ``name``'s table row with its recursion (a name without a row is a KeyError here)."""
    ADVANTAGE_ESTIMATORS.register(name)(AdvantageEstimator(**asdict(ESTIMATOR_CAPABILITIES[name]),
                                                           token_recursion=token_recursion))


_register("gae", _gae_recursion)
_register("reinforce", _reward_to_go)
_register("grpo", _reward_to_go)
_register("gigpo", _reward_to_go)
_register("step_reinforce", _reward_to_go)
_register("agentic_reinforce", _segment_returns)
