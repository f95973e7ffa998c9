"""Shared helpers for the reward tests: the shipped data sets and a sandbox-mode guard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "rlvr"


def load_rows(name: str) -> list[dict]:
    """Rows of ``data/rlvr/<name>.jsonl``."""
    with open(DATA_DIR / f"{name}.jsonl") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def columns(rows: list[dict], **overrides: list) -> dict[str, list]:
    """Row dicts → column dict (keys of the first row), with some columns replaced."""
    out = {key: [row[key] for row in rows] for key in rows[0]}
    out.update(overrides)
    return out


@pytest.fixture(scope="session")
def namespace_sandbox():
    """The default sandbox; skips when this machine cannot give it namespace isolation (non-root)."""
    from stages.rewards.sandbox import default_sandbox

    sandbox = default_sandbox()
    if sandbox.info().mode != "namespaces":
        pytest.skip("sandbox namespace mode unavailable here (needs root with CAP_SYS_ADMIN); "
                    f"running in {sandbox.info().mode} mode")
    return sandbox
