"""One migrated Prefect database for every Prefect home the tests start a server in.

A Prefect server on a new home first creates and migrates its SQLite database: 8-10 CPU-s of its start on two cores,
against about 4.8 CPU-s from a copy of a migrated one (a user's later runs find their home so). The test run migrates
one database — a server started and stopped once in a template home, by the first test process that asks, under a
file lock — and each new home (the workers' shared server's, a worker's ephemeral one, a ``rollflow`` child's) starts
from a copy of it. The template's folder is made by the pytest process that starts the run (``ENV`` names it for the
workers and the children); without it, a home is left as it is and its server migrates its own database.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import warnings
from pathlib import Path
from unittest import mock

ENV = "ROLLFLOW_TEST_PREFECT_TEMPLATE"
DB = "prefect.db"  # Prefect's default database file in its home (sqlite+aiosqlite:///$PREFECT_HOME/prefect.db)
READY, FAILED = "ready", "failed"


def seeded(home: Path) -> Path:
    """``home``, made if missing, with a copy of the template's database unless it holds a database already. A
    template that could not be built is a warning, not an error: each home's server then migrates its own."""
    home.mkdir(parents=True, exist_ok=True)
    folder = os.environ.get(ENV)
    if folder and not (home / DB).exists():
        template = _template(Path(folder))
        if template is not None:
            _copy(template, home / DB)
    return home


def _template(folder: Path) -> Path | None:
    """The template's database, built on the first call of the run (the others wait for it on the lock); None, with
    a warning naming why, when its build failed (tried once a run)."""
    home, failed = folder / "home", folder / FAILED
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / READY).exists() and not failed.exists():
            try:
                _build(home)
                (folder / READY).touch()
            except Exception as err:  # noqa: BLE001 - the servers then migrate their own databases
                failed.write_text(f"{type(err).__name__}: {err}")
    if failed.exists():
        warnings.warn(f"tests/prefect_template.py: no migrated Prefect database for the tests' homes, each server "
                      f"migrates its own ({failed.read_text()[:500]})", stacklevel=2)
        return None
    return home / DB


def _build(home: Path) -> None:
    """Start a Prefect server on ``home`` (migrations and block registration) and stop it. Its memo store is its
    own, so that the blocks are registered into this database whatever memo store the later servers read."""
    from flows.serving import start_server
    from stages.ports import free_port

    shutil.rmtree(home, ignore_errors=True)  # a build that died half-way
    with mock.patch.dict(os.environ, {"PREFECT_SERVER_MEMO_STORE_PATH": str(home / "memo_store.toml")}):
        server = start_server("127.0.0.1", free_port(), home, timeout_s=300)
    server.stop()


def _copy(source: Path, target: Path) -> None:
    """SQLite's online backup of ``source`` into ``target`` (consistent whatever its write-ahead log holds)."""
    with sqlite3.connect(source) as src, sqlite3.connect(target) as dst:
        src.backup(dst)
    src.close()
    dst.close()
