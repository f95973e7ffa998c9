"""The tests' Prefect homes start from the run's one migrated database (tests/prefect_template.py)."""

from __future__ import annotations

import os
import sqlite3

import pytest

from tests import prefect_template
from tests.prefect_template import DB, ENV, seeded


def _revision(db) -> str:
    with sqlite3.connect(db) as con:
        (revision,), = con.execute("select version_num from alembic_version").fetchall()
    con.close()
    return revision


def test_a_new_home_gets_the_migrated_database_and_a_home_with_one_keeps_its_own(tmp_path):
    """The run's template folder is in the environment; a new home gets a copy of its database (migrated: Alembic's
    revision and Prefect's tables are there, block types registered); a home that has a database keeps it."""
    assert os.environ.get(ENV), "the process that started the run names the template's folder (tests/conftest.py)"
    home = seeded(tmp_path / "new")
    with sqlite3.connect(home / DB) as con:
        tables = {name for (name,) in con.execute("select name from sqlite_master where type = 'table'")}
        block_types = con.execute("select count(*) from block_type").fetchone()[0]
    con.close()
    assert {"flow_run", "task_run", "deployment", "alembic_version"} <= tables
    assert block_types > 0, "the template's server registered Prefect's block types"
    template = os.path.join(os.environ[ENV], "home", DB)
    assert _revision(home / DB) == _revision(template)

    kept = tmp_path / "kept"
    kept.mkdir()
    with sqlite3.connect(kept / DB) as con:
        con.execute("create table mine (x)")
    con.close()
    seeded(kept)
    with sqlite3.connect(kept / DB) as con:
        assert [n for (n,) in con.execute("select name from sqlite_master where type = 'table'")] == ["mine"]
    con.close()


def test_a_template_that_cannot_be_built_leaves_the_homes_as_they_are_with_a_warning(tmp_path, monkeypatch):
    """A failed build (here: the server cannot start) is tried once a run; every home is then left for its server
    to migrate, with a warning naming why."""
    calls = []

    def refused(home):
        calls.append(home)
        raise RuntimeError("prefect server: port 1 is already in use")

    monkeypatch.setenv(ENV, str(tmp_path / "template"))
    (tmp_path / "template").mkdir()
    monkeypatch.setattr(prefect_template, "_build", refused)
    for name in ("a", "b"):
        with pytest.warns(UserWarning, match="each server migrates its own.*port 1 is already in use"):
            assert seeded(tmp_path / name) == tmp_path / name
        assert not (tmp_path / name / DB).exists()
    assert len(calls) == 1
