"""The text-environment contract every registered environment follows (Gymnasium-style, DESIGN.md; spec §9, §11).

``reset(seed) -> (observation: str, info)`` with ``info["env_instruction"]``;
``step(action_text: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info)`` with
``info["metrics"]`` (``action_is_valid``, ``action_is_effective``, ``success``, ``format_penalty``),
``info["metrics_agg_mode"]``, ``info["action_desc"]`` and the parser's ``action``/``action_content``/``think_content``.

Stepping is stateless in the dataflow: each turn is a table row holding ``env.get_state()`` (compact, deterministic
JSON). ``TextEnv.restore(state)`` rebuilds the env (any registered class, found by name) and the restored env steps
exactly like the live one, RNG included. Unparseable or illegal model output never raises: it gets the configured
``format_penalty``, recorded in ``info["metrics"]["format_penalty"]``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import secrets
import threading
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Mapping

from schemas.errors import ConfigError, RollflowError

STATE_VERSION = 1

# ROLL's aggregation of per-step env metrics over a trajectory (spec §9.1).
METRICS_AGG_MODE: Mapping[str, str] = {
    "action_is_effective": "mean",
    "action_is_valid": "mean",
    "success": "last",
    "format_penalty": "mean",
}


class EnvStateError(RollflowError):
    """An environment was used out of order (step before reset) or handed a state string it cannot read."""


def dumps_compact(obj: Any) -> str:
    """Deterministic compact JSON: sorted keys, no spaces."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def jsonable(value: Any) -> Any:
    """``value`` with tuples as lists and mapping keys as strings (what a JSON round trip gives back)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def check_seed(seed: Any, where: str, upper: int | None = None) -> int | None:
    """``seed`` as a non-negative Python int (numpy ints accepted), or ``None``. Raises ``ConfigError`` otherwise."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise ConfigError(f"{where}: seed must be a non-negative integer or None, got {seed!r} "
                          f"({type(seed).__name__}); pass an int")
    value = int(seed.__index__())
    if value < 0 or (upper is not None and value >= upper):
        bound = f" and < {upper}" if upper is not None else ""
        raise ConfigError(f"{where}: seed must be >= 0{bound}, got {value}; pass a seed in range")
    return value


def fresh_seed() -> int:
    """A seed from OS entropy, for ``reset(seed=None)``; the env then stays deterministic from that seed on."""
    return secrets.randbits(32)


def retry_seed(seed: int, roll_compat: bool = False) -> int:
    """The seed a failed level generation retries with (spec §9.1/§9.2, Q-16 fixed).

    ROLL uses ``abs(hash(str(seed))) % 2**32``, which depends on ``PYTHONHASHSEED``. We use the first 4 bytes of
    SHA-256 of ``str(seed)`` (big-endian), identical in every process. ``roll_compat=True`` reproduces ROLL (and so
    matches ROLL's levels only in a process started with the same ``PYTHONHASHSEED``).
    """
    if roll_compat:
        return abs(hash(str(seed))) % (2**32)
    return int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:4], "big")


def step_info(parsed_info: Mapping[str, Any], *, valid: bool, effective: bool, success: bool,
              format_penalty: float, action_desc: str) -> dict:
    """The ``info`` dict of one step, in ROLL's layout (metrics, agg modes, action_desc, parser fields)."""
    info = {
        "metrics": {
            "action_is_effective": bool(effective),
            "action_is_valid": bool(valid),
            "success": bool(success),
            "format_penalty": float(format_penalty),
        },
        "metrics_agg_mode": dict(METRICS_AGG_MODE),
        "action_desc": action_desc,
    }
    info.update(parsed_info)
    return info


def int_keyed(mapping: Mapping | None, where: str) -> dict[int, str] | None:
    """A lookup ``id -> name`` with int keys (YAML and JSON may hand them over as strings)."""
    if mapping is None:
        return None
    try:
        return {int(k): str(v) for k, v in mapping.items()}
    except (TypeError, ValueError, AttributeError):
        raise ConfigError(f"{where}: expected a mapping of integer ids to names, got {mapping!r}; "
                          "write it as {0: 'Left', 1: 'Down', ...}") from None


class TextEnv(ABC):
    """Base class of every text environment. Subclasses implement the abstract methods; see the module docstring.

    ``self.config`` holds the JSON-able constructor arguments (what ``get_state`` stores so ``restore`` can rebuild
    the env); ``self.format_penalty`` and ``self.max_steps`` are read by the contract test and the env managers.
    """

    _classes: ClassVar[dict[str, type["TextEnv"]]] = {}
    format_penalty: float
    max_steps: int
    config: dict

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        TextEnv._classes[cls.__name__] = cls

    # ---- the Gymnasium contract ----------------------------------------------------------------------------------
    @abstractmethod
    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        """Start an episode; same seed → same level, same observation. ``info["env_instruction"]`` is set."""

    @abstractmethod
    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict]:
        """Apply one model response. Never raises on any string."""

    @abstractmethod
    def render(self) -> str:
        """The current observation text (what ``rollflow show`` prints)."""

    @abstractmethod
    def get_instructions(self) -> str:
        """The env instruction shown once before the first observation (``info["env_instruction"]``)."""

    def close(self) -> None:
        """Release resources (none for the pure envs)."""

    def action_names(self) -> tuple[str, ...]:
        """The env's discrete actions in its own order (its ``action_lookup``), or ``()`` for free-text envs."""
        lookup = getattr(self, "action_lookup", None)
        return tuple(lookup.values()) if isinstance(lookup, Mapping) else ()

    # ---- stateless stepping --------------------------------------------------------------------------------------
    @abstractmethod
    def _dynamic_state(self) -> dict:
        """Everything that changes during an episode, JSON-able."""

    @abstractmethod
    def _load_dynamic_state(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`_dynamic_state`."""

    def _set_config(self, values: Mapping[str, Any]) -> None:
        """Record the constructor arguments that differ from the defaults (JSON-normalised) as ``self.config``."""
        defaults = type(self)._init_defaults()
        config = {}
        for key, value in values.items():
            value = jsonable(value)
            if key not in defaults or defaults[key] != value:
                config[key] = value
        self.config = config
        self._config_json = dumps_compact(config)

    @classmethod
    def _init_defaults(cls) -> dict[str, Any]:
        cached = cls.__dict__.get("_init_defaults_cache")
        if cached is None:
            params = inspect.signature(cls.__init__).parameters.values()
            cached = {p.name: jsonable(p.default) for p in params if p.default is not inspect.Parameter.empty}
            setattr(cls, "_init_defaults_cache", cached)
        return cached

    def get_state(self) -> str:
        """Compact deterministic JSON: ``{"config", "env", "state", "v"}`` (keys sorted)."""
        if not self._started():
            raise EnvStateError(f"{type(self).__name__}.get_state() called before reset(seed); reset the env first")
        return ('{"config":' + self._config_json + ',"env":' + json.dumps(type(self).__name__)
                + ',"state":' + dumps_compact(self._dynamic_state()) + ',"v":' + str(STATE_VERSION) + "}")

    def set_state(self, state: str) -> None:
        """Load the dynamic part of ``state`` (from :meth:`get_state` of an env of the same class) into this env."""
        payload = _parse_state(state)
        if payload["env"] != type(self).__name__:
            raise EnvStateError(f"state belongs to environment class '{payload['env']}', not "
                                f"'{type(self).__name__}'; restore it with TextEnv.restore(state)")
        self._load_dynamic_state(payload["state"])

    @classmethod
    def restore(cls, state: str, **overrides: Any) -> "TextEnv":
        """Rebuild an env from :meth:`get_state`. Called on ``TextEnv`` it finds the class by name.

        ``overrides`` replace or supply constructor arguments that the state does not carry (e.g. a dataset).
        Without overrides the constructed env is cached per (class, config) and copied: subclasses never mutate the
        attributes set by ``__init__`` after construction, and ``_load_dynamic_state`` sets every episode attribute.
        """
        payload = _parse_state(state)
        name = payload["env"]
        target = TextEnv._classes.get(name)
        if target is None:
            raise EnvStateError(f"state names environment class '{name}', which is not loaded; known: "
                                f"{', '.join(sorted(TextEnv._classes))}")
        if cls is not TextEnv and not issubclass(target, cls):
            raise EnvStateError(f"state belongs to '{name}', not '{cls.__name__}'; use TextEnv.restore(state)")
        if overrides:
            env = target(**{**payload["config"], **overrides})
        else:
            env = object.__new__(target)
            env.__dict__.update(_prototype(target, payload["config"]).__dict__)
        env._load_dynamic_state(payload["state"])
        return env

    def _started(self) -> bool:
        return True


_PROTOTYPES = threading.local()
_MAX_PROTOTYPES = 256


def _prototype(target: type[TextEnv], config: dict) -> TextEnv:
    """A never-started env of ``target`` built from ``config``, cached per thread."""
    cache = getattr(_PROTOTYPES, "cache", None)
    if cache is None:
        cache = _PROTOTYPES.cache = {}
    key = (target.__name__, dumps_compact(config))
    proto = cache.get(key)
    if proto is None:
        if len(cache) >= _MAX_PROTOTYPES:
            cache.pop(next(iter(cache)))
        proto = cache[key] = target(**config)
    return proto


def _parse_state(state: str) -> dict:
    try:
        payload = json.loads(state)
    except (TypeError, ValueError) as exc:
        raise EnvStateError(f"environment state is not valid JSON ({exc}); pass the string get_state() returned") \
            from None
    if not isinstance(payload, dict) or not {"config", "env", "state", "v"} <= payload.keys():
        raise EnvStateError("environment state lacks one of the keys config/env/state/v; pass the string "
                            "get_state() returned")
    if payload["v"] != STATE_VERSION:
        raise EnvStateError(f"environment state has version {payload['v']}, this rollflow reads version "
                            f"{STATE_VERSION}; re-run the rollout that produced it")
    return payload
