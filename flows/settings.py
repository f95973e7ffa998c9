"""Process-wide settings for flows, set in one place before Prefect is imported, and logged."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("rollflow")
REPO = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLFLOW_CACHE", REPO / ".cache"))


def configure() -> dict[str, str]:
    """Environment for Prefect, Ray, tokenizers and torch threads. Without ``PREFECT_API_URL`` Prefect runs in its
    ephemeral local mode with its database under the project's cache; with it, flows report to that server."""
    defaults = {
        "PREFECT_HOME": str(cache_dir() / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", "WARNING"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONHASHSEED": "0",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    settings = {k: os.environ[k] for k in defaults} | {"PREFECT_API_URL": os.environ.get("PREFECT_API_URL", "(ephemeral)")}
    log.info("process settings: %s", settings)
    return settings
