"""The line an interrupted command prints (flows/interrupt.py); the end-to-end case — Ctrl-C to a running command's
process group, exit 130, the resume — is tests/spine/test_resume.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from flows.interrupt import shown, summary_line

REPO = str(Path(__file__).resolve().parents[2])


def test_the_line_says_what_is_committed_and_how_to_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert summary_line([], "rollflow recompute --input a --output b") == \
        "interrupted: nothing committed; resume with rollflow recompute --input a --output b"
    done = [str(tmp_path / "runs/q/eval_base/samples"), str(tmp_path / "runs/q/iter_0000/rollout/samples"),
            str(tmp_path / "runs/q/eval_base/samples"), str(tmp_path / "runs/q/iter_0000/logprobs")]
    assert summary_line(done, "rollflow train --resume runs/q") == (
        "interrupted: 3 output(s) committed (the last: runs/q/iter_0000/rollout/samples, runs/q/iter_0000/logprobs); "
        "resume with rollflow train --resume runs/q")


def test_paths_are_shown_from_the_working_folder_when_inside_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shown(str(tmp_path / "out" / "rewarded")) == os.path.join("out", "rewarded")
    assert shown("/elsewhere/out") == "/elsewhere/out"
    assert shown("s3://bucket/runs/q") == "s3://bucket/runs/q"


SERVING = """
import sys, time
from flows import interrupt
interrupt.install(["server"])
interrupt.keep_keyboard_interrupt()
try:
    print("ready", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("stopping the server", flush=True)
    time.sleep(1.5)  # longer than the wakeup watcher waits for the main thread's handler
    print("stopped", flush=True)
"""


def test_a_serving_command_keeps_its_own_ctrl_c(tmp_path):
    """rollflow server and deploy stop serving on KeyboardInterrupt: the handler of the other commands (and its
    wakeup watcher) must not end them first."""
    proc = subprocess.Popen([sys.executable, "-c", SERVING], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO}, start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, out) == (0, "stopping the server\nstopped\n")
