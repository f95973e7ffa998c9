"""Fixtures of the flow-infrastructure tests. Prefect's home goes to a temporary folder before anything imports
Prefect, and a developer's ``PREFECT_API_URL`` is ignored: the server test starts its own server."""

from __future__ import annotations

import os
import tempfile

_PREFECT_HOME = tempfile.mkdtemp(prefix="rollflow-test-flows-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
