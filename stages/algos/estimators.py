"""The advantage-estimator registry: one entry per ``adv_estimator`` with its capabilities (spec §4.3-4.5, §5.4).

Callers look an estimator up once (``ADVANTAGE_ESTIMATORS.get(name)``) and read its fields; nobody branches on the
name. The token recursion of every entry has one signature::

    token_recursion(rewards, mask, values, gamma, lambd, roll_compat) -> (advantages, returns)

with ``rewards``/``values`` next-token ``Ragged`` columns, ``mask (N,)`` the token mask and ``roll_compat`` the
GAE compatibility switch (ignored by the others).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from schemas.errors import InvariantError
from stages.algos.ragged import Ragged
from stages.algos.returns import agentic_reinforce_returns, gae, reinforce_returns
from stages.registry import Registry

TokenRecursion = Callable[[Ragged, np.ndarray, "Ragged | None", float, float, bool], tuple[Ragged, Ragged]]
ResponseReward = Literal["episode", "step_return", "gigpo"]


@dataclass(frozen=True)
class AdvantageEstimator:
    """What an ``adv_estimator`` needs and does.

    ``needs_critic``: uses critic values (GAE). ``needs_step_rows``: needs one row per env step with discounted step
    returns (§5.1). ``response_reward``: which response-level reward it trains on (§5.4): ``episode`` (normalised
    episode/response score), ``step_return`` (normalised discounted step return), ``gigpo`` (episode + step mix).
    ``agentic_only``: not available in the RLVR pipeline (ROLL's RLVR ``compute_advantage`` rejects it).
    """

    name: str
    needs_critic: bool
    token_recursion: TokenRecursion
    needs_step_rows: bool
    response_reward: ResponseReward
    agentic_only: bool = False


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


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


def _register(entry: AdvantageEstimator) -> None:
    ADVANTAGE_ESTIMATORS.register(entry.name)(entry)


_register(AdvantageEstimator("gae", needs_critic=True, token_recursion=_gae_recursion, needs_step_rows=False,
                             response_reward="episode"))
_register(AdvantageEstimator("reinforce", needs_critic=False, token_recursion=_reward_to_go, needs_step_rows=False,
                             response_reward="episode"))
_register(AdvantageEstimator("grpo", needs_critic=False, token_recursion=_reward_to_go, needs_step_rows=False,
                             response_reward="episode"))
_register(AdvantageEstimator("gigpo", needs_critic=False, token_recursion=_reward_to_go, needs_step_rows=True,
                             response_reward="gigpo"))
_register(AdvantageEstimator("step_reinforce", needs_critic=False, token_recursion=_reward_to_go,
                             needs_step_rows=True, response_reward="step_return"))
_register(AdvantageEstimator("agentic_reinforce", needs_critic=False, token_recursion=_segment_returns,
                             needs_step_rows=False, response_reward="episode", agentic_only=True))
