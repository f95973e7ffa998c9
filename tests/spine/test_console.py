"""A quiet console (flows/console.py): rollflow's own lines on the console, every log record in the command's log
file; Ray's loggers handed to the root logger (stages/cluster.py); progress bars only when enabled
(stages/progress.py)."""

from __future__ import annotations

import logging

from flows import console


def _record(name: str, level: int, msg: str = "m") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_quiet_console_shows_rollflow_warnings_only_and_verbose_shows_the_libraries():
    quiet, verbose = console.ConsoleFilter(False), console.ConsoleFilter(True)
    assert quiet.filter(_record("rollflow.train", logging.WARNING))
    assert quiet.filter(_record("stages.rewards.llm_judge", logging.ERROR))
    assert not quiet.filter(_record("rollflow.train", logging.INFO))
    for library in ("ray.data", "ray", "prefect.flow_runs", "py.warnings", "rollflowish"):
        assert not quiet.filter(_record(library, logging.ERROR)), library
        assert verbose.filter(_record(library, logging.INFO)), library
    hidden = _record("ray.data.dataset", logging.WARNING)
    hidden.hide = True
    assert not verbose.filter(hidden)


def test_every_record_goes_to_the_log_file_and_a_second_setup_replaces_the_handlers(tmp_path, monkeypatch):
    """(tests/conftest.py puts the root logger back afterwards.)"""
    monkeypatch.setenv("ROLLFLOW_CACHE", str(tmp_path / "cache"))
    root_logging = logging.getLogger()
    console.setup(False, "example")
    console.setup(False, "train")
    ours = [h for h in root_logging.handlers if isinstance(h, (console.ConsoleHandler, console.LogFileHandler))]
    assert len(ours) == 2 and console.log_path() == tmp_path / "cache" / "logs" / "train.log"
    log = console.log_to(tmp_path / "run" / "logs" / "rollflow.log")
    assert console.log_path() == log and len(root_logging.handlers) == len(set(root_logging.handlers))
    logging.getLogger("some.library").info("library detail")
    logging.getLogger("rollflow.test").warning("our warning")
    text = log.read_text()
    assert "INFO some.library: library detail" in text and "WARNING rollflow.test: our warning" in text


def test_the_log_file_keeps_its_records_after_prefect_closes_every_handler(tmp_path, monkeypatch):
    """Prefect's logging set-up (dictConfig, on import) closes all existing handlers; the command's log, started
    empty, must still get the records that follow."""
    monkeypatch.setenv("ROLLFLOW_CACHE", str(tmp_path / "cache"))
    console.setup(False, "recompute")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, console.LogFileHandler):
            handler.close()  # what logging.config.dictConfig does to existing handlers
    logging.getLogger("ray.data").warning("after the set-up")
    assert "after the set-up" in console.log_path().read_text()


def test_ray_loggers_propagate_without_console_handlers_and_the_spurious_cpu_warning_is_hidden():
    from stages.cluster import route_ray_logs

    route_ray_logs()
    route_ray_logs()  # idempotent
    for name in ("ray", "ray.data"):
        logger = logging.getLogger(name)
        assert logger.propagate, name
        assert not [h for h in logger.handlers
                    if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)], name
    dataset = logging.getLogger("ray.data.dataset")
    spurious = _record("ray.data.dataset", logging.WARNING, "Warning: The Ray cluster currently does not have any "
                                                            "available CPUs. The Dataset job will hang unless ...")
    other = _record("ray.data.dataset", logging.WARNING, "something else")
    assert dataset.filter(spurious) and spurious.hide
    assert dataset.filter(other) and not getattr(other, "hide", False)


def test_progress_bars_are_off_unless_enabled_and_late_counts_of_a_closed_bar_are_dropped():
    from stages import progress

    assert not progress.enabled()
    with progress.bar("train", "micro-batches") as ticker:
        assert ticker is None
    counter = progress._Counter()
    counter.reset(1, None)
    counter.add(1, 2)
    counter.set_total(1, 5)
    counter.reset(2, 3)
    counter.add(1, 4)  # from the closed bar 1
    counter.add(2, 1)
    assert counter.read() == (1, 3)


def test_the_raylets_messages_go_to_the_log_not_to_stdout(capsys, caplog):
    """Ray's driver prints the raylet's messages (worker start-up concurrency on a 2-CPU machine) to stdout even
    with log_to_driver off; after route_ray_logs they are records of the "ray.raylet" logger, other output is
    unchanged."""
    from ray._private import worker as ray_worker

    from stages.cluster import route_ray_logs

    route_ray_logs()
    message = "WARNING: 8 PYTHON worker processes have been started on node: x, which is 4x the maximum expected"
    with caplog.at_level(logging.WARNING, logger="ray.raylet"):
        ray_worker.print_to_stdstream({"lines": [message], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert message not in capsys.readouterr().out
    assert [r.getMessage() for r in caplog.records if r.name == "ray.raylet"] == [message]
    ray_worker.print_to_stdstream({"lines": ["a worker's line"], "pid": 123, "is_err": False, "ip": "127.0.0.1",
                                   "task_name": "t", "actor_name": ""}, ignore_prefix=True)
    assert "a worker's line" in capsys.readouterr().out
