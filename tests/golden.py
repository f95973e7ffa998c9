"""Access to ROLL's golden vectors in ``../shared/spec/golden`` (see its README for layout and tolerances)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

GOLDEN_DIR = Path(os.environ.get("ROLLFLOW_GOLDEN_DIR", Path(__file__).resolve().parents[2] / "shared/spec/golden"))


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


@lru_cache(maxsize=1)
def manifest() -> dict[str, dict]:
    path = GOLDEN_DIR / "manifest.json"
    if not path.exists():
        return {}
    return {c["case"]: c for c in json.loads(path.read_text())["cases"]}


def case_names(prefix: str) -> list[str]:
    """Names of all golden cases starting with ``prefix`` (empty if the golden folder is absent)."""
    return sorted(n for n in manifest() if n.startswith(prefix))


def load(name: str) -> GoldenCase:
    if not manifest():
        pytest.skip(f"golden vectors not found at {GOLDEN_DIR}")
    meta = manifest()[name]
    data = np.load(GOLDEN_DIR / meta["file"], allow_pickle=False)
    inputs = {k[4:]: data[k] for k in data.files if k.startswith("in__")}
    outputs = {k[5:]: data[k] for k in data.files if k.startswith("out__")}
    return GoldenCase(name, meta["roll_function"], meta.get("params", {}), inputs, outputs, meta)


def assert_close(actual, expected, *, atol: float = 1e-6, rtol: float = 1e-5, what: str = "") -> None:
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64),
                               rtol=rtol, atol=atol, equal_nan=True, err_msg=what)
