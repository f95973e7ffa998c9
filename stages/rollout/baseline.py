"""The random-legal baseline of an evaluation: uniformly random valid actions on the evaluation's own levels, under the
rollout's own turn limit.

A trained policy is compared with it (benchmarks/frozenlake_learning.py). The limit matters: FrozenLake never ends an
episode by step count itself (the env manager does, spec §11), so a baseline that steps the env until it ends plays
about twice as many turns as a policy with ``max_steps: 4`` gets, and solves twice as many maps (0.296 against 0.155
on the shipped FrozenLake config's held-out maps). Pure env stepping: no engine, no Ray.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from schemas.rollout_config import TurnSection, turn_section
from stages.algos.intervals import wilson
from stages.envs.registry import make_env
from stages.rollout.episode import env_entry, env_kwargs, level_seed


@dataclass(frozen=True)
class BaselineResult:
    success_rate: float  # share of the episodes that ended in success
    episodes: int
    longest: int  # most turns any episode played (<= the rollout's max_steps)

    def interval(self) -> tuple[float, float]:
        """Wilson's 95 % interval of :attr:`success_rate` over :attr:`episodes`."""
        return wilson(round(self.success_rate * self.episodes), self.episodes)


def has_action_list(section: TurnSection) -> bool:
    """Whether every environment of ``section`` has a finite list of legal actions (``action_lookup``: FrozenLake,
    Sokoban), the random-legal policy's precondition; open-ended environments (GEM's games, WebShop) have none."""
    entries = {e.tag: e for e in (env_entry(section, group * section.env.group_size)
                                  for group in range(section.env.num_env_groups))}
    return all(hasattr(make_env(e.env_type, **env_kwargs(section, e)), "action_lookup") for e in entries.values())


def random_policy_success(section: TurnSection, episodes_per_level: int, seed: int = 0) -> BaselineResult:
    """Play ``episodes_per_level`` episodes of uniformly random actions (each a valid answer) on every level of
    ``section`` (a rollout's TurnSection: the levels its groups play), each at most its tag's ``max_steps`` turns,
    as the rollout allows the policy. Needs :func:`has_action_list`."""
    rng = random.Random(seed)
    wins = total = longest = 0
    for group in range(section.env.num_env_groups):
        level = level_seed(section.seed, section.iteration, group)
        entry = env_entry(section, group * section.env.group_size)
        for _ in range(episodes_per_level):
            env = make_env(entry.env_type, **env_kwargs(section, entry))
            env.reset(level)
            names = list(env.action_lookup.values())
            info: dict = {}
            turns = 0
            while turns < entry.max_steps:
                _, _, terminated, truncated, info = env.step(f"<answer>{rng.choice(names)}</answer>")
                turns += 1
                if terminated or truncated:
                    break
            wins += bool(info.get("metrics", {}).get("success"))
            total += 1
            longest = max(longest, turns)
    return BaselineResult(wins / total, total, longest)


def evaluation_baseline(config) -> BaselineResult | None:
    """The random-legal policy on an agentic run's held-out evaluation (``config``: a TrainFlowConfig): its levels,
    its turn limit, at least 64 episodes per level (the evaluation's ``group_size`` where larger), so the rate is
    known to about 1 % (standard error) on the shipped configs' 16 levels; None when an environment has no list of
    legal actions."""
    section = turn_section(config.eval_rollout())
    if not has_action_list(section):
        return None
    return random_policy_success(section, max(64, config.eval.group_size))
