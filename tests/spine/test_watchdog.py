"""The watchdog's record of a command's process tree (stages/watchdog.py), without Ray: the end-to-end cases (a
SIGKILLed command leaves nothing behind) are in tests/spine/test_cluster.py and tests/spine/test_resume.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stages.watchdog import ProcessTable, _record_tree, kill_known, start_time, tree
from tests.processes import wait_gone

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="the watchdog reads /proc (Linux only)")


@pytest.fixture
def grandchild():
    """A child of this process with a child of its own: (child pid, grandchild pid)."""
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                             "p = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\ntime.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    grand = int(proc.stdout.readline())
    try:
        yield proc.pid, grand
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        kill_known({grand: start_time(grand)})  # the orphaned sleep too, if it is still the same process


def test_the_record_holds_the_descendants_and_a_table_reads_each_process_once(grandchild):
    child, grand = grandchild
    me = os.getpid()
    table = ProcessTable()
    known = _record_tree({me: start_time(me)}, table)
    assert {me, child, grand} <= known.keys()
    assert known[grand] == start_time(grand) >= known[child] >= known[me]
    assert tree([child], table) == [child, grand]
    assert table._parent[grand] == child  # read once, kept for the next walk


def test_a_stale_parent_in_the_table_never_records_a_stranger(grandchild):
    """A pid reused between two walks keeps its old parent in the table; the record checks the parent afresh, so a
    process that is not a descendant (here init, claimed by the table to be this process's child) stays out. The
    walk ends although init is also this process's ancestor (a cycle in the table)."""
    me = os.getpid()
    table = ProcessTable()
    table.children()
    table._parent[1] = me  # what a stale entry of a reused pid looks like
    assert 1 in tree([me], table)
    known = _record_tree({me: start_time(me)}, table)
    assert 1 not in known and grandchild[1] in known


def test_a_command_with_warnings_on_exits_without_a_resource_warning_for_its_watchdog(tmp_path):
    """The watchdog runs past the command's exit by design; its Popen, finalised at the exit while it runs, gave
    Python's ResourceWarning "subprocess N is still running" wherever warnings were on (seen at the end of `make
    test`). A command with ``-W default`` starts its watchdog and exits: nothing on stderr, and the watchdog then
    ends by itself."""
    done = subprocess.run([sys.executable, "-W", "default", "-c", "from stages import watchdog\n"
                           "watchdog.start()\nprint(watchdog.watchdog_pid())"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # the pipe's end told it: gone within seconds (it runs in a session of its own: its group is itself)
    assert wait_gone(int(done.stdout), 10), "the watchdog outlived its command"
