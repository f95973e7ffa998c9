"""benchmarks/suite_cpu.py, the CPU of a command by kind of process (issue 11): it counts the command's own work and
names the kinds of the processes the suite runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "suite_cpu.py"
BUSY = "import time\nend = time.process_time() + 2.0\nwhile time.process_time() < end:\n    pass\n"


def test_a_command_of_two_cpu_seconds_is_counted_once_and_its_result_printed():
    done = subprocess.run([sys.executable, str(SCRIPT), "--interval", "0.2", "--", sys.executable, "-c", BUSY],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT ") and "exit=0" in result, done.stdout
    figures = dict(item.split("=") for item in result.split()[1:])
    # the busy loop, beside whatever else ran on the machine meanwhile; never more than the cores could give (a
    # process that was already running counts only what it used during the command, not its whole life), nor more
    # than the machine was busy (a process counts once, also through the exec that gives it its command line)
    assert float(figures["other_processes"]) >= 1.9, figures
    assert float(figures["cpu_s"]) <= float(figures["wall_s"]) * os.cpu_count() + 1.0, figures
    assert float(figures["cpu_s"]) <= float(figures["busy_cpu_s"]) + 1.0, figures
    assert float(figures["disk_peak_gb"]) >= 0 and "disk_left_gb" in figures, figures


def test_a_process_seen_last_as_a_zombie_keeps_its_kind():
    """A child that ends before its parent collects it is a zombie for a while: no command line, /proc/PID/comm says
    ``python``. It keeps the kind its command line gave it (here a ``rollflow`` command's, by the word flows.cli)."""
    parent = ("import subprocess, sys, time\n"
              f"subprocess.Popen([sys.executable, '-c', {BUSY!r}, 'flows' + '.cli'])\n"
              "time.sleep(5)\n")  # the child is a zombie from its end (about 2 s in) until this process exits
    done = subprocess.run([sys.executable, str(SCRIPT), "--interval", "0.2", "--", sys.executable, "-c", parent],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = dict(item.split("=") for item in done.stdout.strip().splitlines()[-1].split()[1:])
    assert float(figures.get("rollflow_commands", 0)) >= 1.9, done.stdout


def test_processes_are_named_by_kind():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from suite_cpu import kind_of, short_command
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert kind_of("ray::EngineActor.play") == "generation engines"
    assert kind_of("ray::RayTrainWo") == "Ray Train workers"  # a title cut at 15 characters
    assert kind_of("ray::IDLE") == "Ray task workers and other actors"
    assert kind_of("/venv/bin/python /venv/lib/ray/_private/workers/default_worker.py --raylet-name=/tmp/s/raylet") \
        == "Ray task workers and other actors"  # a worker not yet titled
    raylet = ("/venv/lib/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/s/raylet --python_worker_command="
              "/venv/bin/python /venv/lib/ray/_private/workers/default_worker.py")
    assert kind_of(raylet) == "Ray daemons"
    assert kind_of("/venv/bin/python /venv/lib/ray/dashboard/dashboard.py --host=127.0.0.1") == "Ray daemons"
    assert kind_of("/venv/bin/python -u /venv/lib/ray/_private/log_monitor.py --session-dir x") == "Ray log monitors"
    assert kind_of("/venv/bin/python -m prefect server start --port 1") == "Prefect servers"
    assert kind_of("/venv/bin/python -m flows.cli train --config c.yaml") == "rollflow commands"
    # the report names the processes of a catch-all kind by program and arguments, without the interpreter's path
    assert short_command("/venv/bin/python -u /venv/lib/ray/_private/log_monitor.py --session-dir x") == \
        "log_monitor.py --session-dir x"
    assert short_command("/venv/bin/python3.11 /venv/lib/ray/_private/workers/default_worker.py --a") == \
        "default_worker.py --a"
    assert short_command("/usr/bin/gcc -O2 x.c") == "gcc -O2 x.c"
    assert short_command("ray::ReadParquet->MapBatches(f) extra") == "ray::ReadParquet->MapBatches(f)"


def test_a_child_that_ends_is_counted_once_through_its_parent():
    """benchmarks/cpu_per_test.py's arithmetic on two readings (own seconds, reaped children's seconds, parent): a
    collected child's seconds move into its parent's reaped-children seconds and count once; a child whose parent
    does not collect it (Ray's raylet ignores SIGCHLD) or that was reparented away keeps what was counted of it."""
    from benchmarks.cpu_per_test import used_between

    parent, child, orphan = (10, "a"), (11, "b"), (12, "c")
    last = {parent: (1.0, 0.0, 1), child: (2.0, 0.0, 10), orphan: (0.5, 0.0, 1)}
    # the child used 0.5 s more and was collected (2.5 s in the parent's reaped seconds); the parent 0.25 s itself
    assert used_between(last, {parent: (1.25, 2.5, 1)}) == pytest.approx(0.25 + 0.5)
    # the same child, but the parent does not collect it: its 2.0 s stay counted, its last 0.5 s are lost
    assert used_between(last, {parent: (1.25, 0.0, 1)}) == pytest.approx(0.25)
    # a process started and collected between the readings counts whole through its parent
    assert used_between({parent: (1.0, 0.0, 1)}, {parent: (1.0, 1.5, 1)}) == pytest.approx(1.5)


def test_each_test_is_charged_with_the_cpu_of_the_processes_it_started(tmp_path):
    """The plugin in a pytest run without xdist: a test whose child process burns 1.5 CPU-seconds (started and
    ended between two readings of a second apart or not) is charged them, an empty test next to nothing."""
    tests = tmp_path / "test_burn.py"
    tests.write_text("import subprocess, sys\n"
                     f"BUSY = {BUSY.replace('2.0', '1.5')!r}\n"
                     "def test_child_burns():\n    subprocess.run([sys.executable, '-c', BUSY], check=True)\n"
                     "def test_empty():\n    pass\n")
    out = tmp_path / "cpu.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "benchmarks.cpu_per_test", str(tests)], cwd=SCRIPT.parents[1], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CPU_PER_TEST_OUT": str(out)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    charged = {row["test"].split("::")[-1]: row["cpu_s"] for row in rows}
    assert charged["test_child_burns"] >= 1.4, charged
    assert charged["test_empty"] < 0.5, charged


def test_disk_use_is_the_largest_drop_of_free_space_per_filesystem(tmp_path, monkeypatch):
    """The disk figures of the RESULT line: the most a command took at once and what it left, per filesystem (the
    temporary folder's and the cache's, one entry when they share a device), the largest over them."""
    from benchmarks.suite_cpu import DiskUse

    free = iter([10, 10, 7, 4, 9, 8])  # bytes free at each sample, in GiB; the first is the start
    monkeypatch.setattr(DiskUse, "_free", staticmethod(lambda folder: next(free) * 2**30))
    disk = DiskUse([str(tmp_path), str(tmp_path)])  # one device: one entry
    assert disk.folders == [str(tmp_path)]
    for _ in range(5):
        disk.update()
    assert disk.peak() == pytest.approx(6.0) and disk.left() == pytest.approx(2.0)
