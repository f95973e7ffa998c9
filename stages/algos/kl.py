"""Per-token KL estimates and KL-coefficient controllers (spec ALGORITHMS.md §2.1, §2.2).

Controllers are tiny value objects whose whole state is a JSON-able dict (``state_dict()`` /
:func:`kl_controller_from_state`), so a stage can carry the coefficient from one iteration to the next in a manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from schemas.errors import ConfigError, InvariantError

K3_CLAMP = 10.0  # k3 estimator clamp to [−10, 10] (§0.3)


def _kl_plain(d: np.ndarray) -> np.ndarray:
    return d


def _kl_abs(d: np.ndarray) -> np.ndarray:
    return np.abs(d)


def _kl_mse(d: np.ndarray) -> np.ndarray:
    return 0.5 * d * d


def _kl_k3(d: np.ndarray) -> np.ndarray:
    k = -d  # k = lb − lp
    out = np.exp(k)
    out -= k
    out -= 1.0
    return np.clip(out, -K3_CLAMP, K3_CLAMP, out=out)


# kind → f(lp − lb); "full" is handled separately because it reduces over the vocabulary.
_ELEMENTWISE_KL: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "kl": _kl_plain, "abs": _kl_abs, "mse": _kl_mse, "k3": _kl_k3,
}
KL_KINDS = (*_ELEMENTWISE_KL, "full")


def approx_kl(log_probs: np.ndarray, log_probs_base: np.ndarray, kind: str = "kl",
              mask: np.ndarray | None = None) -> np.ndarray:
    """Per-token KL estimate of the policy against a base policy (§2.1), float32.

    ``kind`` in ``kl | abs | mse | k3``: ``log_probs``, ``log_probs_base`` are ``(N,)`` (any equal shape) log-probs of
    the sampled tokens. ``kind = full``: both are ``(N, V)`` full log-distributions and the result ``(N,)`` is the
    exact ``Σ_v exp(lp_v)(lp_v − lb_v)``. If ``mask`` (``(N,)``) is given the result is multiplied by it.
    """
    lp = np.asarray(log_probs, dtype=np.float64)
    lb = np.asarray(log_probs_base, dtype=np.float64)
    if lp.shape != lb.shape:
        raise InvariantError(f"approx_kl: log_probs shape {lp.shape} differs from log_probs_base shape {lb.shape}")
    if kind == "full":
        if lp.ndim < 2:
            raise InvariantError("approx_kl(kind='full') needs full log-distributions of shape (N, V)")
        kl = np.sum(np.exp(lp) * (lp - lb), axis=-1)
    elif kind in _ELEMENTWISE_KL:
        kl = _ELEMENTWISE_KL[kind](lp - lb)
    else:
        raise ConfigError(f"kl_penalty '{kind}' is not supported; use one of {', '.join(KL_KINDS)}")
    if mask is not None:
        m = np.asarray(mask, dtype=np.float64)
        if m.shape != kl.shape:
            raise InvariantError(f"approx_kl: mask shape {m.shape} differs from the KL shape {kl.shape}")
        kl *= m
    return kl.astype(np.float32)


# ---- §2.2 controllers ---------------------------------------------------------------------------------------------
@dataclass
class FixedKLController:
    """``value`` stays ``init_kl_coef`` forever."""

    value: float

    def update(self, current: float, n_steps: int) -> None:
        """No-op (the signature matches the adaptive controller)."""

    def state_dict(self) -> dict:
        return {"kind": "fixed", "value": float(self.value)}

    @classmethod
    def from_state(cls, state: dict) -> "FixedKLController":
        return cls(value=float(state["value"]))


@dataclass
class AdaptiveKLController:
    """Ziegler et al.: ``value ← value·(1 + clip(current/target − 1, ±0.2)·n_steps/horizon)``."""

    value: float
    target: float
    horizon: float

    def __post_init__(self) -> None:
        if not self.target > 0:
            raise ConfigError(f"target_kl must be > 0 for the adaptive KL controller (got {self.target}); "
                              "leave target_kl unset for a fixed coefficient")
        if not self.horizon > 0:
            raise ConfigError(f"kl_horizon must be > 0 (got {self.horizon}); ROLL's default is 10000")

    def update(self, current: float, n_steps: int) -> None:
        proportional_error = float(np.clip(float(current) / self.target - 1.0, -0.2, 0.2))
        self.value = float(self.value) * (1.0 + proportional_error * n_steps / self.horizon)

    def state_dict(self) -> dict:
        return {"kind": "adaptive", "value": float(self.value), "target": float(self.target),
                "horizon": float(self.horizon)}

    @classmethod
    def from_state(cls, state: dict) -> "AdaptiveKLController":
        return cls(value=float(state["value"]), target=float(state["target"]), horizon=float(state["horizon"]))


KLController = FixedKLController | AdaptiveKLController
_CONTROLLER_KINDS: dict[str, type] = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


def get_kl_controller(init_kl_coef: float, target_kl: float | None = None,
                      kl_horizon: float | None = None) -> KLController:
    """``target_kl is None`` → fixed coefficient, else adaptive (§2.2; ``kl_horizon`` defaults to 10000)."""
    if target_kl is None:
        return FixedKLController(float(init_kl_coef))
    horizon = 10000.0 if kl_horizon is None else float(kl_horizon)
    return AdaptiveKLController(float(init_kl_coef), float(target_kl), horizon)


def kl_controller_from_state(state: dict) -> KLController:
    """Rebuild a controller from its ``state_dict()``."""
    kind = state.get("kind")
    if kind not in _CONTROLLER_KINDS:
        raise ConfigError(f"KL controller state has kind {kind!r}; expected one of {sorted(_CONTROLLER_KINDS)}")
    return _CONTROLLER_KINDS[kind].from_state(state)
