"""Pure text environments (spec §9, §11): FrozenLake, Sokoban, single-turn math/QA, the action parser, the registry.

Imports numpy and the standard library only. Use :func:`make_env` to build an environment by tag and
:func:`restore_env` to rebuild one from the state string stored in a rollout row.
"""

from stages.envs.base import METRICS_AGG_MODE, EnvStateError, TextEnv, retry_seed
from stages.envs.parser import ParsedAction, default_parser_action_func, parse_action
from stages.envs.registry import (ENVIRONMENTS, EnvSpec, env_spec, make_demo_env, make_env, preview, register_env,
                                  restore_env)

# the built-in environments: each module registers its own tags at import (GEM's only when gem-llm is installed)
from stages.envs import frozen_lake, gem_adapter, single_turn, sokoban, webshop  # noqa: F401

__all__ = ["ENVIRONMENTS", "EnvSpec", "EnvStateError", "env_spec", "METRICS_AGG_MODE", "ParsedAction", "TextEnv",
           "default_parser_action_func", "make_demo_env", "make_env", "parse_action", "preview", "register_env",
           "restore_env", "retry_seed"]
