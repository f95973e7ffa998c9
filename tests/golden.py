"""Access to ROLL's golden vectors, shipped in ``tests/golden_vectors`` (a copy of the public subset in the spec's
``shared/spec/golden`` beside the repository; see its README for layout and tolerances). A fresh clone runs every
conformance test with nothing beside it; a missing vector or manifest is a failure, never a skip.

Families: a golden *family* is every case of one ROLL function (the manifest's ``roll_function``). Conformance tests
are parametrised over a whole family (:func:`family`), never over the case names that happen to be in the folder,
and every entry of a case's ``params`` must be honoured: :meth:`GoldenCase.check_params` fails loudly on a key the
test does not know.

Tolerances: the README's ``rtol=1e-5, atol=1e-6`` (plain float32 outputs) and ``atol=1e-4`` (whitened or normalised
values, losses, gradients) are floors. A float32 result that cancels large intermediates (an entropy of 0.05 from a
log-sum-exp of 7, a reward-to-go from a long row) carries a rounding error of a few ulp *of the intermediate*, which
differs between CPUs (AVX2 vs AVX-512 kernels sum in a different order). :func:`assert_close` therefore widens the
absolute tolerance to ``ulps · eps32 · |scale|`` where the caller passes ``scale``, the magnitude of the largest
intermediate (per element or overall).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable

import numpy as np
import pytest

GOLDEN_DIR = Path(os.environ.get("ROLLFLOW_GOLDEN_DIR", Path(__file__).resolve().parent / "golden_vectors"))
EPS32 = float(np.finfo(np.float32).eps)
ULPS = 8


@dataclass(frozen=True)
class GoldenCase:
    name: str
    function: str
    params: dict
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    meta: dict

    def metric(self, name: str) -> float:
        """A scalar metric output, by ROLL's metric name (``critic/kl``)."""
        return float(self.outputs["metric:" + name.replace("/", "|")])

    def metrics(self) -> dict[str, float]:
        """Every metric output of the case under ROLL's names (``actor/pg_loss@sum``)."""
        return {k[len("metric:"):].replace("|", "/"): float(v) for k, v in self.outputs.items()
                if k.startswith("metric:")}

    def check_params(self, known: Iterable[str]) -> dict:
        """The case's params, after failing loudly if one of them is not among the ``known`` keys the calling test
        dispatches to an option of our implementation (a silently ignored parameter would make the test pass for
        the wrong reason)."""
        known = set(known)
        unknown = sorted(set(self.params) - known)
        if unknown:
            pytest.fail(f"golden case {self.name} ({self.function}): params {unknown} are not honoured by this test "
                        f"(it knows {sorted(known)}); map them to the corresponding option of our implementation",
                        pytrace=False)
        return self.params


class GoldenMissing(AssertionError):
    """The golden vectors (or one of them) are not where the repository keeps them."""


@lru_cache(maxsize=1)
def _manifest_file() -> dict:
    path = GOLDEN_DIR / "manifest.json"
    if not path.is_file():
        raise GoldenMissing(f"golden manifest {path} is missing: the repository ships ROLL's golden vectors in "
                            f"tests/golden_vectors; restore them (git checkout -- tests/golden_vectors) or point "
                            f"ROLLFLOW_GOLDEN_DIR at a copy")
    return json.loads(path.read_text())


def manifest() -> dict[str, dict]:
    """Case name → manifest entry (raises :class:`GoldenMissing` if the golden folder is absent)."""
    return {c["case"]: c for c in _manifest_file().get("cases", [])}


def generated_with() -> dict:
    """The manifest's ``generated_with`` block (versions, ``PYTHONHASHSEED_for_env_cases``)."""
    return dict(_manifest_file().get("generated_with", {}))


def case_names(prefix: str) -> list[str]:
    """Names of all golden cases starting with ``prefix``."""
    return sorted(n for n in manifest() if n.startswith(prefix))


def family(*functions: str) -> list[str]:
    """Names of all golden cases of the given ROLL functions (the manifest's ``roll_function``, exact), sorted."""
    return sorted(n for n, c in manifest().items() if c["roll_function"] in functions)


def family_where(test, *functions: str) -> list[str]:
    """Cases of a family whose loaded case satisfies ``test(case)`` (selection by params / inputs, not by name)."""
    return [n for n in family(*functions) if test(load(n))]


def load(name: str) -> GoldenCase:
    meta = manifest()[name]
    if not (GOLDEN_DIR / meta["file"]).is_file():
        raise GoldenMissing(f"golden vector {GOLDEN_DIR / meta['file']} (case {name}) is missing; restore "
                            f"tests/golden_vectors from git")
    with np.load(GOLDEN_DIR / meta["file"], allow_pickle=False) as data:
        inputs = {k[4:]: data[k] for k in data.files if k.startswith("in__")}
        outputs = {k[5:]: data[k] for k in data.files if k.startswith("out__")}
    return GoldenCase(name, meta["roll_function"], meta.get("params", {}), inputs, outputs, meta)


# ---- tolerances ---------------------------------------------------------------------------------------------------
def magnitude(*arrays) -> float:
    """max |x| over all given arrays / scalars (0 for empty ones)."""
    out = 0.0
    for a in arrays:
        a = np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64)
        if a.size:
            out = max(out, float(np.nanmax(np.abs(a))))
    return out


def float32_tol(*magnitudes, ulps: int = ULPS) -> float:
    """``ulps`` float32 ulps of the largest of ``magnitudes`` (scalars or arrays): the rounding error of a float32
    result whose largest intermediate has that magnitude."""
    return ulps * EPS32 * magnitude(*magnitudes)


def assert_close(actual, expected, *, atol: float = 1e-6, rtol: float = 1e-5, scale=None, ulps: int = ULPS,
                 what: str = "") -> None:
    """``|actual − expected| ≤ atol' + rtol·|expected|`` with NaN positions matching, where
    ``atol' = max(atol, ulps · eps32 · |scale|)`` elementwise: ``scale`` is the magnitude of the largest float32
    intermediate of each element (an array broadcastable to the values, or one number), ``atol`` the floor."""
    a = np.asarray(actual.detach().cpu() if hasattr(actual, "detach") else actual, dtype=np.float64)
    e = np.asarray(expected.detach().cpu() if hasattr(expected, "detach") else expected, dtype=np.float64)
    tol = np.asarray(atol, dtype=np.float64)
    if scale is not None:
        s = np.abs(np.asarray(scale.detach().cpu() if hasattr(scale, "detach") else scale, dtype=np.float64))
        tol = np.maximum(tol, ulps * EPS32 * s)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} != expected {e.shape}")
    tol = np.broadcast_to(tol, e.shape)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    if not np.array_equal(nan_a, nan_e):
        raise AssertionError(f"{what}: NaN positions differ (actual {np.argwhere(nan_a)[:5].tolist()}, expected "
                             f"{np.argwhere(nan_e)[:5].tolist()})")
    ok = nan_e | (np.abs(a - e) <= tol + rtol * np.abs(e)) | (a == e)
    if not ok.all():
        bad = np.argwhere(~ok)
        idx = tuple(bad[0])
        worst = np.abs(a - e)[~ok].max()
        raise AssertionError(
            f"{what}: {len(bad)} / {e.size} elements differ beyond atol={float(np.max(tol[~ok])):.3g} "
            f"(floor {atol:g}, scale-derived where given), rtol={rtol:g}; first at {list(map(int, idx))}: "
            f"actual {a[idx]!r} vs expected {e[idx]!r}; max |diff| {worst:.3g}")


def softmax_scale(logits) -> np.ndarray:
    """Per position (all axes but the last), the largest intermediate of a float32 log-softmax / entropy over the
    last axis: max(max_v |z_v|, |logsumexp(z)|)."""
    z = np.asarray(logits, dtype=np.float64)
    top = z.max(axis=-1, keepdims=True)
    lse = (top + np.log(np.exp(z - top).sum(axis=-1, keepdims=True)))[..., 0]
    return np.maximum(np.abs(z).max(axis=-1), np.abs(lse))


def sum_scale(x, mask=None, axis=None) -> np.ndarray:
    """The largest partial sum of a float32 (masked) sum: Σ|x·m| (along ``axis``)."""
    x = np.abs(np.asarray(x, dtype=np.float64))
    m = np.ones_like(x) if mask is None else np.asarray(mask, dtype=np.float64)
    return (x * m).sum(axis=axis)


def mean_scale(x, mask=None, axis=None) -> np.ndarray:
    """The rounding scale of a float32 (masked) mean: Σ|x·m| / Σm (the partial sums' ulps, divided by the count)."""
    m = np.ones_like(np.asarray(x, dtype=np.float64)) if mask is None else np.asarray(mask, dtype=np.float64)
    return sum_scale(x, m, axis) / np.maximum(m.sum(axis=axis), 1.0)
