"""Helpers of the tests that run ``rollflow`` in child processes and kill them, or run it in this process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from stages.watchdog import cmdline, stat_fields, tree


def group_members(pgid: int) -> list[int]:
    """The living processes of process group ``pgid`` (zombies are dead: a container's init may never reap them)."""
    members = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        fields = stat_fields(int(name))
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(name))
    return members


def wait_gone(pgid: int, seconds: float) -> bool:
    """Wait until no living process of group ``pgid`` is left (True), or ``seconds`` passed (False)."""
    deadline = time.monotonic() + seconds
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def sigkill_when(cmd: list[str], ready: Callable[[], bool], log_path: Path, *, env: dict, cwd: str | None = None,
                 what: str = "the kill point", whole_group: bool = False, timeout_s: float = 1200) -> None:
    """Start ``cmd`` in a new session and SIGKILL it as soon as ``ready()`` holds — the CLI process alone, or with
    ``whole_group`` its whole process group. Fails if it ends or ``timeout_s`` passes first, or if a process of the
    group (its local Ray cluster, Prefect's ephemeral server) is still alive 30 s after the kill."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while not ready():
                assert proc.poll() is None, f"finished (rc {proc.returncode}) before {what}: " + \
                    log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, f"{what} never came"
                time.sleep(0.05)
            if whole_group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            left = [] if wait_gone(proc.pid, 30) else [cmdline(pid)[:200] for pid in group_members(proc.pid)]
            if left:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    # the command's watchdog (stages/watchdog.py) kills what it started: its Ray cluster, Prefect's ephemeral server
    assert not left, f"left behind by the killed command: {left}"


def ray_jobs() -> set[str]:
    """The jobs (hex ids) the session's Ray cluster (``ray_cluster``) has had, from its GCS: taken before a driver
    joins it, for :func:`wait_ray_jobs_gone`."""
    from ray._private.state import jobs

    return {job["JobID"] for job in jobs()}


def _alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _job_processes(new: set[str], ours: set[int]) -> set[int]:
    """The living processes of this process's tree (the session cluster's daemons and workers; the machine's other
    clusters number their jobs alike) that were started for one of the jobs ``new``: Ray's worker pool writes the job
    into a worker's ``RAY_JOB_ID`` (a worker started ahead for any job carries none)."""
    found = set()
    for pid in ours - {os.getpid()}:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        job = next((v[len(b"RAY_JOB_ID="):].decode() for v in env if v.startswith(b"RAY_JOB_ID=")), None)
        if job in new and _alive(pid):
            found.add(pid)
    return found


def wait_ray_jobs_gone(before: set[str], seconds: float = 60.0) -> None:
    """After a SIGKILL of a driver that joined the session's Ray cluster: wait until the processes of every job the
    cluster did not have ``before`` (:func:`ray_jobs`) are gone — the actors it owned (the raylet sees the driver's
    connection drop and ends them) and the workers started for it — so that none of them still writes into a
    temporary folder while the next run cleans it. A detached actor outlives its job by design and is not waited
    for. Fails naming what is left."""
    import ray
    from ray._private.state import actors

    new = ray_jobs() - before - {ray.get_runtime_context().get_job_id()}
    deadline = time.monotonic() + seconds
    while True:
        ours = set(tree([os.getpid()]))  # the session cluster's processes, no other cluster's
        theirs = [a for a in actors().values() if a["JobID"] in new and a["Pid"] in ours and _alive(a["Pid"])]
        kept = {a["Pid"] for a in theirs if a["IsDetached"]}
        left = ({a["Pid"] for a in theirs} | _job_processes(new, ours)) - kept
        if not left:
            return
        assert time.monotonic() < deadline, f"Ray jobs {sorted(new)} outlived their killed driver: " + \
            ", ".join(cmdline(pid)[:80] for pid in sorted(left))
        time.sleep(0.2)


def rollflow_here(*args: str, api_url: str):
    """The same command in this process, on the session's Ray cluster (``ray_cluster``) and Prefect server (Typer's
    result: ``exit_code``, ``stdout``, ``stderr``). No process start-up: for the calls that must find their work done
    or refuse before doing any, and for the re-runs and evaluations of the scenario tests, whose engines and workers
    are Ray actors either way. A test of the command as a process (its exit status, its console, a kill) starts a
    child instead."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from typer.testing import CliRunner

    from flows.cli import app

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        return CliRunner().invoke(app, list(args))
