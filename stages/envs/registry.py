"""The environment registry: tag → :class:`EnvSpec`; :func:`env_spec` is the one lookup (DESIGN.md "Variants").

This module holds the registry only and imports no environment. Each environment module registers its own tags at
import with ``register_env(name, EnvSpec(...))``: ``frozen_lake`` (``FrozenLake``, ``FrozenLakeSlippery``),
``sokoban`` (``SimpleSokoban``, ``LargerSokoban``, ``SokobanDifferentGridVocab``: ROLL's example configs'
``custom_envs``), ``single_turn`` (``GemMath``, ``GemQA``), ``gem_adapter`` (the GEM games, when gem-llm is installed)
and ``webshop``; the package ``stages.envs`` imports them all, so importing any part of it fills the registry. The
contract test in ``tests/envs`` covers every registered tag automatically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from schemas.errors import ConfigError
from stages.envs.base import TextEnv
from stages.registry import Registry

ROLL_MAX_STEPS = 10  # max_actions_per_traj in ROLL's agentic example configs (the built-ins' default max_steps)


@dataclass(frozen=True)
class EnvSpec:
    """One registered environment.

    ``env_class`` builds it from ``default_kwargs`` updated by the caller's kwargs. Capabilities:
    ``multi_turn`` (more than one step per episode), ``ends_at_max_steps`` (the env itself ends an episode after
    ``max_steps`` steps; otherwise the env manager does, spec §11), ``stochastic`` (transitions draw from the env's
    RNG), ``needs_data`` (reset needs a dataset), ``seeded_start`` (the first observation depends on the seed; False
    for GEM's Tower of Hanoi, which always starts with every disk on tower A). ``demo_kwargs`` make a self-contained
    instance (used by ``rollflow show`` and the contract test when the env needs data).
    """

    env_class: type[TextEnv]
    default_kwargs: Mapping[str, Any] = field(default_factory=dict)
    multi_turn: bool = True
    ends_at_max_steps: bool = True
    stochastic: bool = False
    needs_data: bool = False
    seeded_start: bool = True
    demo_kwargs: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "default_kwargs", MappingProxyType(dict(self.default_kwargs)))
        object.__setattr__(self, "demo_kwargs", MappingProxyType(dict(self.demo_kwargs)))


ENVIRONMENTS: Registry[EnvSpec] = Registry("environment")


def register_env(name: str, spec: EnvSpec) -> EnvSpec:
    """Add ``spec`` under ``name`` (refuses duplicates)."""
    return ENVIRONMENTS.register(name)(spec)


def env_spec(name: str) -> EnvSpec:
    """The spec registered as ``name`` (the one lookup; KeyError names the known tags)."""
    return ENVIRONMENTS.get(name)


def make_env(name: str, **kwargs: Any) -> TextEnv:
    """Build the environment registered as ``name`` with its default kwargs overridden by ``kwargs``."""
    spec = env_spec(name)
    merged = {**spec.default_kwargs, **kwargs}
    try:
        return spec.env_class(**merged)
    except TypeError as exc:
        raise ConfigError(f"environment '{name}': bad env_config ({exc}); allowed keys are the parameters of "
                          f"{spec.env_class.__name__}.__init__") from None


def make_demo_env(name: str, **kwargs: Any) -> TextEnv:
    """Like :func:`make_env`, with the spec's ``demo_kwargs`` (e.g. an inline dataset) filled in first."""
    spec = env_spec(name)
    return make_env(name, **{**spec.demo_kwargs, **kwargs})


def restore_env(state: str, **overrides: Any) -> TextEnv:
    """Rebuild any environment from its ``get_state()`` string (the class is named in the state)."""
    return TextEnv.restore(state, **overrides)


def preview(name: str, seed: int = 0, **kwargs: Any) -> str:
    """Text view of a fresh episode (what ``rollflow show`` prints): instruction, a blank line, the observation."""
    env = make_demo_env(name, **kwargs)
    observation, info = env.reset(seed)
    return f"{info['env_instruction']}\n\n{observation}"
