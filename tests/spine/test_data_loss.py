"""Commands that would destroy data are refused with nothing changed (issue 48): no command writes into a folder that
holds something it did not write, and none overwrites, nests into or contains an input of what it runs, with or
without ``--force`` (stages/outputs.py). Each case runs one command in-process, as the bad-input catalogue does
(tests/spine/test_bad_input_catalogue.py, whose fixtures it reuses: Ray and Prefect cannot start), and asserts exit 2,
one message naming the folder and the fix, every file under the working folder and the shared inputs unchanged byte
for byte, and no new folder.

The working folder of a case holds ``tbl/`` (a committed samples table), ``adv/`` (an advantages output whose recorded
inputs are ``tbl``), ``link`` (a symlink to ``tbl``), ``runs/quickstart`` (a run folder) and ``notes/`` (a user's
folder with a file).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tests.spine.test_bad_input import assert_user_error
from tests.spine.test_bad_input_catalogue import _argv, _fake_stage_output, no_services, shared  # noqa: F401

runner = CliRunner()

INPUT = "is the command's input"
INSIDE_INPUT = "lies inside the command's input"
CONTAINS_INPUT = "contains the command's input"
HOLDS = "did not write; it writes only into a new folder or its own earlier output, with or without --force"
IN_TABLE = "a table's folder holds its files and manifest only"

# id -> (argv, phrases); argv names the working folder's entries and the catalogue's shared inputs (@samples, ...)
CASES = {
    # rollflow stage --output --force: the stage's own recorded input (before: it overwrote it, and lineage showed a
    # table that reads itself), through a symlink, through `..`, inside it, around it, the --from folder itself
    "stage-force-output-is-its-input": (["stage", "advantages", "--from", "adv", "--set", "gamma=0.9", "--output",
                                         "tbl", "--force"], ["--output tbl", INPUT, "pass a new --output folder"]),
    "stage-force-output-symlink-to-its-input": (["stage", "advantages", "--from", "adv", "--output", "link",
                                                 "--force"], ["--output link", INPUT, "tbl"]),
    "stage-force-output-dotdot-to-its-input": (["stage", "advantages", "--from", "adv", "--output", "adv/../tbl",
                                                "--force"], [INPUT]),
    "stage-output-inside-its-input": (["stage", "advantages", "--from", "adv", "--output", "tbl/again", "--force"],
                                      [INSIDE_INPUT]),
    "stage-output-contains-its-input": (["stage", "advantages", "--from", "adv", "--output", ".", "--force"],
                                        [CONTAINS_INPUT]),
    "stage-output-is-the-from-folder": (["stage", "advantages", "--from", "adv", "--output", "adv", "--force"],
                                        ["--output adv", "is the command's input --from"]),
    "stage-output-holds-a-run": (["stage", "advantages", "--from", "adv", "--output", "runs/quickstart", "--force"],
                                 ["output runs/quickstart holds", HOLDS]),
    # rollflow stage / rollout --output --force on an output of the same stage that this command did not write: from
    # other inputs, from its input as it was before it changed, or a training run's own folder (before: replaced)
    "stage-force-output-same-stage-other-inputs": (["stage", "advantages", "--from", "adv", "--output", "other",
                                                    "--force"], ["output other holds a committed output of stage "
                                                                 "advantages", "from other inputs", "input 'rewarded'",
                                                                 HOLDS]),
    "stage-force-output-same-stage-changed-input": (["stage", "advantages", "--from", "adv", "--output", "stale",
                                                     "--force"], ["from other inputs", "before it changed", HOLDS]),
    "stage-force-output-is-a-runs-table": (["stage", "advantages", "--from", "adv", "--output",
                                            "runs/quickstart/iter_0001/advantaged", "--force"],
                                           ["what training run", "runs/quickstart", HOLDS]),
    "rollout-force-output-is-a-runs-rollout": (["rollout", "--config", "@rollout", "--output",
                                                "runs/quickstart/iter_0001/rollout", "--force"],
                                               ["what training run", "rollflow rollout did not write"]),
    "recompute-force-output-holds-its-tables-from-other-inputs": (["recompute", "--input", "tbl", "--config",
                                                                   "@gigpo", "--output", "rec", "--force"],
                                                                  ["rec/rewarded holds a committed output of stage "
                                                                   "response_rewards", "from other inputs", HOLDS]),
    # rollflow eval --output: a committed table (before: exit 0, its manifest replaced by the evaluation record)
    "eval-output-holds-a-committed-table": (["eval", "--config", "@quick", "--output", "tbl"],
                                            ["output tbl holds a committed output of stage example", HOLDS]),
    "eval-output-holds-a-users-files": (["eval", "--config", "@quick", "--output", "notes"],
                                        ["holds 'todo.txt'", "rollflow eval did not write"]),
    "eval-output-is-its-checkpoint": (["eval", "--config", "@quick", "--checkpoint", "@model", "--output",
                                       "@model"], [INPUT]),
    # rollflow rollout --output inside a committed table (before: its tables nested inside it, exit 0)
    "rollout-output-inside-a-committed-table": (["rollout", "--config", "@rollout", "--output", "tbl/rollout"],
                                                ["lies inside", "a committed output of stage example", IN_TABLE]),
    "rollout-output-holds-a-run": (["rollout", "--config", "@rollout", "--output", "runs"],
                                   ["holds 'quickstart'", "rollflow rollout did not write"]),
    "rollout-output-holds-a-committed-table": (["rollout", "--config", "@rollout", "--output", "tbl", "--force"],
                                               ["committed output of stage example", HOLDS]),
    "recompute-output-is-its-input": (["recompute", "--input", "tbl", "--config", "@gigpo", "--output", "tbl",
                                       "--force"], ["--output tbl", INPUT, "--input"]),
    "recompute-output-holds-another-table": (["recompute", "--input", "@samples", "--config", "@gigpo", "--output",
                                              "adv", "--force"], ["committed output of stage advantages", HOLDS]),
    "recompute-output-in-a-committed-table": (["recompute", "--input", "@samples", "--config", "@gigpo", "--output",
                                               "tbl/recomputed"], [IN_TABLE]),
    "score-output-holds-a-committed-table": (["score", "--input", "@responses", "--config", "@score_config",
                                              "--output", "tbl", "--force"], ["committed output of stage example"]),
    "score-output-is-its-input": (["score", "--input", "@responses", "--config", "@score_config", "--output",
                                   "@responses"], [INPUT]),
    "logprobs-output-is-its-samples": (["logprobs", "--samples", "tbl", "--checkpoint", "@model", "--output", "tbl",
                                        "--force"], ["--output tbl", INPUT, "--samples"]),
    "values-output-holds-another-table": (["values", "--samples", "@samples", "--checkpoint", "@model", "--output",
                                           "adv", "--force"], ["committed output of stage advantages"]),
    "train-step-output-inside-its-checkpoint": (["train-step", "--samples", "@advantaged", "--checkpoint", "@model",
                                                 "--output", "@model/next", "--force"], [INSIDE_INPUT]),
    "train-runs-dir-inside-a-committed-table": (["train", "--config", "@quick", "--set", "runs_dir=tbl"],
                                                ["run folder (runs_dir/run_name)", IN_TABLE]),
    # names that leave their folder (schemas/names.py): before, run_name '..' wrote config, logs and metrics into the
    # parent of runs_dir, and a very long one crashed with "File name too long" after creating folders
    "train-run-name-parent-folder": (["train", "--config", "@quick", "--set", "runs_dir=runs/inner", "--set",
                                      "run_name=.."], ["field 'run_name'", "'..' names the parent folder",
                                                       "use a short name"]),
    "train-run-name-too-long": (["train", "--config", "@quick", "--set", "run_name=" + "r" * 300],
                                ["field 'run_name'", "300 bytes long", "at most 255 bytes"]),
    "train-rlvr-run-name-itself": (["train", "--config", "@rlvr", "--set", "run_name=."],
                                   ["field 'run_name'", "'.' names the folder itself"]),
    "report-output-is-a-committed-table": (["report", "runs/quickstart", "--output", "tbl"],
                                           ["committed output of stage example", "rollflow report did not write"]),
    "demo-run-dir-is-a-committed-table": (["demo", "--run-dir", "tbl"], ["committed output of stage example",
                                                                       "rollflow demo did not write"]),
    "server-home-inside-a-committed-table": (["server", "--home", "tbl/prefect", "--port", "@port", "--timeout", "5"],
                                             ["--home tbl/prefect lies inside", IN_TABLE]),
    "example-output-inside-a-committed-table": (["example", "--output", "tbl/more", "--samples", "16"], [IN_TABLE]),
    "rlvr-example-output-inside-a-committed-table": (["rlvr-example", "--output", "tbl/more", "--limit", "1"],
                                                     [IN_TABLE]),
}


def tree_state(folder: str | Path) -> dict[str, str]:
    """Every entry under ``folder`` (hidden ones included, symlinks not followed): a file's sha256, a folder as
    ``dir``, a link as its target."""
    root, out = Path(folder), {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = (f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir()
                        else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture
def work(tmp_path, monkeypatch, no_services, shared) -> Path:  # noqa: F811
    monkeypatch.chdir(tmp_path)
    shutil.copytree(shared["samples"], tmp_path / "tbl")
    _fake_stage_output(tmp_path / "adv", {"samples": str(tmp_path / "tbl"), "rewarded": str(tmp_path / "tbl")})
    (tmp_path / "link").symlink_to(tmp_path / "tbl")
    # outputs of the same stages this command did not write: from other inputs, from tbl before it changed, a run's
    _fake_stage_output(tmp_path / "other", {"samples": str(tmp_path / "tbl"), "rewarded": shared["samples"]})
    _fake_stage_output(tmp_path / "stale", {"samples": str(tmp_path / "tbl"), "rewarded": str(tmp_path / "tbl")})
    _add_fingerprints(tmp_path / "stale", "0" * 64)
    (tmp_path / "runs" / "quickstart" / "iter_0001").mkdir(parents=True)
    _fake_stage_output(tmp_path / "runs" / "quickstart" / "iter_0001" / "advantaged",
                       {"samples": str(tmp_path / "tbl"), "rewarded": str(tmp_path / "tbl")})
    (tmp_path / "runs" / "quickstart" / "iter_0001" / "rollout" / "episodes").mkdir(parents=True)
    (tmp_path / "runs" / "quickstart" / "iter_0001" / "rollout" / "episodes" / "manifest.json").write_text(
        json.dumps({"stage": "rollout_reset", "inputs": {}, "state_in": {"checkpoint": "f" * 64}}))
    (tmp_path / "rec" / "rewarded").mkdir(parents=True)
    (tmp_path / "rec" / "rewarded" / "manifest.json").write_text(json.dumps(
        {"stage": "response_rewards", "inputs": {"samples": {"path": shared["samples"]}}}))
    (tmp_path / "runs" / "quickstart" / "metrics").mkdir(parents=True, exist_ok=True)
    (tmp_path / "runs" / "quickstart" / "config.json").write_text(json.dumps({"run_name": "quickstart"}))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me\n")
    return tmp_path


def _add_fingerprints(folder: Path, fingerprint: str) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["inputs"].values():
        entry["fingerprint"] = fingerprint
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_with_nothing_changed(case, work, shared):  # noqa: F811
    argv, phrases = CASES[case]
    argv = [a.replace("@model", shared["model"]) if a.startswith("@model/") else a for a in argv]
    inputs = {k: v for k, v in shared.items() if Path(v).is_dir()}
    before = {"work": tree_state(work), **{k: tree_state(v) for k, v in inputs.items()}}
    assert_user_error(runner.invoke(app, _argv(argv, shared)), phrases)
    after = {"work": tree_state(work), **{k: tree_state(v) for k, v in inputs.items()}}
    assert after == before, "every input byte for byte, and no new folder or file"


def test_own_earlier_output_and_new_folders_are_accepted(work):
    """What the check lets through: a new folder, an empty one, and the command's own earlier output (a re-run
    resumes or skips it; --force redoes it)."""
    from stages.outputs import EVAL_WRITES, Writes, check_output, stage_writes

    check_output(str(work / "new" / "deeper"), stage_writes("rollflow logprobs", "logprobs"), {"--samples": "tbl"})
    (work / "empty").mkdir()
    check_output(str(work / "empty"), EVAL_WRITES, {})
    check_output("adv", stage_writes("rollflow stage advantages", "advantages"), {"samples": "tbl"})
    (work / "ro" / "turns" / "turn_000").mkdir(parents=True)
    check_output(str(work / "ro"), Writes("rollflow rollout", (), {"episodes": (), "turns": (), "samples": ()}))


def test_an_output_of_the_same_stage_is_its_own_only_from_the_same_inputs(work):
    """An earlier output of the command's stage from the inputs it records (paths resolved, fingerprints as they are
    now) is its own: a re-run resumes or skips it, --force redoes it; so is a ``rollflow stage`` output inside a run
    folder (``<folder>@<tag>``). One from other inputs, or a run's own folder, is not."""
    from schemas.errors import ConfigError
    from stages.outputs import Writes, check_output, stage_writes
    from stages.storage import Location, folder_fingerprint

    writes = stage_writes("rollflow stage advantages", "advantages")
    same = {"samples": "tbl", "rewarded": "link"}  # the symlink resolves to tbl
    check_output("adv", writes, records=same)
    _add_fingerprints(work / "adv", folder_fingerprint(Location.of(str(work / "tbl"))))
    check_output("adv", writes, records=same)
    with pytest.raises(ConfigError, match="before it changed"):
        check_output("stale", writes, records=same)
    with pytest.raises(ConfigError, match="inputs"):
        check_output("adv", writes, records={"samples": "tbl"})
    rerun = work / "runs" / "quickstart" / "iter_0001" / "advantaged@abc123"
    shutil.copytree(work / "adv", rerun)
    check_output(str(rerun), writes, records=same)
    (work / "runs" / "quickstart" / "iter_0001" / "rollout@abc123" / "turns").mkdir(parents=True)
    check_output("runs/quickstart/iter_0001/rollout@abc123",
                 Writes("rollflow stage rollout_turn", (), {"episodes": (), "turns": (), "samples": ()}))
    (work / "runs" / "quickstart" / "iter_0002").mkdir()
    check_output("runs/quickstart/iter_0002", writes)  # empty: a new folder


def test_a_users_folder_beside_a_runs_iterations_resumes(work):
    """README's ``rollflow eval ... --output runs/<run>/eval_1``: a folder the user names beside the run's iteration
    folders is the user's; run again, the command finds its own earlier output and resumes. The run's own folders
    (inside ``iter_<k>``/``step_<k>``) are still refused."""
    from schemas.errors import ConfigError
    from stages.outputs import EVAL_WRITES, check_output

    child = sorted(EVAL_WRITES.children)[0]
    for folder in ("eval_1", "step_0003/validation"):
        (work / "runs" / "quickstart" / folder / child).mkdir(parents=True)
    check_output("runs/quickstart/eval_1", EVAL_WRITES)
    with pytest.raises(ConfigError, match="training run"):
        check_output("runs/quickstart/step_0003/validation", EVAL_WRITES)
