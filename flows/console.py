"""What a ``rollflow`` command shows on the console, and where everything else goes.

The console shows rollflow's own lines: its progress lines (stdout), its warnings and errors, and on a terminal a
progress bar for long work (:mod:`stages.progress`). Every log record of this process — rollflow's and the libraries'
(Ray, Ray Data, Prefect, Python warnings) — goes to a log file: the run folder's
``logs/rollflow.log`` for ``rollflow train``, else ``<cache>/logs/<command>.log``. ``--verbose`` shows the libraries'
records on the console as well (INFO and up). What Ray's workers print (the engines' vLLM, the training workers'
DeepSpeed) stays in Ray's session logs (``log_to_driver`` is off, stages/cluster.py).

Ray's own loggers print to stderr by themselves; :func:`stages.cluster.ensure_ray` hands them to the root logger,
whose handlers are set here.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from flows import settings

OURS = ("rollflow", "flows", "stages", "schemas", "__main__")  # logger names of rollflow's own records
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# libraries that log every request or every file at INFO: kept at WARNING even in the log file
CHATTY = ("httpx", "httpcore", "urllib3", "asyncio", "aiosqlite", "filelock", "fsspec")


def ours(name: str) -> bool:
    return any(name == n or name.startswith(n + ".") for n in OURS)


class ConsoleFilter(logging.Filter):
    """Quiet: rollflow's warnings and errors only. Verbose: every record at INFO and up. Records marked
    ``hide`` (a library's message that does not apply to rollflow, see :mod:`stages.cluster`) stay in the file."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "hide", False):
            return False
        return self.verbose or (ours(record.name) and record.levelno >= logging.WARNING)


class ConsoleHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record comes (Typer's test runner swaps it per command)."""

    def __init__(self, verbose: bool) -> None:
        logging.Handler.__init__(self, logging.INFO)
        self.addFilter(ConsoleFilter(verbose))
        self.setFormatter(logging.Formatter(LOG_FORMAT if verbose else "%(levelname)s: %(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


class LogFileHandler(logging.FileHandler):
    """The command's log file. Opened for appending even when it starts empty: Prefect's logging set-up (on import)
    closes every existing handler, and a closed handler of mode "w" drops its records, one of mode "a" reopens."""

    def __init__(self, path: Path, append: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            path.write_text("")
        super().__init__(path, mode="a", encoding="utf-8", delay=True)
        self.setLevel(logging.INFO)
        self.setFormatter(logging.Formatter(LOG_FORMAT))


_state: dict = {"log": None}


def setup(verbose: bool, command: str | None) -> None:
    """Route the process's logging for one ``rollflow`` command (idempotent: a second call replaces the handlers
    of the first). The log file is ``<cache>/logs/<command>.log`` (the command's last run) until :func:`log_to`
    names another."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, (ConsoleHandler, LogFileHandler)) or type(handler).__name__ == "PrefectConsoleHandler":
            root.removeHandler(handler)
            if isinstance(handler, LogFileHandler):
                handler.close()
    root.setLevel(logging.INFO)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.captureWarnings(True)  # a library's warnings.warn(...) goes to the "py.warnings" logger, i.e. the file
    root.addHandler(ConsoleHandler(verbose))
    _state["log"] = None
    log_to(settings.cache_dir() / "logs" / f"{command or 'rollflow'}.log", append=False)


def log_to(path: str | Path, append: bool = True) -> Path:
    """Send the log records to ``path`` (appended, or from scratch) from now on; returns the path."""
    path = Path(path).absolute()
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, LogFileHandler):
            root.removeHandler(handler)
            handler.close()
    root.addHandler(LogFileHandler(path, append))
    _state["log"] = path
    logging.getLogger("rollflow").info("rollflow %s", " ".join(sys.argv[1:]))
    return path


def log_path() -> Path | None:
    """The current log file (None before :func:`setup`)."""
    return _state["log"]
