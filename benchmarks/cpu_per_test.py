"""A pytest plugin: the CPU each test costs, with everything it started (issue 11). Loaded by
``python benchmarks/suite_cpu.py --per-test FILE``, or by hand: ``pytest -p benchmarks.cpu_per_test`` with
``CPU_PER_TEST_OUT=FILE``.

In each pytest process that runs tests (every xdist worker, or the only one), a thread reads /proc every second and
charges the CPU that the process and its descendants used since the last reading (its Ray cluster's daemons and
actors, its Prefect server, the commands it started) to the test running meanwhile, or to ``(between tests)``: the
idle cluster and server while xdist has no test for the worker, and the session's teardown. A child that ends counts
once, through its parent's reaped-children time where the parent collects it (:func:`used_between`); a process
reparented away from the tree (a double-forked daemon) is no longer counted. The figures of one worker are
appended to ``FILE`` as JSON lines ``{"worker", "test", "cpu_s"}`` when the worker ends.
"""

from __future__ import annotations

import json
import os
import threading
import time

from stages.watchdog import ProcessTable, stat_fields, tree

HZ = os.sysconf("SC_CLK_TCK")
BETWEEN = "(between tests)"
OUT_ENV = "CPU_PER_TEST_OUT"


def cpu_times(fields: list[str]) -> tuple[float, float]:
    """(own CPU seconds, reaped children's CPU seconds) from a process's :func:`stat_fields` (proc(5) fields 14-17:
    utime + stime, cutime + cstime)."""
    return (int(fields[11]) + int(fields[12])) / HZ, (int(fields[13]) + int(fields[14])) / HZ


def tree_cpu(root: int, table: ProcessTable) -> dict[tuple[int, str], tuple[float, float, int]]:
    """{(pid, start time): (own CPU seconds, reaped children's CPU seconds, parent pid)} of ``root`` and its living
    descendants, walked by the watchdog's :func:`tree` (Linux /proc). Each process's stat is read afresh; one whose
    parent is not in the tree (a pid the table still files under an ended parent) is left out."""
    found, pids = {}, tree([root], table)
    walked = set(pids)
    for pid in pids:
        fields = stat_fields(pid)  # state, ppid, ...: field 3 of proc(5) is index 0
        if fields is not None and (pid == root or int(fields[1]) in walked):
            found[(pid, fields[19])] = (*cpu_times(fields), int(fields[1]))
    return found


def used_between(last: dict, now: dict) -> float:
    """CPU seconds the tree used between two readings of :func:`tree_cpu`: what every living process used, itself
    and through the children it reaped meanwhile. A child that ended was counted up to the last reading; its
    parent's reaped-children seconds grow by its whole life when the parent collects it, so at most that much of
    what was counted is taken off again: a child counts once, its last interval included, and a child that starts
    and ends between two readings counts whole. (A parent that ignores SIGCHLD, as Ray's raylet does, collects
    nothing: its ended children keep what was counted and lose their last interval.)"""
    used, grown = 0.0, {}
    for key, (own, reaped, _) in now.items():
        own_before, reaped_before, _ = last.get(key, (0.0, 0.0, 0))
        used += own - own_before + reaped - reaped_before
        grown[key[0]] = reaped - reaped_before
    counted: dict[int, float] = {}
    for key, (own, reaped, ppid) in last.items():
        if key not in now and ppid in grown:
            counted[ppid] = counted.get(ppid, 0.0) + own + reaped
    return used - sum(min(total, grown[ppid]) for ppid, total in counted.items())


class Meter:
    """Charges the CPU of this process's tree, read every ``interval`` s, to the test that is running."""

    def __init__(self, interval: float = 1.0):
        self.interval, self.test, self.charged = interval, BETWEEN, {}
        self._lock, self._table = threading.Lock(), ProcessTable()
        self._last = tree_cpu(os.getpid(), self._table)  # what ran before the first test is not charged

    def run(self) -> None:
        while True:
            time.sleep(self.interval)
            self.switch(None)

    def switch(self, test: str | None) -> None:
        """Charge what the tree used since the last reading to the running test, then run ``test`` (None: the same
        one)."""
        with self._lock:
            now = tree_cpu(os.getpid(), self._table)
            self.charged[self.test] = self.charged.get(self.test, 0.0) + used_between(self._last, now)
            self._last = now
            if test is not None:
                self.test = test


_meter: Meter | None = None


def pytest_configure(config) -> None:
    """Meter a process that runs tests: an xdist worker, or pytest without xdist workers (not xdist's controller)."""
    global _meter
    runs_tests = bool(os.environ.get("PYTEST_XDIST_WORKER")) or not config.getoption("numprocesses", None)
    if os.environ.get(OUT_ENV) and runs_tests:
        _meter = Meter()
        threading.Thread(target=_meter.run, daemon=True, name="cpu-per-test").start()


def pytest_runtest_logstart(nodeid, location) -> None:
    if _meter is not None:
        _meter.switch(nodeid)


def pytest_runtest_logfinish(nodeid, location) -> None:
    if _meter is not None:
        _meter.switch(BETWEEN)


def pytest_unconfigure(config) -> None:
    if _meter is None:
        return
    _meter.switch(None)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.environ[OUT_ENV], "a") as out:
        for test, cpu in _meter.charged.items():
            out.write(json.dumps({"worker": worker, "test": test, "cpu_s": round(cpu, 2)}) + "\n")
