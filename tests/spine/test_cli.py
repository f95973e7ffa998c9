"""The ``rollflow`` command line: --help of every command, example, recompute (computed, then skipped), inspect,
validate, and ``stage`` re-running one stage with overrides (and its downstream stage) while keeping the old output.
Commands run in-process through Typer's runner (one Ray cluster for the session); the console script itself is
exercised with ``--help`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

from flows.cli import app
from tests.spine.helpers import GIGPO, GRPO, REPO, by_row_id, read_table, tree_digest

runner = CliRunner()
COMMANDS = ["recompute", "stage", "inspect", "validate", "example", "demo"]


def ok(args: list[str]) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, f"{args}: exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    return result.output


def fails(args: list[str], *phrases: str) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, f"{args}: exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    text = " ".join(result.output.split())
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in {result.output}"
    return text


# ---- help -------------------------------------------------------------------------------------------------------
def test_console_script_help():
    exe = Path(sys.executable).parent / "rollflow"
    top = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert top.returncode == 0, top.stderr
    for command in COMMANDS:
        assert command in top.stdout
    sub = subprocess.run([str(exe), "recompute", "--help"], capture_output=True, text=True, timeout=120)
    assert sub.returncode == 0 and "--input" in sub.stdout and "--output" in sub.stdout


@pytest.mark.parametrize("command,options", [
    ("recompute", ["--input", "--config", "--output", "--set", "--force"]),
    ("stage", ["NAME", "--from", "--set", "--output", "--downstream", "--force"]),
    ("inspect", ["PATH"]),
    ("validate", ["PATH", "--group-size"]),
    ("example", ["--output", "--samples", "--seed", "--group-size", "--env", "--level"]),
    ("demo", ["--run-dir", "--config"]),
])
def test_help_of_every_command(command, options):
    text = ok([command, "--help"])
    assert "Usage:" in text
    for option in options:  # arguments print as {name} or NAME depending on the Typer/Rich version
        assert option.lower() in text.lower(), f"{option} missing from `rollflow {command} --help`"


def test_no_command_prints_help():
    result = runner.invoke(app, [])
    assert "Usage:" in result.output and result.exit_code in (0, 2)


# ---- example ----------------------------------------------------------------------------------------------------
def test_example_is_deterministic_and_valid(tmp_path):
    args = ["--samples", 300, "--seed", 3, "--min-response", 8, "--max-response", 32]
    text = ok(["example", "--output", tmp_path / "a", *args])
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert f"wrote {manifest['rows']:,} step-level rows in {manifest['groups']:,} groups of 8" in text
    assert manifest["rows"] >= 300 and manifest["params"]["seed"] == 3
    ok(["example", "--output", tmp_path / "b", *args])
    a, b = read_table(tmp_path / "a"), read_table(tmp_path / "b")
    assert a.equals(b), "the same seed gives the same samples"
    ok(["example", "--output", tmp_path / "c", "--samples", 300, "--seed", 4, "--min-response", 8,
        "--max-response", 32])
    assert not read_table(tmp_path / "c").column("score").equals(a.column("score"))
    lengths = pc.list_value_length(a.column("response_mask")).to_numpy() - a.column("prompt_len").to_numpy()
    assert lengths.min() >= 8 and lengths.max() <= 32
    assert "complete groups of 8" in ok(["validate", tmp_path / "a"])
    fails(["example", "--output", tmp_path / "a"], "already exists")
    fails(["example", "--output", tmp_path / "d", "--env", "chess"], "--env must be frozenlake or sokoban")
    fails(["example", "--output", tmp_path / "d", "--group-size", "0"], "Invalid value for '--group-size'")
    fails(["example", "--output", tmp_path / "d", "--min-response", "9", "--max-response", "3"],
          "response_len (9, 3) must satisfy 0 <= min <= max")
    fails(["example", "--output", tmp_path / "d", "--samples", "0"], "Invalid value for '--samples'")
    assert not (tmp_path / "d").exists()


def test_example_trajectory_level_recomputes_with_grpo(tmp_path, ray_cluster):
    ok(["example", "--output", tmp_path / "s", "--samples", 200, "--seed", 9, "--env", "sokoban", "--level",
        "trajectory", "--min-response", 8, "--max-response", 24])
    samples = read_table(tmp_path / "s")
    assert (samples.column("turn_idx").to_numpy() == 0).all() and samples.column("state_hash").null_count == \
        samples.num_rows
    text = ok(["recompute", "--input", tmp_path / "s", "--config", GRPO, "--output", tmp_path / "out"])
    assert "table     advantaged" in text
    out = by_row_id(read_table(tmp_path / "out" / "advantaged"))
    # GRPO: per-group mean/std normalised episode returns, reward-to-go; every group's rewards centre on 0
    groups = out.group_by("group_id").aggregate([("response_level_rewards", "mean")])
    assert np.abs(groups.column(1).to_numpy()).max() < 1e-5
    manifest = json.loads((tmp_path / "out" / "advantaged" / "manifest.json").read_text())
    assert manifest["metrics"]["critic/kl_coef"] == 0.05 and manifest["metrics"]["critic/kl"] > 0


# ---- recompute, inspect, validate, stage --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_run(step_set, data_root, ray_cluster) -> tuple[Path, str]:
    out = data_root / "cli_run"
    text = ok(["recompute", "--input", step_set, "--config", GIGPO, "--output", out])
    return out, text


def test_recompute_prints_outputs_then_skips(cli_run, step_set):
    out, first = cli_run
    rows = read_table(step_set, ["row_id"]).num_rows
    assert f"rewarded    {out / 'rewarded'}  ({rows:,} rows, computed in" in first
    assert f"advantaged  {out / 'advantaged'}  ({rows:,} rows, computed in" in first
    assert "table     advantaged" in first and "stage metrics" in first
    before = tree_digest(out / "advantaged")
    again = ok(["recompute", "--input", step_set, "--config", GIGPO, "--output", out])
    assert again.count("up to date, skipped") == 2
    assert tree_digest(out / "advantaged") == before


def test_recompute_with_changed_config_needs_force(cli_run, step_set):
    out, _ = cli_run
    fails(["recompute", "--input", step_set, "--config", GIGPO, "--output", out, "--set", "advantage_clip=3"],
          "already holds output of stage advantages with another config", "pass --force")


def test_refused_rerun_clears_a_killed_attempts_temporary_folder(cli_run, step_set):
    """A run killed inside its second stage leaves that stage's temporary folder; a rerun with a changed config is
    refused at the first stage, and still removes it (it belongs to no run any more), touching no committed table."""
    out, _ = cli_run
    leftover = out / ".advantaged.tmp-99999-deadbeef"
    leftover.mkdir()
    (leftover / "part-00000.parquet").write_bytes(b"half a file")
    before = {name: tree_digest(out / name) for name in ("rewarded", "advantaged")}
    fails(["recompute", "--input", step_set, "--config", GIGPO, "--output", out,
           "--set", "reward_normalization.method=mean"], "already holds output of stage response_rewards",
          "pass --force")
    assert not leftover.exists()
    assert {name: tree_digest(out / name) for name in ("rewarded", "advantaged")} == before


def test_inspect(cli_run, step_set):
    out, _ = cli_run
    text = ok(["inspect", out / "advantaged"])
    rows = read_table(step_set, ["row_id"]).num_rows
    files = len(list(Path(step_set).glob("*.parquet")))  # the advantages stage writes a file per input file
    for phrase in ("table     advantaged", f"rows      {rows:,} in {files} file(s)", "stage     advantages v1",
                   "advantages: list<element: float>", "critic/kl =", "values (list columns", "list lengths"):
        assert phrase in text, phrase
    text = ok(["inspect", step_set])
    assert "table     samples" in text and "groups    " in text and "response tokens" in text
    assert "table     rewarded" in ok(["inspect", out / "rewarded"])
    fails(["inspect", out / "nothing"], "does not exist")


def test_validate(cli_run, step_set):
    out, _ = cli_run
    assert ok(["validate", out / "advantaged"]).startswith(f"OK  advantaged table {out / 'advantaged'}")
    assert "complete groups of 8" in ok(["validate", out / "advantaged", "--group-size", "8"])
    assert "complete groups of 8" in ok(["validate", step_set]), "group_size from the example's manifest"
    narrow = ok(["validate", out / "rewarded"])
    assert narrow.startswith("OK  rewarded table") and "groups" not in narrow and "turns" not in narrow
    fails(["validate", step_set, "--group-size", "5"], "expected group_size=5")


def test_stage_rerun_with_override_and_downstream_keeps_old_outputs(cli_run):
    out, _ = cli_run
    old = {name: tree_digest(out / name) for name in ("rewarded", "advantaged")}
    old_rewards = read_table(out / "rewarded")
    text = ok(["stage", "response_rewards", "--from", out / "rewarded", "--set", "reward_normalization.method=mean",
               "--downstream"])
    new_dirs = sorted(p for p in out.iterdir() if "@" in p.name)
    assert [p.name.split("@")[0] for p in new_dirs] == ["advantaged", "rewarded"]
    new_adv, new_rew = new_dirs
    assert new_adv.name.split("@")[1] == new_rew.name.split("@")[1]
    assert "response_rewards: wrote" in text and f"to {new_rew} (old output kept at {out / 'rewarded'})" in text
    assert "advantages: wrote" in text and str(new_adv) in text
    assert {name: tree_digest(out / name) for name in ("rewarded", "advantaged")} == old, "old outputs untouched"

    rew_manifest = json.loads((new_rew / "manifest.json").read_text())
    adv_manifest = json.loads((new_adv / "manifest.json").read_text())
    assert rew_manifest["section"]["reward_normalization"]["method"] == "mean"
    assert rew_manifest["section"]["reward_normalization"]["grouping"] == "traj_group_id"
    assert adv_manifest["inputs"]["rewarded"] == {"path": str(new_rew), "fingerprint": rew_manifest["fingerprint"]}
    assert adv_manifest["section"] == json.loads((out / "advantaged" / "manifest.json").read_text())["section"]
    new_rewards = read_table(new_rew)
    assert new_rewards.column("row_id").equals(old_rewards.column("row_id"))
    # mean only: episode rewards centred per group but not scaled, so they differ from mean_std's
    assert not np.allclose(new_rewards.column("episode_rewards_norm").to_numpy(),
                           old_rewards.column("episode_rewards_norm").to_numpy())
    episode = read_table(new_rew).append_column("group_id", read_table(out / "advantaged", ["group_id"]).column(0))
    means = episode.group_by("group_id").aggregate([("episode_rewards_norm", "mean")]).column(1).to_numpy()
    assert np.abs(means).max() < 1e-5
    assert by_row_id(read_table(new_adv)).column("response_level_rewards").equals(
        by_row_id(new_rewards).column("response_level_rewards"))

    # the same re-run again is up to date and rewrites nothing
    before = tree_digest(out)
    again = ok(["stage", "response_rewards", "--from", out / "rewarded", "--set", "reward_normalization.method=mean",
                "--downstream"])
    assert "response_rewards: up to date" in again and "advantages: up to date" in again
    assert tree_digest(out) == before


def test_stage_rerun_of_advantages_into_a_named_folder(cli_run, tmp_path):
    out, _ = cli_run
    target = tmp_path / "whitened"
    ok(["stage", "advantages", "--from", out / "advantaged", "--set", "whiten_advantages=true", "--output", target])
    adv = pc.list_flatten(read_table(target, ["advantages"]).column(0)).to_numpy()
    m = json.loads((target / "manifest.json").read_text())
    assert m["section"]["whiten_advantages"] is True and m["inputs"]["rewarded"]["path"] == str(out / "rewarded")
    assert not np.array_equal(adv, pc.list_flatten(read_table(out / "advantaged", ["advantages"]).column(0))
                              .to_numpy())


def test_stage_errors(cli_run, step_set):
    out, _ = cli_run
    fails(["stage", "nonsense", "--from", out / "rewarded"], "unknown stage 'nonsense'", "response_rewards")
    fails(["stage", "advantages", "--from", out / "rewarded"], "is not an output of stage advantages")
    fails(["stage", "response_rewards", "--from", step_set], "is not an output of stage response_rewards")
    fails(["stage", "response_rewards", "--from", out / "rewarded", "--set", "gamma=0.5"],
          "field 'gamma'", "unknown option")


# ---- pinned stages (recompute on a two-node Ray cluster, issue 14 item 3: tests/trainflow/test_async_rollout.py, on
# the cluster of its two-node training run, test_recompute_on_the_two_node_cluster_equals_the_local_run) -------------
def test_a_stage_pinned_to_a_resource_no_node_declares_is_refused(step_set, tmp_path, ray_cluster):
    """Ray would keep such a stage's tasks waiting forever: the command refuses before any stage, with the fix."""
    text = fails(["recompute", "--input", step_set, "--config", GIGPO, "--output", tmp_path / "out", "--set",
                  "runtime.stage_resources={advantages: {gpu_node: 1}}"],
                 "runtime.stage_resources.advantages asks for the custom Ray resource 'gpu_node', which no node of "
                 "the cluster declares", "ray start --resources='{\"gpu_node\": 1}'")
    assert not (tmp_path / "out").exists(), text
