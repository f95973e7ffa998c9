"""Process-wide settings for flows, set in one place before Prefect is imported, and logged."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from schemas.errors import RollflowError

log = logging.getLogger("rollflow")
REPO = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLFLOW_CACHE", REPO / ".cache"))


class UserErrorWithoutTraceback(logging.Filter):
    """Prefect logs a failed task or flow with the full traceback; for a rollflow user error (bad input or config,
    ``RollflowError``) the one-line message says everything, and the CLI prints it once more with the fix."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], RollflowError):
            record.exc_info, record.exc_text = None, None
        return True


def configure() -> dict[str, str]:
    """Environment for Prefect, Ray, tokenizers and torch threads. Without ``PREFECT_API_URL`` Prefect runs in its
    ephemeral local mode with its database under the project's cache; with it, flows report to that server."""
    defaults = {
        "PREFECT_HOME": str(cache_dir() / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Prefect 3.7's client telemetry is off only with DO_NOT_TRACK; without it Prefect prints a notice about it
        # on the first run in a terminal
        "DO_NOT_TRACK": "1",
        # the ephemeral server's first start runs the database migrations: Prefect's 20 s default is too short on
        # a loaded 2-core machine ("Timed out while attempting to connect to ephemeral Prefect API server")
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        # Prefect's flow and task run records go to the command's log file, not the console (flows/console.py)
        "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", "INFO"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONHASHSEED": "0",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # Prefect 3.7 puts the memo store under ~/.prefect whatever PREFECT_HOME says (its server settings do not see the
    # home setting), and its server warns on the console when ~/.prefect does not exist
    os.environ.setdefault("PREFECT_SERVER_MEMO_STORE_PATH", str(Path(os.environ["PREFECT_HOME"]) / "memo_store.toml"))
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        if not any(isinstance(f, UserErrorWithoutTraceback) for f in logging.getLogger(name).filters):
            logging.getLogger(name).addFilter(UserErrorWithoutTraceback())
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    settings = {k: os.environ[k] for k in defaults} | {"PREFECT_API_URL": os.environ.get("PREFECT_API_URL", "(ephemeral)")}
    log.info("process settings: %s", settings)
    return settings
