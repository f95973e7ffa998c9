"""RLVR reward workers (ALGORITHMS.md §10): pure scoring functions over named columns, the custom-worker API and
the code sandbox. See base.py for the contract, routing.py for domain routing, registry.py for the one lookup site.

Importing this package registers the built-in workers: math_rule, code_sandbox, llm_judge, multiple_choice_boxed,
general_val_rule, crossthinkqa, ifeval, detection.
"""

from stages.rewards import choice, code_sandbox, detection, ifeval, llm_judge, math_rule  # noqa: F401  (register)
from stages.rewards.base import RewardOutputs, RewardWorker, token_level_zeros
from stages.rewards.registry import REWARD_WORKERS, build_worker, resolve_worker
from stages.rewards.routing import RewardRoute, RewardRouter, score_batch

__all__ = ["REWARD_WORKERS", "RewardOutputs", "RewardRoute", "RewardRouter", "RewardWorker", "build_worker",
           "resolve_worker", "score_batch", "token_level_zeros"]
