"""What Ctrl-C means for a ``rollflow`` command: stop its work now, say in one line what is committed and how to
resume, exit with status 130.

A terminal's Ctrl-C sends SIGINT to its whole foreground process group: the command and the services it started
there. Those services ignore it, so they outlive the command's own decision: Ray's local cluster blocks SIGINT in
every process it starts (``start_ray_process`` in ray/_private/services.py; its workers run in process groups of
their own), and Prefect's ephemeral API server is started with SIGINT blocked (flows/services.py). Left to Python's
default (``KeyboardInterrupt`` wherever the main thread happens to be), an interrupt was caught by Prefect's engine,
which then reported the crash to a server the same SIGINT had killed, and the run went on to its end with a page of
``EventsWorker`` errors and a traceback (issue 48).

:func:`install` (once, where the command line starts) makes SIGINT end the command in the handler itself, on the
main thread, so no stage starts or commits after it (or, when the main thread is held in a library's C code for more
than a second, on a thread woken by the signal, :func:`_watch_wakeups`):

1. one line on stderr: what this command committed (the one runner records every output it commits or finds
   committed, :data:`stages.commit.COMMITTED`) and the command that resumes;
2. the console is closed: whatever the stopping work still prints goes to the command's log file;
3. the work stops: every process the command started (its local Ray cluster's workers, actors and engines first,
   then the cluster's own processes; a joined cluster drops the command's tasks and actors when its driver goes);
4. Prefect's flow run (and task run) is marked Cancelled, then Prefect's ephemeral server is stopped;
5. ``os._exit(130)``.

A stage interrupted half-way has written into a temporary folder only; the runner's commit protocol (manifest last,
atomic rename) never commits half an output, and the next run removes the leftovers and resumes at the first output
not committed, exactly as after a SIGKILL. A second Ctrl-C while stopping exits at once. Commands whose work is to
serve until interrupted (``rollflow server``, ``rollflow deploy``) keep Python's ``KeyboardInterrupt``
(:func:`keep_keyboard_interrupt`).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("rollflow")
EXIT_STATUS = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
PREFECT_WAIT_S = 2.0  # at most this long for Prefect (mark the run, stop the server): the whole stop stays within 5 s

HANDLER_WAIT_S = 1.0  # how long the wakeup watcher leaves a SIGINT to the main thread's handler
_state: dict = {"resume": None, "stopping": False, "handled": False, "keyboard_interrupt": False}
_lock = threading.Lock()


def install(argv: list[str]) -> None:
    """Make SIGINT stop this command as the module says; ``argv``: the command's arguments (without the program),
    whose re-run resumes it unless the command names another way (:func:`resume_with`). Main thread only."""
    _state["resume"] = "rollflow " + shlex.join(argv)
    signal.signal(signal.SIGINT, _on_interrupt)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=_watch_wakeups, args=(read_end,), name="rollflow-interrupt", daemon=True).start()


def _watch_wakeups(read_end: int) -> None:
    """Python runs a signal handler on the main thread between two bytecodes, so a main thread waiting inside a
    library's C code (Ray's start-up waits for its processes there, under load for seconds) delays it. Python's C
    handler writes every signal's number into the wakeup pipe at once: this thread reads it, and stops the command
    itself when the main thread's handler has not begun within HANDLER_WAIT_S (without the Prefect run context only
    the main thread sees: the runs are then left to Prefect's own crash detection)."""
    seen = 0  # SIGINTs read from the pipe: the main thread's handler may already be stopping for the first one
    while True:
        data = os.read(read_end, 64)
        if signal.SIGINT not in data or _state["keyboard_interrupt"]:
            continue
        seen += data.count(signal.SIGINT)
        if seen > 1 and _state["stopping"]:  # a second Ctrl-C
            os._exit(EXIT_STATUS)
        deadline = time.monotonic() + HANDLER_WAIT_S
        while not _state["stopping"] and time.monotonic() < deadline:
            time.sleep(0.05)
        if _begin():
            _stop(from_main_thread=False)


def resume_with(command: str) -> None:
    """The command line that resumes this command's work (``rollflow train --resume runs/<run>``)."""
    _state["resume"] = command


def keep_keyboard_interrupt() -> None:
    """For the commands that serve until Ctrl-C: SIGINT raises ``KeyboardInterrupt``, which they catch to stop (the
    wakeup watcher leaves it to them)."""
    _state["keyboard_interrupt"] = True
    signal.signal(signal.SIGINT, signal.default_int_handler)


def shown(path: str) -> str:
    """``path`` relative to the working folder when it lies inside it."""
    if "://" in path:
        return path
    full = Path(path).absolute()
    return str(full.relative_to(Path.cwd())) if full.is_relative_to(Path.cwd()) else path


def summary_line(committed: list[str], resume: str | None) -> str:
    """The one line of an interrupted command: ``committed`` (its outputs, in commit order), ``resume``."""
    done = list(dict.fromkeys(committed))
    if not done:
        what = "nothing committed"
    else:
        last = ", ".join(shown(p) for p in done[-2:])
        what = f"{len(done)} output(s) committed (the last: {last})"
    return f"interrupted: {what}; resume with {resume or 'the same command'}"


def _begin() -> bool:
    """True for the one caller that stops the command (the main thread's handler, or the wakeup watcher)."""
    with _lock:
        if _state["stopping"]:
            return False
        _state["stopping"] = True
        return True


def _on_interrupt(signum, frame) -> None:
    if _begin():
        _stop(from_main_thread=True)
    if _state["handled"]:  # a second Ctrl-C: no more waiting
        os._exit(EXIT_STATUS)
    _state["handled"] = True
    while True:  # the watcher is stopping the command: the main thread does nothing more
        time.sleep(1.0)


def _steps(from_main_thread: bool):
    """The stopping steps, in order, as (name, function); each runs whatever the one before it did."""
    # modules are looked up, never imported here: the main thread may be half-way through an import
    commit = sys.modules.get("stages.commit")
    line = summary_line(commit.COMMITTED if commit else [], _state["resume"])
    flow_runs: list = []
    prefix = "\r\x1b[K" if sys.stderr.isatty() else ""

    def prefect_runs() -> None:
        flow_runs.extend(_prefect_runs() if from_main_thread else [])  # the main thread's Prefect context

    def stop_processes() -> None:
        log.info("interrupted: stopped %d process(es) the command started", _stop_processes())

    return [("the line", lambda: os.write(2, f"{prefix}{line}\n".encode())),
            ("the console", _close_console),
            ("the log", lambda: log.info("%s (SIGINT)", line)),
            ("the Prefect runs", prefect_runs),
            ("the processes", stop_processes),
            ("Prefect's runs", lambda: _cancel_prefect(flow_runs)),
            ("Prefect's server", _stop_prefect_server)]


def _stop(from_main_thread: bool) -> None:
    """Stop the command (the steps of the module's docstring) and exit with EXIT_STATUS."""
    try:
        for name, step in _steps(from_main_thread):
            try:
                step()
            except BaseException as err:  # noqa: BLE001 (the next steps run, the command ends either way)
                log.info("interrupted: stopping %s failed (%s: %s)", name, type(err).__name__, err)  # the file
    finally:
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 (the exit must not wait on a broken handler)
                pass
        os._exit(EXIT_STATUS)


def _close_console() -> None:
    """Point stdout and stderr at the command's log file (at /dev/null without one): what the stopping work still
    prints (a library's error about a connection that went away) stays off the console."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler).__name__ == "ConsoleHandler":
            root.removeHandler(handler)
    console = sys.modules.get("flows.console")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    path = console.log_path() if console else None
    target = os.open(str(path) if path else os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)


def _stop_processes() -> int:
    """SIGKILL the processes this command started (its local Ray cluster: workers, actors, engines, then the
    cluster's own processes), leaves first; not its watchdog (which ends by itself when the command does) nor
    Prefect's server (stopped after its run is marked). Returns how many. Linux only (/proc)."""
    watchdog = sys.modules.get("stages.watchdog")
    if watchdog is None or not os.path.isdir("/proc"):  # nothing started yet (the watchdog comes first)
        return 0
    keep = {watchdog.watchdog_pid(), _prefect_server_pid()}
    table = watchdog.ProcessTable()

    def kill_tree() -> int:
        pids = [pid for pid in watchdog.tree([os.getpid()], table)[1:] if pid not in keep]
        return watchdog.kill_known({pid: t for pid in reversed(pids)  # leaves first
                                    if (t := watchdog.start_time(pid)) is not None})

    killed = kill_tree()
    time.sleep(0.2)  # a worker forked meanwhile goes too
    return killed + kill_tree()


def _prefect_runs() -> list[tuple[str, object]]:
    """(kind, id) of the flow run and task run the main thread is in, if Prefect is loaded at all."""
    context = sys.modules.get("prefect.context")
    flow_run_context = getattr(context, "FlowRunContext", None)  # None: Prefect not loaded, or half-way through
    if flow_run_context is None or not hasattr(context, "TaskRunContext"):
        return []
    runs = []
    for kind, ctx in (("task", context.TaskRunContext.get()), ("flow", flow_run_context.get())):
        run = getattr(ctx, f"{kind}_run", None) if ctx is not None else None
        if run is not None:
            runs.append((kind, run.id))
    return runs


def _cancel_prefect(runs: list[tuple[str, object]]) -> None:
    """Mark the interrupted task and flow runs Cancelled on their Prefect API (at most PREFECT_WAIT_S); a failure is
    logged to the file only."""
    if not runs:
        return

    def cancel() -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled

        with get_client(sync_client=True, httpx_settings={"timeout": PREFECT_WAIT_S}) as client:
            for kind, run_id in runs:
                setter = client.set_task_run_state if kind == "task" else client.set_flow_run_state
                setter(run_id, Cancelled(message="interrupted (Ctrl-C)"), force=True)
                log.info("interrupted: Prefect %s run %s marked Cancelled", kind, run_id)

    def guarded() -> None:
        try:
            cancel()
        except Exception as err:  # noqa: BLE001 (the command is ending either way)
            log.warning("interrupted: could not mark the Prefect runs Cancelled (%s: %s)", type(err).__name__, err)

    worker = threading.Thread(target=guarded, name="rollflow-interrupt-prefect", daemon=True)
    worker.start()
    worker.join(PREFECT_WAIT_S)
    if worker.is_alive():  # a loaded machine: the command ends all the same, and says so in its log
        log.warning("interrupted: could not mark the Prefect runs Cancelled (Timeout: no answer within %.1f s)",
                    PREFECT_WAIT_S)


def _prefect_server():
    """Prefect's ephemeral server object of this process, if one was started."""
    server_class = getattr(sys.modules.get("prefect.server.api.server"), "SubprocessASGIServer", None)
    if server_class is None:  # not loaded, or half-way through its import: no server started
        return None
    return next((s for s in server_class._instances.values() if s.server_process is not None), None)


def _prefect_server_pid() -> int | None:
    server = _prefect_server()
    return server.server_process.pid if server is not None else None


def _stop_prefect_server() -> None:
    """SIGTERM Prefect's ephemeral server (uvicorn shuts down), SIGKILL after a second."""
    server = _prefect_server()
    if server is None:
        return
    process = server.server_process
    process.terminate()
    try:
        process.wait(timeout=1.0)
    except Exception:  # noqa: BLE001 (subprocess.TimeoutExpired)
        process.kill()
