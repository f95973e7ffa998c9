"""Kills what a command started when that command dies, SIGKILL included (no orphans): its local Ray cluster and
Prefect's ephemeral API server.

``python -m stages.watchdog FD PID...`` runs in its own session. It blocks reading FD, the read end of a pipe whose
only write end the command holds. The read returns when the command exits, however it ends. The watchdog then kills
the given processes (the command itself first: :func:`start`) and their descendants, checking each process's start
time so that a reused process id is never touched. After a clean exit they are gone already and nothing is killed.
A process it may not signal (a sandbox's, under another uid) is left to its own limits. Linux only (/proc);
elsewhere the watchdog is not started.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first: field 3 of proc(5) is index 0), None if
    ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot, /proc/PID/stat field 22), None if it is gone or a zombie
    (dead, waiting for a parent to reap it: in a container whose init never reaps, that can be forever)."""
    fields = stat_fields(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


def cmdline(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by spaces ("" if it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class ProcessTable:
    """Who is whose child, for every process in /proc. Each :meth:`children` lists /proc and reads the stat file of
    the processes it has not seen before only: a process's parent changes only when the parent dies (to init or a
    subreaper), and a dead parent's children are not walked either way. (Reading every process's stat on each of the
    watchdog's walks, twice a second, took 2.7 ms of CPU per walk with 117 processes on the 2-core test machine,
    0.5 % of a core per watchdog, growing with the processes; this takes 0.12 ms.) A pid that ends and is reused
    between two listings keeps its old parent here: the watchdog reads a new descendant's parent and start time
    afresh before recording it (:func:`_record_tree`), so a stale entry costs at most a missed process, never a wrong
    one."""

    def __init__(self):
        self._parent: dict[int, int] = {}

    def children(self) -> dict[int, list[int]]:
        """Parent pid -> child pids."""
        listed = {int(name) for name in os.listdir("/proc") if name.isdigit()}
        self._parent = {pid: ppid for pid, ppid in self._parent.items() if pid in listed}
        for pid in listed - self._parent.keys():
            fields = stat_fields(pid)
            if fields is not None:
                self._parent[pid] = int(fields[1])
        out: dict[int, list[int]] = {}
        for pid, ppid in self._parent.items():
            out.setdefault(ppid, []).append(pid)
        return out


def tree(roots: list[int], table: ProcessTable | None = None) -> list[int]:
    """``roots`` and all their descendants (parents first), each once: a stale entry of the table (a reused pid) may
    name an ancestor as a child, and the walk must end all the same."""
    kids = (table or ProcessTable()).children()
    out, seen, todo = [], set(roots), list(roots)
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        fresh = [kid for kid in kids.get(pid, []) if kid not in seen]
        seen.update(fresh)
        todo.extend(fresh)
    return out


def kill_known(known: dict[int, int]) -> int:
    """SIGKILL every process of ``known`` (pid -> start time) still alive with that start time; return how many."""
    killed = 0
    for pid, started in known.items():
        if start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    return killed


def watch(fd: int, roots: list[int], every: float = 0.5) -> int:
    """Wait for EOF on ``fd``, then kill ``roots`` and their descendants; return how many were killed.

    The descendants are recorded while waiting (every ``every`` seconds), not only at the end: Ray starts its GCS
    and raylet to die with the command (PR_SET_PDEATHSIG), so by the time the watchdog wakes, the raylet may be gone
    and its agents and workers already handed to init, out of reach of a tree walk."""
    table = ProcessTable()
    known = {pid: t for pid in roots if (t := start_time(pid)) is not None}
    while True:
        ready, _, _ = select.select([fd], [], [], every)
        if ready and not os.read(fd, 1):
            break
        known = _record_tree(known, table)
    known = _record_tree(known, table)
    killed = kill_known(known)
    time.sleep(1.0)  # anything forked meanwhile (a worker being started) goes too
    return killed + kill_known(_record_tree(known, table))


def _record_tree(known: dict[int, int], table: ProcessTable) -> dict[int, int]:
    """``known`` (pid -> start time) without the processes that ended, with the living descendants added (never the
    watchdog itself, a child of the command it watches)."""
    alive = {pid: t for pid, t in known.items() if start_time(pid) == t}
    for pid in tree(list(alive), table):  # parents first
        if pid in alive or pid == os.getpid():
            continue
        fields = stat_fields(pid)  # afresh: the table's parent of a reused pid may be stale
        if fields is None or fields[0] in ("Z", "X"):
            continue
        parent, started = int(fields[1]), int(fields[19])
        if parent in alive and started >= alive[parent]:
            alive[pid] = started
    return alive


class _Outliving(subprocess.Popen):
    """The watchdog's Popen: its process outlives this one by design (it ends once this process has gone), so its
    finalisation at this process's exit, while it runs, is not the ResourceWarning "subprocess N is still running"
    that Popen gives (printed at the exit of every command and test worker that ran with warnings on: `python -W
    default`, PYTHONWARNINGS, dev mode, and once at the end of `make test`). Finalised after it ended, it is an
    ordinary Popen."""

    def __del__(self, *args, **kwargs) -> None:
        if self.poll() is None:  # still running (poll() answers from returncode once it has ended)
            return
        super().__del__(*args, **kwargs)


# this process's id -> the write end of its watchdog's pipe, held open for the process's lifetime
_PIPES: dict[int, int] = {}
# this process's id -> its watchdog, held for the process's lifetime (a Popen dropped while its process runs is a
# ResourceWarning, "subprocess N is still running"; at the exit, see _Outliving)
_WATCHDOGS: dict[int, subprocess.Popen] = {}


def watchdog_pid() -> int | None:
    """The process id of this process's watchdog (None if none was started)."""
    proc = _WATCHDOGS.get(os.getpid())
    return None if proc is None else proc.pid


def start(pids: tuple[int, ...] = ()) -> None:
    """Start the watchdog on this process, once: when it dies (SIGKILL included), every process it started is killed
    too: the local Ray cluster (GCS, raylet, agents, workers) and Prefect's ephemeral API server, which outlive a
    killed command otherwise. ``pids``: processes known now (a Ray cluster just started), recorded at once rather
    than on the watchdog's next walk of this process's descendants. Linux only (/proc)."""
    if os.getpid() in _PIPES or not os.path.isdir("/proc"):
        return
    read_end, write_end = os.pipe()
    proc = _Outliving([sys.executable, "-m", "stages.watchdog", str(read_end), str(os.getpid()), *map(str, pids)],
                      pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.close(read_end)
    _PIPES[os.getpid()] = write_end
    _WATCHDOGS[os.getpid()] = proc


def main(argv: list[str]) -> int:
    fd, roots = int(argv[0]), [int(p) for p in argv[1:]]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the command's terminal is the command's to handle
    watch(fd, roots)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
