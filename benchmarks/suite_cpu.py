"""Where a command's CPU goes, by kind of process (issue 11): `make test`'s pytest by default.

The command runs while every process on the machine is sampled from /proc (Linux) every ``--interval`` seconds: a
process first seen after the start counts with all its CPU time, one that was already running with what it used
since. The processes are grouped by what they are (Ray actors by class, Ray's daemons, Prefect's servers, the
pytest workers, ``rollflow`` children), so the table says which kind of process a cut has to remove; the catch-all
kinds (Ray task workers, Ray's daemons and Ray Data's helpers, other processes) are also listed by command line, a
Ray worker back at ``ray::IDLE`` by the last work it was seen at (``--top-commands N``). A process that
lives less than one interval is missed; the machine-wide busy time from /proc/stat is printed beside the sum (the
suite at a142c5b: 1,783 CPU-s summed over its processes, 1,908 busy). The free space of the filesystems that hold
the temporary folder and the rollflow cache is sampled too: the most the command took at once (``disk_peak_gb``)
and what it left (``disk_left_gb``: caches, and a failing test's folders), each the largest over those filesystems.

    python benchmarks/suite_cpu.py                       # the test suite as `make test` runs it
    python benchmarks/suite_cpu.py -- python -m pytest -q tests/spine/test_flow.py
    python benchmarks/suite_cpu.py --per-test cpu.jsonl  # and the CPU of each test (benchmarks/cpu_per_test.py)

The machine should be otherwise idle: every process is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_per_test import BETWEEN, HZ, OUT_ENV, cpu_times  # noqa: E402
from stages.paths import cache_root_path  # noqa: E402
from stages.watchdog import cmdline, stat_fields  # noqa: E402  (/proc readers of the runs' watchdog)

SUITE = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder"]

# Ray actor class (the process title ``ray::Class...``) -> kind; the first prefix that matches wins
ACTOR_KINDS = [
    ("EngineActor", "generation engines"), ("RayTrainWorker", "Ray Train workers"), ("TrainWorker", "training workers"),
    ("TrainController", "Ray Train helpers"), ("PlacementGroupCleaner", "Ray Train helpers"),
    ("SynchronizationActor", "Ray Train helpers"), ("DatasetManager", "Ray Train helpers"),
    ("Mailbox", "Ray Train helpers"), ("_AutoscalingCoordinatorActor", "Ray Data helper actors"),
    ("_StatsActor", "Ray Data helper actors"), ("ActorLocationTracker", "Ray Data helper actors"),
    ("DashboardAgent", "Ray daemons"), ("RuntimeEnvAgent", "Ray daemons"),
]
# a substring of the command line -> kind, for processes that are not Ray workers
# a program (the file name of a command line's first word) -> kind, before COMMAND_KINDS: the raylet's arguments name
# the workers' program (default_worker.py), and a worker's the raylet
PROGRAM_KINDS = {"raylet": "Ray daemons", "gcs_server": "Ray daemons"}
COMMAND_KINDS = [
    ("default_worker.py", "Ray task workers and other actors"),  # a worker before it titles itself
    ("log_monitor", "Ray log monitors"), ("raylet", "Ray daemons"), ("gcs_server", "Ray daemons"),
    ("dashboard/agent.py", "Ray daemons"), ("dashboard/dashboard.py", "Ray daemons"),  # (the API server)
    ("monitor.py", "Ray daemons"), ("ray.util.client", "Ray daemons"),
    ("ray start", "Ray daemons"), ("prefect server", "Prefect servers"), ("uvicorn", "Prefect servers"),
    ("pytest", "pytest processes"), ("flows.cli", "rollflow commands"), ("bin/rollflow", "rollflow commands"),
    ("multiprocessing.spawn", "spawned subprocesses (Prefect's served flow runs; vLLM engine cores out of process)"),
]


def kind_of(command: str) -> str:
    """The kind of a process from its command line (or its name, for a process without one)."""
    if command.startswith("ray::"):
        title = command[len("ray::"):]
        for prefix, kind in ACTOR_KINDS:
            # a title is cut at 15 characters where only /proc/<pid>/stat's name was readable
            if title.startswith(prefix) or (len(title) >= 8 and prefix.startswith(title.split(" ")[0])):
                return kind
        return "Ray task workers and other actors"
    program = os.path.basename(command.split(" ")[0])
    if program in PROGRAM_KINDS:
        return PROGRAM_KINDS[program]
    for part, kind in COMMAND_KINDS:
        if part in command:
            return kind
    return "other processes"


def _cpu_seconds(pid: str) -> tuple[str, float, str, bool] | None:
    """(``pid:start time``, user + system CPU seconds, command line, whether that is /proc/PID/comm) of one process,
    None if it is gone. The key stays the same through an ``exec`` (a forked child is first seen with its parent's
    command line) and differs for a reused pid. A process without a command line (a kernel thread, a zombie) is
    named by /proc/PID/comm: :func:`sample` keeps the command line it saw earlier, so that a process seen last as a
    zombie (its CPU time final, its command line gone: comm says ``python``) keeps its kind."""
    fields = stat_fields(int(pid))
    if fields is None:
        return None
    command = cmdline(int(pid))
    named_by_comm = not command
    if named_by_comm:
        try:
            with open(f"/proc/{pid}/comm") as f:
                command = f.read().strip()
        except OSError:
            return None
    return f"{pid}:{fields[19]}", cpu_times(fields)[0], command, named_by_comm  # start time: field 22 of proc(5)


def _busy_seconds() -> float:
    """Machine-wide busy CPU seconds so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / HZ


# the kinds whose processes the report also names by command line (catch-alls: what is in them says what to cut)
NAMED_KINDS = ("Ray task workers and other actors", "other processes", "Ray daemons", "Ray Data helper actors")


def short_command(command: str, width: int = 90) -> str:
    """A process's command line as the report names it: a Ray worker's title as it is; else the program's file name
    and its arguments, without the interpreter's path, cut at ``width`` characters."""
    if command.startswith("ray::"):
        return command.split(" ")[0][:width]
    words = command.split(" ")
    words[0] = os.path.basename(words[0])
    if words[0].startswith("python") and len(words) > 1:
        words = [w for w in words[1:] if w not in ("-u", "-B", "-s", "-E", "-I", "-O")] or words
        words[0] = words[0] if words[0].startswith("-") else os.path.basename(words[0])
    return " ".join(words)[:width]


class DiskUse:
    """The free bytes of the filesystems holding ``folders`` (one entry per device), sampled by :meth:`update`:
    the largest drop below the first sample (:meth:`peak`) and the drop at the last one (:meth:`left`)."""

    def __init__(self, folders: list[str]) -> None:
        by_device = {os.stat(f).st_dev: f for f in folders if os.path.isdir(f)}
        self.folders = list(by_device.values())
        self.start = [self._free(f) for f in self.folders]
        self.lowest, self.last = list(self.start), list(self.start)

    @staticmethod
    def _free(folder: str) -> int:
        stat = os.statvfs(folder)
        return stat.f_bavail * stat.f_frsize

    def update(self) -> None:
        self.last = [self._free(f) for f in self.folders]
        self.lowest = [min(a, b) for a, b in zip(self.lowest, self.last)]

    def peak(self) -> float:
        return max((s - low for s, low in zip(self.start, self.lowest)), default=0) / 2**30

    def left(self) -> float:
        return max((s - last for s, last in zip(self.start, self.last)), default=0) / 2**30


def sample(command: list[str], interval: float) -> tuple[dict[str, list], float, float, int, DiskUse]:
    """Run ``command``, sampling /proc every ``interval`` s until it exits. Returns ({kind: [cpu_s, processes,
    {short command line: [cpu_s, processes]}]}, wall seconds, machine busy seconds, the command's exit status, the
    free space of the temporary folder's and the rollflow cache's filesystems over the run)."""
    cache = cache_root_path()
    cache.mkdir(parents=True, exist_ok=True)
    disk = DiskUse([tempfile.gettempdir(), str(cache)])
    first: dict[str, float] = {}
    last: dict[str, tuple[float, str]] = {}
    worked: dict[str, str] = {}  # a Ray worker's last title other than ray::IDLE (a task worker goes back to IDLE)
    before = {pid for pid in os.listdir("/proc") if pid.isdigit()}
    busy0, start = _busy_seconds(), time.monotonic()
    proc = subprocess.Popen(command)
    while True:
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            seen = _cpu_seconds(pid)
            if seen is not None:
                key, cpu, command, named_by_comm = seen
                first.setdefault(key, cpu if pid in before else 0.0)
                if key not in last or not named_by_comm:  # an exiting process (a zombie) has no command line
                    last[key] = (cpu, command)  # the newest command line: the one after an exec
                else:
                    last[key] = (cpu, last[key][1])
                if command.startswith("ray::") and not command.startswith("ray::IDLE"):
                    worked[key] = command
        disk.update()
        if proc.poll() is not None:
            break
        time.sleep(interval)
    wall, busy = time.monotonic() - start, _busy_seconds() - busy0
    disk.update()
    kinds: dict[str, list] = defaultdict(lambda: [0.0, 0, defaultdict(lambda: [0.0, 0])])
    for key, (cpu, cmd) in last.items():
        used = cpu - first[key]
        if used > 0.01:
            entry = kinds[kind_of(cmd)]
            entry[0] += used
            entry[1] += 1
            name = short_command(cmd)
            if name == "ray::IDLE":  # named by what it did, if it was seen at work
                name += f" (after {short_command(worked[key])})" if key in worked else " (never seen at work)"
            named = entry[2][name]
            named[0] += used
            named[1] += 1
    return dict(kinds), wall, busy, proc.returncode, disk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between two samples of /proc")
    parser.add_argument("--per-test", metavar="FILE", help="a pytest command: also charge the CPU of each test, "
                        "with what it started, to it (benchmarks/cpu_per_test.py); written to FILE, the top printed")
    parser.add_argument("--top-commands", type=int, default=12, metavar="N", help="name the N command lines that "
                        "used the most CPU in each catch-all kind (Ray task workers, other processes, Ray daemons)")
    parser.add_argument("command", nargs="*", help="the command (after --); default: the suite as `make test` runs it")
    args = parser.parse_args()
    command = args.command or SUITE
    if args.per_test:
        Path(args.per_test).unlink(missing_ok=True)
        os.environ[OUT_ENV] = str(Path(args.per_test).resolve())
        command = [*command, "-p", "benchmarks.cpu_per_test"]
    kinds, wall, busy, status, disk = sample(command, args.interval)
    per_test = print_per_test(Path(args.per_test)) if args.per_test else {}
    total = sum(cpu for cpu, _, _ in kinds.values())
    print_named(kinds, args.top_commands)
    print(f"{'CPU s':>8} {'share':>6} {'procs':>6}  kind")
    for kind, (cpu, count, _) in sorted(kinds.items(), key=lambda item: -item[1][0]):
        print(f"{cpu:8.1f} {cpu / total:6.1%} {count:6d}  {kind}")
    print(f"command exit {status}; wall {wall:.0f} s; processes {total:.0f} CPU-s; machine busy {busy:.0f} CPU-s "
          f"({busy / (wall * os.cpu_count()):.0%} of {os.cpu_count()} cores); disk: {disk.peak():.1f} GiB at most "
          f"at once, {disk.left():.1f} GiB left after it ({', '.join(disk.folders)})")
    figures = {k.replace(" / ", "_").replace(" ", "_").lower(): v[0] for k, v in kinds.items()}
    head = [f"wall_s={wall:.0f}", f"cpu_s={total:.0f}", f"busy_cpu_s={busy:.0f}", f"exit={status}",
            f"disk_peak_gb={disk.peak():.1f}", f"disk_left_gb={disk.left():.1f}"]
    print("RESULT " + " ".join(head + [f"{k}={v:.0f}" for k, v in sorted(figures.items())]
                               + [f"{k}={v:.0f}" for k, v in per_test.items()]))


def print_named(kinds: dict[str, list], top: int) -> None:
    """Print the ``top`` command lines by CPU of each of NAMED_KINDS (the catch-all kinds)."""
    for kind in NAMED_KINDS:
        if kind not in kinds or top <= 0:
            continue
        print(f"{'CPU s':>8} {'procs':>6}  {kind}: the top command lines")
        for name, (cpu, count) in sorted(kinds[kind][2].items(), key=lambda item: -item[1][0])[:top]:
            print(f"{cpu:8.1f} {count:6d}  {name}")


def print_per_test(path: Path, top: int = 30) -> dict[str, float]:
    """Print the ``top`` tests and the modules by CPU from the plugin's lines; returns the figures for RESULT."""
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    tests: dict[str, float] = defaultdict(float)
    for row in rows:
        tests[row["test"]] += row["cpu_s"]
    modules: dict[str, float] = defaultdict(float)
    for test, cpu in tests.items():
        modules[test.split("::")[0]] += cpu
    for title, table in (("test", tests), ("module", modules)):
        print(f"{'CPU s':>8}  {title}")
        for name, cpu in sorted(table.items(), key=lambda item: -item[1])[:top]:
            print(f"{cpu:8.1f}  {name}")
    between = tests.get(BETWEEN, 0.0)
    return {"per_test_cpu_s": sum(tests.values()) - between, "between_tests_cpu_s": between}


if __name__ == "__main__":
    main()
