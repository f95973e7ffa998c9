"""Environment of the RLVR stage tests (their local Ray cluster is tests/conftest.py's ray_cluster)."""

from __future__ import annotations

import os


os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
