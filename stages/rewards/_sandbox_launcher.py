"""Sandbox launcher: run by :mod:`stages.rewards.sandbox` as ``python -I -S -B _sandbox_launcher.py CONFIG``.

``CONFIG`` is a file holding a ``marshal``-ed dict; the report is written the same way (``marshal`` is built in:
no import cost, which is most of this process's start-up). Standard library only. It forks once:

* the child isolates itself, drops privileges and ``exec``s the untrusted Python program;
* the launcher waits for it and writes ``report`` (exit status, or the setup error) into the private folder,
  which the untrusted program cannot reach.

``mode == "namespaces"`` (root with ``CAP_SYS_ADMIN``): new mount, network, PID, IPC and UTS namespaces. The child is
PID 1 of the new PID namespace (every process of the run dies with it); it builds a minimal root (system folders
read-only, a size-limited tmpfs ``/work`` with the staged files, four devices, a fresh ``/proc``), chroots into it
and starts the program as PID 2 with resource limits, an unprivileged uid/gid, ``no_new_privs``, a parent-death
signal and an empty environment.
``mode == "fallback"``: no namespaces; resource limits, uid switch when root, parent-death signal, and an audit-hook
guard in the interpreter that refuses sockets and signals to other processes (weaker: ctypes can bypass it).
"""

import ctypes
import marshal
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SETUP_FAILED = 125

# Runs before the untrusted program in fallback mode: refuse network and signals to other processes.
GUARD = """
import sys, os, runpy
def _rollflow_guard(event, args, _own=os.getpid):
    if event.startswith("socket.") and event not in ("socket.gethostname",):
        raise PermissionError("network is disabled in the rollflow sandbox")
    if event in ("os.kill", "os.killpg") and args[0] not in (0, _own()):
        raise PermissionError("signals to other processes are disabled in the rollflow sandbox")
sys.addaudithook(_rollflow_guard)
del _rollflow_guard
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "%s: %s" % (what, os.strerror(errno)))


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), "mount " + target)


SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "random", "urandom")
WORK_IN_ROOT = "/work"


def _expose(path, root):
    """Make ``path`` visible read-only under ``root`` (a symlink is recreated as a symlink)."""
    if not os.path.lexists(path):
        return
    target = root + path
    os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
        return
    os.makedirs(target, 0o755, exist_ok=True)
    _mount(path, target, None, MS_BIND)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _build_root(cfg, staged):
    """A minimal root: system folders and the interpreter's prefix read-only, four devices, a fresh /proc and a
    size-limited tmpfs ``/work`` holding the staged files; nothing else of the host (no /tmp, /home, /root, repo)."""
    root = cfg["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in SYSTEM_DIRS + tuple(cfg["extra_dirs"]):
        _expose(path, root)
    os.mkdir(root + "/dev", 0o755)
    for name in DEVICES:
        open(root + "/dev/" + name, "w").close()
        _mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    os.mkdir(root + "/proc", 0o555)
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # some container runtimes refuse a new /proc: the program then has none
    work = root + WORK_IN_ROOT
    os.mkdir(work, 0o700)
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=0700" % cfg["limits"]["workdir_mb"])
    _write_files(work, staged, cfg)
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir(WORK_IN_ROOT)


def _read_staged(cfg):
    staged = {}
    for name in os.listdir(cfg["stage"]):
        with open(os.path.join(cfg["stage"], name), "rb") as source:
            staged[name] = source.read()
    return staged


def _write_files(work, staged, cfg):
    for name, content in staged.items():
        with open(os.path.join(work, name), "wb") as target:
            target.write(content)
    if cfg["uid"] is not None:
        for name in list(staged) + ["."]:
            os.chown(os.path.join(work, name), cfg["uid"], cfg["gid"])
    os.chmod(work, 0o700)


def _set_limits(limits, nproc):
    mib = 1024 * 1024
    pairs = [
        (resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1)),
        (resource.RLIMIT_AS, (limits["memory_mb"] * mib,) * 2),
        (resource.RLIMIT_FSIZE, (limits["max_file_mb"] * mib,) * 2),
        (resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if nproc is not None:
        pairs.append((resource.RLIMIT_NPROC, (nproc, nproc)))
    for which, value in pairs:
        resource.setrlimit(which, value)


def _own_process_count(uid):
    count = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat("/proc/" + pid).st_uid == uid:
                count += 1
        except OSError:
            pass
    return count


def _map_own_ids(uid, gid):
    """Inside a fresh user namespace, keep our own uid/gid (so file ownership and RLIMIT_NPROC read the same)."""
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as out:
            out.write(text)


def _exec_program(cfg):
    """Limits, unprivileged ids, no_new_privs, parent-death signal, then exec the program (never returns)."""
    limits, uid = cfg["limits"], cfg["uid"]
    # RLIMIT_NPROC counts every process of the real uid: without a fresh uid, leave room for those already running
    _set_limits(limits, limits["max_processes"] if uid is not None else cfg["own_processes"] + limits["max_processes"])
    if uid is not None:
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(uid, uid, uid)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")  # after setuid: it resets
    python = cfg["python"]
    argv = [python, "-I", "-S", "-B"] + ([] if cfg["mode"] == "namespaces" else ["-c", GUARD]) + cfg["argv"]
    os.execve(python, argv, cfg["env"])


def _guarded(step, pipe):
    """Run ``step``; any exception before exec is a setup failure, reported through ``pipe``."""
    try:
        step()
    except BaseException as error:  # noqa: BLE001
        os.write(pipe, ("setup_error %s: %s\n" % (type(error).__name__, error)).encode()[:4000])
    os._exit(SETUP_FAILED)


def _namespace_init(cfg, pipe):
    """PID 1 of the new PID namespace: isolate, start the program as PID 2, reap until it ends, report its status.

    The program is not PID 1 itself because the kernel ignores default-action signals (SIGXCPU, and SIGKILL from
    inside the namespace) sent to PID 1; when this process exits, every process left in the namespace is killed.
    """
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    staged = _read_staged(cfg)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    _build_root(cfg, staged)  # in the child: the launcher keeps the parent's mounts and can write the report
    program = os.fork()
    if program == 0:
        _guarded(lambda: _exec_program(cfg), pipe)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if pid == program:
            break
    if os.WIFSIGNALED(status):
        os.write(pipe, ("signal %d\n" % os.WTERMSIG(status)).encode())
    else:
        os.write(pipe, ("exit %d\n" % os.WEXITSTATUS(status)).encode())
    os._exit(0)


def _fallback_child(cfg):
    _write_files(cfg["work"], _read_staged(cfg), cfg)
    os.chdir(cfg["work"])
    _exec_program(cfg)


def main():
    with open(sys.argv[1], "rb") as config:
        cfg = marshal.load(config)
    report = {"setup_error": None, "exit_code": None, "signal": None}
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    cfg["own_processes"] = _own_process_count(os.getuid()) if cfg["uid"] is None else 0
    outer_uid, outer_gid = os.getuid(), os.getgid()
    try:
        if cfg["mode"] == "namespaces":
            _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # the forked child is PID 1 there
        elif cfg.get("try_user_netns") and _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            _map_own_ids(outer_uid, outer_gid)  # non-root: loopback-only network
    except OSError as error:
        report["setup_error"] = str(error)
        return _write_report(cfg, report)
    read_end, write_end = os.pipe()  # not inherited across exec: only the launcher's processes can write to it
    child = os.fork()
    if child == 0:
        os.close(read_end)
        if cfg["mode"] == "namespaces":
            _guarded(lambda: _namespace_init(cfg, write_end), write_end)
        _guarded(lambda: _fallback_child(cfg), write_end)
    os.close(write_end)
    # SIGTERM from the parent (wall time or output limit): kill our child and report as usual. In namespace mode
    # the child is PID 1 of the namespace, whose exit kills and reaps every process in it before waitpid returns.
    signal.signal(signal.SIGTERM, lambda signum, frame: _kill_quietly(child))
    messages = b""
    while True:
        chunk = os.read(read_end, 4096)
        if not chunk:
            break
        messages += chunk
    _, status = os.waitpid(child, 0)
    for line in messages.decode(errors="replace").splitlines():
        kind, _, value = line.partition(" ")
        if kind == "setup_error":
            report["setup_error"] = value
        elif kind in ("exit", "signal"):
            report["exit_code" if kind == "exit" else "signal"] = int(value)
    if report["setup_error"] is None and report["exit_code"] is None and report["signal"] is None:
        if os.WIFSIGNALED(status):
            report["signal"] = os.WTERMSIG(status)
        else:
            report["exit_code"] = os.WEXITSTATUS(status)
    return _write_report(cfg, report)


def _kill_quietly(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _write_report(cfg, report):
    with open(os.path.join(cfg["private"], "report"), "wb") as out:
        marshal.dump(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
