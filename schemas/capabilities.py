"""The capability tables of the advantage estimators and the policy losses: data, in one place (DESIGN.md "Variants").

The config models read these tables to validate a config; ``stages.algos.estimators`` and ``stages.losses.actor``
build their registry entries from the same rows and add only the callables, so a capability and its implementation
cannot disagree (``tests/schemas/test_capabilities.py`` checks that every row is registered and every registered name
has a row). Plain frozen dataclasses: no torch, numpy or ``stages`` import, so ``schemas/`` depends on nothing above.

To add an estimator or a loss: add its row here, then register its callable under the same name (CONTRIBUTING.md).
The config's ``Literal`` of names (:data:`schemas.config.AdvEstimator`, ``TrainSection.policy_loss``) comes from the
keys of these tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Mapping

ResponseReward = Literal["episode", "step_return", "gigpo"]


@dataclass(frozen=True)
class EstimatorCapabilities:
    """What an ``adv_estimator`` needs and does (spec §3.3, §4.3-4.5, §5.1, §5.4).

    ``needs_critic``: uses critic values (GAE). ``needs_step_rows``: needs one row per env step with discounted step
    returns (§5.1). ``needs_trajectory_rows``: its returns follow the turn segments of one trajectory row, so the
    agentic rollout must write one row per trajectory. ``response_reward``: which response-level reward it trains on
    (§5.4): ``episode`` (normalised episode/response score), ``step_return`` (normalised discounted step return),
    ``gigpo`` (episode + step mix, weighted by ``episode_reward_weight`` / ``step_reward_weight``). ``agentic_only``:
    not available in the RLVR pipeline (ROLL's RLVR ``compute_advantage`` rejects it). ``group_relative``: its rewards
    are compared within the group of responses to one prompt (GRPO, GiGPO). ``forces_group_norm``: the RLVR reward
    normalisation is forced to per-prompt group mean/std whatever ``norm_mean_type``/``norm_std_type`` say (§3.3).
    """

    name: str
    needs_critic: bool
    needs_step_rows: bool
    response_reward: ResponseReward
    needs_trajectory_rows: bool = False
    agentic_only: bool = False
    group_relative: bool = False
    forces_group_norm: bool = False


@dataclass(frozen=True)
class PolicyLossCapabilities:
    """What a ``policy_loss`` offers (spec §6.3-6.5).

    ``levels``: the importance-ratio granularities it offers; ``level_field``: the loss option choosing one (None:
    only ``token``). ``uses_final_mask``: it reads ``final_mask`` and its global counts (RLVR sample masks).
    ``own_options``: loss options no other loss reads (the others ignore them, as ROLL's do).
    """

    name: str
    levels: tuple[str, ...]
    level_field: str | None = None
    uses_final_mask: bool = False
    own_options: tuple[str, ...] = ()

    def offers_level(self, field: str, value: str) -> bool:
        """Whether the loss honours ``field: value``: ``token`` is every loss's level; another value only where
        ``field`` is this loss's ``level_field`` and the value one of its ``levels``."""
        return value == "token" or (field == self.level_field and value in self.levels)


def _table(*rows):
    return MappingProxyType({row.name: row for row in rows})


# Row order is the order of the config's Literal (and of its error messages).
ESTIMATOR_CAPABILITIES: Mapping[str, EstimatorCapabilities] = _table(
    EstimatorCapabilities("gae", needs_critic=True, needs_step_rows=False, response_reward="episode"),
    EstimatorCapabilities("reinforce", needs_critic=False, needs_step_rows=False, response_reward="episode"),
    EstimatorCapabilities("grpo", needs_critic=False, needs_step_rows=False, response_reward="episode",
                          group_relative=True, forces_group_norm=True),
    EstimatorCapabilities("gigpo", needs_critic=False, needs_step_rows=True, response_reward="gigpo",
                          group_relative=True),
    EstimatorCapabilities("step_reinforce", needs_critic=False, needs_step_rows=True, response_reward="step_return"),
    EstimatorCapabilities("agentic_reinforce", needs_critic=False, needs_step_rows=False, response_reward="episode",
                          needs_trajectory_rows=True, agentic_only=True),
)

POLICY_LOSS_CAPABILITIES: Mapping[str, PolicyLossCapabilities] = _table(
    PolicyLossCapabilities("agentic", ("token", "segment"), "ratio_type"),
    PolicyLossCapabilities("base", ("token",)),
    PolicyLossCapabilities("rlvr", ("token", "seq"), "importance_sampling", uses_final_mask=True,
                           own_options=("rl_loss_coef", "difficulty_loss_weight", "length_loss_weight")),
)


def _lookup(table: Mapping[str, object], kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown {kind} '{name}'; known: {', '.join(sorted(table))}") from None


def estimator_capabilities(name: str) -> EstimatorCapabilities:
    """The capabilities of ``adv_estimator`` ``name`` (the one lookup of the table; KeyError names the known ones)."""
    return _lookup(ESTIMATOR_CAPABILITIES, "advantage estimator", name)


def policy_loss_capabilities(name: str) -> PolicyLossCapabilities:
    """The capabilities of ``policy_loss`` ``name`` (the one lookup of the table; KeyError names the known ones)."""
    return _lookup(POLICY_LOSS_CAPABILITIES, "policy loss", name)
