"""The reward-worker registry and its one lookup site, :func:`resolve_worker` (DESIGN.md "Variants").

A worker spec in a config is either a registered name (``math_rule``, ``code_sandbox``, ...) or ``"module:name"``
naming a class or a function in any importable module (a custom worker, docs/custom-reward-worker.md). Entries are
classes whose instances have ``score_batch``; capabilities are class attributes (``columns``, ``requires``).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping

from schemas.errors import ConfigError
from stages.registry import Registry
from stages.rewards.base import FunctionWorker, RewardWorker

REWARD_WORKERS: Registry[type] = Registry("reward worker")


def _import_object(spec: str) -> Any:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"reward worker '{spec}': a custom worker is written 'module:name' (e.g. "
                          "'stages.rewards.examples.length_reward:LengthReward')")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"reward worker '{spec}': cannot import module '{module_name}' ({error}); put it on "
                          "PYTHONPATH or fix the module name") from None
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"reward worker '{spec}': module '{module_name}' has no attribute '{attr_path}'")
        target = getattr(target, part)
    return target


def resolve_worker(spec: str) -> type | Callable[..., Any]:
    """A registered name or ``"module:name"`` → the worker class or function. The one lookup site."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"reward worker spec must be a non-empty string, got {spec!r}")
    if ":" in spec:
        entry = _import_object(spec)
        if not callable(entry):
            raise ConfigError(f"reward worker '{spec}' is a {type(entry).__name__}, not a class or function")
        return entry
    if spec not in REWARD_WORKERS:
        raise ConfigError(f"unknown reward worker '{spec}'; registered: {', '.join(REWARD_WORKERS.names())}; or "
                          "name a custom one as 'module:name'")
    return REWARD_WORKERS.get(spec)


def required_services(entry: Any) -> tuple[str, ...]:
    """The run-time services a worker class or function takes (``("generate",)`` for a judge)."""
    if isinstance(entry, type):
        return tuple(getattr(entry, "requires", ()))
    names = inspect.signature(entry).parameters
    return tuple(name for name in ("generate",) if name in names)


def run_context(entry: Any) -> tuple[str, ...]:
    """The run-time values a worker class reads when the stage knows them (``("training_progress",)`` for the
    detection worker's dynamic IoU threshold); unlike services they are optional (a worker has a default)."""
    return tuple(getattr(entry, "context", ())) if isinstance(entry, type) else ()


def build_worker(spec: str, kwargs: Mapping[str, Any] | None = None,
                 services: Mapping[str, Any] | None = None, context: Mapping[str, Any] | None = None) -> RewardWorker:
    """Instantiate the worker named by ``spec`` with its config ``kwargs``, the run-time ``services`` it requires
    (``generate`` for judges) and the run-time ``context`` values it reads (:func:`run_context`; a value set in the
    config's kwargs wins). A function becomes a :class:`FunctionWorker`."""
    entry = resolve_worker(spec)
    kwargs = dict(kwargs or {})
    services = dict(services or {})
    for name in run_context(entry):
        if name in (context or {}) and name not in kwargs:
            kwargs[name] = context[name]
    for name in required_services(entry):
        if name in kwargs:
            raise ConfigError(f"reward worker '{spec}': '{name}' is a run-time service given by the stage, not a "
                              "config value; remove it from the worker kwargs")
        if name not in services:
            raise ConfigError(f"reward worker '{spec}' needs the '{name}' service (a callable the reward stage "
                              f"injects); run it through a stage that provides '{name}'")
        kwargs[name] = services[name]
    try:
        if isinstance(entry, type):
            worker = entry(**kwargs)
        else:
            inspect.signature(entry).bind({}, **kwargs)
            worker = FunctionWorker(entry, spec, kwargs)
    except TypeError as error:
        raise ConfigError(f"reward worker '{spec}': bad kwargs {sorted(kwargs)} ({error}); see the worker's "
                          "docstring for its parameters") from None
    if not callable(getattr(worker, "score_batch", None)):
        raise ConfigError(f"reward worker '{spec}': {type(worker).__name__} has no score_batch(rows) method")
    return worker
