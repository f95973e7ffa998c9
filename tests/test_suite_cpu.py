"""benchmarks/suite_cpu.py, the CPU of a command by kind of process (issue 11): it counts the command's own work and
names the kinds of the processes the suite runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_processes_are_named_by_kind():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from suite_cpu import kind_of
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert kind_of("ray::EngineActor.play") == "generation engines"
    assert kind_of("ray::RayTrainWo") == "Ray Train workers"  # a title cut at 15 characters
    assert kind_of("ray::MapWorker(MapBatches(ForwardActor))") == "log-prob / value actors"
    assert kind_of("ray::IDLE") == "Ray task workers and other actors"
    assert kind_of("/venv/bin/python -u /venv/lib/ray/_private/log_monitor.py --session-dir x") == "Ray log monitors"
    assert kind_of("/venv/bin/python -m prefect server start --port 1") == "Prefect servers"
    assert kind_of("/venv/bin/python -m flows.cli train --config c.yaml") == "rollflow commands"
