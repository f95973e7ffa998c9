"""The line an interrupted command prints (flows/interrupt.py); the end-to-end case — Ctrl-C to a running command's
process group, exit 130, the resume — is tests/spine/test_resume.py."""

from __future__ import annotations

import os

from flows.interrupt import shown, summary_line


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
