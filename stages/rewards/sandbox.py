"""Run untrusted Python in a separate, contained process (the code reward's sandbox, ALGORITHMS.md §10).

Each run gets a fresh process started through ``_sandbox_launcher.py`` (no ``preexec_fn``, so it is safe from
threads) with:

* limits: CPU time (``RLIMIT_CPU``), address space (``RLIMIT_AS``), processes (``RLIMIT_NPROC``, counted for a
  fresh uid per run), file size (``RLIMIT_FSIZE``), open files, no core dumps, wall time (the whole process group
  and, in namespace mode, the whole PID namespace are killed), output (at most ``max_output_bytes`` per stream are
  read, then the run is killed);
* isolation, ``mode="namespaces"`` (root with CAP_SYS_ADMIN, as here and in CI): new network namespace (only a down
  loopback: every connection fails), new PID namespace (nothing outside is visible or signalable; every process
  of the run is killed and reaped before :meth:`Sandbox.run_python` returns), new mount namespace with a minimal
  root (chroot): the system folders (/usr, /bin, /lib*, /etc) and the interpreter's prefix read-only, four devices,
  a fresh ``/proc`` and a size-limited tmpfs ``/work`` (the working folder, gone with the namespace); no /tmp,
  /home, /root or repository. The program runs as a fresh unprivileged uid/gid without supplementary groups
  (root-only files are unreadable even where visible), with ``no_new_privs``, an empty environment (``PATH``,
  ``LANG``, ``HOME``/``TMPDIR`` = ``/work``) and ``python -I -S -B`` (no site-packages, no user paths). The
  interpreter is this process's own (its installation folder is mounted read-only), so code runs on the same
  Python version as rollflow;
* ``mode="fallback"`` (no namespaces, e.g. non-root): the same limits, a uid switch only when root, a throwaway
  working folder, and an in-interpreter audit hook that refuses sockets and signals to other processes. This is
  weaker: code using ctypes can bypass the hook, may read and write wherever its user may, and processes that
  leave the process group can outlive the run. ``sandbox_info().mode`` says which mode is in use.

In either mode the program gets none of the parent's environment variables; in namespace mode it sees none of the
parent's files either (only the read-only system folders), nor the launcher's report.
"""

from __future__ import annotations

import marshal
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from schemas.errors import ConfigError, RollflowError

LAUNCHER = str(Path(__file__).with_name("_sandbox_launcher.py"))
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")  # as _sandbox_launcher
WORK_IN_ROOT = "/work"  # the working folder's path inside the namespace sandbox's root
UID_RANGE = (1_500_000_000, 1_600_000_000)  # fresh uid per run: RLIMIT_NPROC counts only this run's processes
MODES = ("auto", "namespaces", "fallback")


class SandboxUnavailable(RollflowError):
    """The sandbox cannot start untrusted code safely on this machine (message: why and the fix)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. Times in seconds, sizes in MiB unless named bytes."""

    cpu_seconds: int = 4
    wall_seconds: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 1 << 20
    workdir_mb: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ConfigError(f"SandboxLimits.{name} = {value}: every limit must be positive")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run. ``status``: ``ok`` (exit 0), ``exit_nonzero``, ``signaled`` (killed by a signal, e.g.
    the CPU or memory limit), ``timeout`` (wall time), ``output_limit``, ``sandbox_error`` (setup failed: not the
    program's fault)."""

    status: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    mode: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class SandboxInfo:
    mode: str
    python: str
    switches_uid: bool
    notes: list[str] = field(default_factory=list)


def _world_traversable(path: str) -> bool:
    """Every directory above ``path`` is executable by others and ``path`` itself is executable by others."""
    real = Path(os.path.realpath(path))
    try:
        return all(p.stat().st_mode & stat.S_IXOTH for p in [*real.parents, real])
    except OSError:
        return False


def _python_candidates(preferred: str | None) -> list[str]:
    names = [preferred] if preferred else [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3",
                                           shutil.which("python3") or ""]
    unique: list[str] = []
    for name in names:
        if name and os.path.exists(name) and name not in unique:
            unique.append(name)
    return unique


class Sandbox:
    """Runs Python sources under :class:`SandboxLimits`. ``mode``: ``auto`` (namespaces when available, else
    fallback), ``namespaces`` (fail if unavailable) or ``fallback``. ``python``: interpreter for the untrusted code
    (default: the first of this interpreter, /usr/bin/python3, /usr/local/bin/python3 that passes a probe run; in
    namespace mode its installation folder is mounted into the sandbox, in fallback mode as root it must be
    executable by an unprivileged user)."""

    def __init__(self, mode: str = "auto", python: str | None = None) -> None:
        if mode not in MODES:
            raise ConfigError(f"sandbox mode '{mode}' is not one of {MODES}")
        self.requested_mode = mode
        self.requested_python = python
        self._info: SandboxInfo | None = None
        self._lock = threading.Lock()

    # ---- setup ---------------------------------------------------------------------------------------------------
    def info(self) -> SandboxInfo:
        """Mode and interpreter in use (probed once: a tiny program is run in each candidate configuration)."""
        with self._lock:
            if self._info is None:
                self._info = self._probe()
            return self._info

    def _probe(self) -> SandboxInfo:
        root = os.geteuid() == 0
        modes = ["namespaces", "fallback"] if self.requested_mode == "auto" else [self.requested_mode]
        if not root and "namespaces" in modes:
            if self.requested_mode == "namespaces":
                raise SandboxUnavailable("sandbox mode 'namespaces' needs root (CAP_SYS_ADMIN); run as root or use "
                                         "mode='fallback' (weaker isolation, see stages/rewards/sandbox.py)")
            modes.remove("namespaces")
        notes: list[str] = []
        for mode in modes:
            for python in _python_candidates(self.requested_python):
                if mode == "namespaces":
                    python = os.path.realpath(python)  # its prefix is mounted into the sandbox's root
                elif root and not _world_traversable(python):
                    notes.append(f"{python}: not executable by an unprivileged user")
                    continue
                probe = SandboxInfo(mode, python, switches_uid=root)
                result = self._run(probe, "import sys\nprint(sys.version_info[0])\n", b"", {}, SandboxLimits())
                if result.ok and result.stdout.strip() == "3":
                    return SandboxInfo(mode, python, root, notes)
                notes.append(f"{mode} with {python}: {result.status} {result.stderr.strip()[-300:]}")
        raise SandboxUnavailable("no sandbox configuration works here: " + "; ".join(notes) + ". Fix: run as root "
                                 "with a Python installed system-wide (e.g. /usr/bin/python3), or pass python=...")

    # ---- one run ---------------------------------------------------------------------------------------------------
    def run_python(self, source: str, stdin: str | bytes = b"", *, files: Mapping[str, str | bytes] | None = None,
                   limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
        """Run ``source`` as ``main.py`` in a fresh working folder holding ``files`` (name → content), feeding
        ``stdin``. Never raises for anything the program does."""
        data = stdin.encode() if isinstance(stdin, str) else stdin
        return self._run(self.info(), source, data, dict(files or {}), limits)

    def _run(self, info: SandboxInfo, source: str, stdin: bytes, files: dict[str, str | bytes],
             limits: SandboxLimits) -> SandboxResult:
        base = tempfile.mkdtemp(prefix="rollflow-sandbox-")
        process: subprocess.Popen | None = None
        start = time.monotonic()
        try:
            config = self._prepare(base, info, source, stdin, files, limits)
            config_path = os.path.join(base, "private", "config")
            with open(config_path, "wb") as out:
                marshal.dump(config, out)
            with open(os.path.join(base, "private", "stdin"), "rb") as stdin_file:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", LAUNCHER, config_path], stdin=stdin_file,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=base, env=_launcher_env(),
                    start_new_session=True, close_fds=True)
            stdout, stderr, ending = _collect(process, limits, start)
            if ending != "exited":
                _stop(process)
            _kill_group(process)  # stragglers of the fallback mode; nothing is left in namespace mode
            process.wait()
            report = _read_report(os.path.join(base, "private", "report"))
        finally:
            if process is not None and process.poll() is None:
                _kill_group(process)
                process.wait()
            shutil.rmtree(base, ignore_errors=True)
        return _result(ending, report, stdout, stderr, time.monotonic() - start, info.mode)

    def _prepare(self, base: str, info: SandboxInfo, source: str, stdin: bytes, files: dict[str, str | bytes],
                 limits: SandboxLimits) -> dict:
        os.chmod(base, 0o711)
        stage, work, private, root = (os.path.join(base, d) for d in ("stage", "work", "private", "root"))
        for folder in (stage, work, private, root):
            os.mkdir(folder, 0o700)
        for name, content in {**files, "main.py": source}.items():
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise ConfigError(f"sandbox file name '{name}' must be a plain file name (no folders)")
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(os.path.join(stage, name), mode) as out:
                out.write(content)
        with open(os.path.join(private, "stdin"), "wb") as out:
            out.write(stdin)
        uid = random.randrange(*UID_RANGE) if info.switches_uid else None
        home = WORK_IN_ROOT if info.mode == "namespaces" else work
        return {
            "mode": info.mode, "python": info.python, "uid": uid, "gid": uid, "work": work, "root": root,
            "stage": stage, "private": private, "argv": ["main.py"], "extra_dirs": _interpreter_prefix(info.python),
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home,
                    "PYTHONIOENCODING": "utf-8"},
            "limits": asdict(limits), "try_user_netns": info.mode == "fallback" and uid is None,
        }


def _interpreter_prefix(python: str) -> list[str]:
    """The interpreter's installation folder when it lies outside the system folders the sandbox root shows."""
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    inside = any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS)
    return [] if inside else [prefix]


def _launcher_env() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # start_new_session: the launcher's pid is the group id
    except (ProcessLookupError, PermissionError):
        pass


def _stop(process: subprocess.Popen, grace_seconds: float = 5.0) -> None:
    """Ask the launcher to kill the program (SIGTERM) and wait until it has reaped it; SIGKILL the whole group if
    it does not finish within ``grace_seconds``. In namespace mode, every process of the run is gone on return."""
    try:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=grace_seconds)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        _kill_group(process)


def _collect(process: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[bytes, bytes, str]:
    """Read stdout/stderr until both close, the wall time passes or a stream exceeds the cap.

    Returns ``(stdout, stderr, ending)`` with ending ``exited``, ``timeout`` or ``output_limit``. After the launcher
    exits, streams still held open by escaped processes are read for a short grace period only.
    """
    buffers = {process.stdout: bytearray(), process.stderr: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in buffers:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    deadline = start + limits.wall_seconds
    exited_at: float | None = None
    ending = "exited"
    try:
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                ending = "timeout"
                break
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
            for key, _ in selector.select(timeout=min(0.05, deadline - now)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.fileobj]
                buffer += chunk
                if len(buffer) > limits.max_output_bytes:
                    del buffer[limits.max_output_bytes:]
                    ending = "output_limit"
                    return bytes(buffers[process.stdout]), bytes(buffers[process.stderr]), ending
    finally:
        selector.close()
        process.stdout.close()
        process.stderr.close()
    if ending == "exited" and process.poll() is None:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            ending = "timeout"
    return bytes(buffers[process.stdout]), bytes(buffers[process.stderr]), ending


def _read_report(path: str) -> dict:
    try:
        with open(path, "rb") as report:
            return marshal.load(report)
    except (OSError, ValueError, EOFError, TypeError):
        return {}


def _result(ending: str, report: dict, stdout: bytes, stderr: bytes, wall: float, mode: str) -> SandboxResult:
    out, err = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    exit_code, sig = report.get("exit_code"), report.get("signal")
    if ending in ("timeout", "output_limit"):
        status = ending
    elif report.get("setup_error"):
        status, err = "sandbox_error", err + "\nsandbox setup failed: " + report["setup_error"]
    elif sig is not None:
        status = "signaled"
    elif exit_code is None:
        status = "sandbox_error"
        err += "\nsandbox launcher ended without a report"
    else:
        status = "ok" if exit_code == 0 else "exit_nonzero"
    return SandboxResult(status, exit_code, sig, out, err, wall, mode)


_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide sandbox in ``auto`` mode (probed on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Sandbox()
        return _DEFAULT


def run_python(source: str, stdin: str | bytes = b"", *, files: Mapping[str, str | bytes] | None = None,
               limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run untrusted ``source`` in the default sandbox (see :meth:`Sandbox.run_python`)."""
    return default_sandbox().run_python(source, stdin, files=files, limits=limits)


def sandbox_info() -> SandboxInfo:
    return default_sandbox().info()
