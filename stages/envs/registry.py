"""The environment registry: tag → :class:`EnvSpec`; :func:`make_env` is the one lookup (DESIGN.md "Variants").

Tags follow ROLL's example configs (``custom_envs``): ``FrozenLake``, ``SimpleSokoban``, ``LargerSokoban``,
``SokobanDifferentGridVocab``; plus ``FrozenLakeSlippery`` and the single-turn ``GemMath`` / ``GemQA``. Another
module adds an environment with ``register_env(name, EnvSpec(...))`` (GEM games, WebShop); the contract test in
``tests/envs`` then covers it automatically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from schemas.errors import ConfigError
from stages.envs.base import TextEnv
from stages.envs.frozen_lake import FrozenLakeEnv
from stages.envs.single_turn import GemMathEnv, GemQAEnv
from stages.envs.sokoban import SokobanEnv
from stages.registry import Registry


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


def make_env(name: str, **kwargs: Any) -> TextEnv:
    """Build the environment registered as ``name`` with its default kwargs overridden by ``kwargs``."""
    spec = ENVIRONMENTS.get(name)
    merged = {**spec.default_kwargs, **kwargs}
    try:
        return spec.env_class(**merged)
    except TypeError as exc:
        raise ConfigError(f"environment '{name}': bad env_config ({exc}); allowed keys are the parameters of "
                          f"{spec.env_class.__name__}.__init__") from None


def make_demo_env(name: str, **kwargs: Any) -> TextEnv:
    """Like :func:`make_env`, with the spec's ``demo_kwargs`` (e.g. an inline dataset) filled in first."""
    spec = ENVIRONMENTS.get(name)
    return make_env(name, **{**spec.demo_kwargs, **kwargs})


def restore_env(state: str, **overrides: Any) -> TextEnv:
    """Rebuild any environment from its ``get_state()`` string (the class is named in the state)."""
    return TextEnv.restore(state, **overrides)


def preview(name: str, seed: int = 0, **kwargs: Any) -> str:
    """Text view of a fresh episode (what ``rollflow show`` prints): instruction, a blank line, the observation."""
    env = make_demo_env(name, **kwargs)
    observation, info = env.reset(seed)
    return f"{info['env_instruction']}\n\n{observation}"


# ---- built-in environments (spec §9; ROLL example configs) ----------------------------------------------------------
_ROLL_STEPS = 10  # max_actions_per_traj in ROLL's agentic example configs

register_env("FrozenLake", EnvSpec(
    FrozenLakeEnv, {"is_slippery": False, "max_steps": _ROLL_STEPS, "format_penalty": -0.01},
    ends_at_max_steps=False, description="4x4 FrozenLake, not slippery (ROLL example config)"))
register_env("FrozenLakeSlippery", EnvSpec(
    FrozenLakeEnv, {"is_slippery": True, "max_steps": _ROLL_STEPS, "format_penalty": -0.01},
    ends_at_max_steps=False, stochastic=True, description="4x4 FrozenLake, slippery (gymnasium 1/3 dynamics)"))
register_env("SimpleSokoban", EnvSpec(
    SokobanEnv, {"dim_room": (6, 6), "num_boxes": 1, "max_steps": _ROLL_STEPS, "format_penalty": -0.15},
    description="6x6 Sokoban, 1 box"))
register_env("LargerSokoban", EnvSpec(
    SokobanEnv, {"dim_room": (10, 10), "num_boxes": 2, "search_depth": 10, "max_steps": _ROLL_STEPS,
                 "format_penalty": -0.15},
    description="10x10 Sokoban, 2 boxes, search_depth 10"))
register_env("SokobanDifferentGridVocab", EnvSpec(
    SokobanEnv, {"dim_room": (6, 6), "num_boxes": 1, "search_depth": 30, "max_steps": _ROLL_STEPS,
                 "format_penalty": -0.15,
                 "grid_lookup": {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"},
                 "grid_vocab": {"W": "wall", ".": "empty", "G": "target", "C": "box on target", "B": "box",
                                "A": "player", "@": "player on target"}},
    description="6x6 Sokoban, 1 box, alternative symbols"))

_DEMO_MATH = ({"question": "What is 2 + 3?", "answer": "5"},
              {"question": "Compute 12 / 4.", "answer": "3"},
              {"question": "Simplify 6/8 to lowest terms.", "answer": "\\frac{3}{4}"})
_DEMO_QA = ({"question": "What is the capital of France?", "answer": "Paris"},
            {"question": "Which planet is known as the Red Planet?", "answer": ["Mars", "planet Mars"]})

register_env("GemMath", EnvSpec(
    GemMathEnv, {}, multi_turn=False, needs_data=True, demo_kwargs={"data": _DEMO_MATH},
    description="single-turn math, answer in \\boxed{}, reward 1/0 (data: data=[...] or data_path=.jsonl)"))
register_env("GemQA", EnvSpec(
    GemQAEnv, {}, multi_turn=False, needs_data=True, demo_kwargs={"data": _DEMO_QA},
    description="single-turn QA, answer in <answer></answer>, reward 1/0 (data: data=[...] or data_path=.jsonl)"))


# ---- environments defined in their own modules --------------------------------------------------------------------
from stages.envs.gem_adapter import register_gem_envs  # noqa: E402  (GEM; registers nothing without gem-llm)
from stages.envs.webshop import register_webshop_envs  # noqa: E402

register_gem_envs()
register_webshop_envs()
