"""``rollflow stage train_step`` / ``eval``: re-running an iteration's training step with changed settings (a new
checkpoint beside the old one) and, with ``--downstream``, the evaluation that read it. Fast tests of the refusals
(no Ray, no model) and the evaluation's own manifest. The end-to-end re-run of a training step with another learning
rate through its evaluation runs on the default model in tests/scenarios/test_default_model.py; the walk from the
log-probs through the training step and the evaluation on tests/trainflow/test_train_flow.py's finished tiny run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from schemas.errors import RollflowError
from stages.commit import commit_record
from stages.storage import Location

runner = CliRunner()


def _fails(args: list, *phrases: str) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, f"{args}: exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    text = " ".join(result.output.split())
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in {result.output}"
    assert "Traceback" not in result.output
    return text


def _fake_output(folder: Path, manifest: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _fake_train_step(folder: Path, samples: Path, checkpoint: Path) -> Path:
    from schemas.train_config import TrainSection

    return _fake_output(folder, {
        "stage": "train_step", "version": "1", "section": TrainSection().model_dump(mode="json"),
        "inputs": {"samples": {"path": str(samples), "fingerprint": "x"},
                   "checkpoint": {"path": str(checkpoint), "fingerprint": "y"}},
        "state_in": {"checkpoint": "y"}, "state": {"world_size": 1}, "fingerprint": "z"})


def test_unknown_stage_lists_the_rerunnable_ones_and_says_how_to_redo_a_rollouts_samples(tmp_path):
    text = _fails(["stage", "rollout_samples", "--from", tmp_path], "unknown stage 'rollout_samples'", "train_step",
                  "eval", "logprobs", "rollout_turn, rollout_reset",
                  "rollflow stage rollout_turn --from <rollout>/turns/turn_<last>", "rollflow train --config FILE")
    assert "rlvr_generate" in text


def test_a_folder_that_is_not_a_training_step_output_is_refused(tmp_path):
    advantaged = _fake_output(tmp_path / "advantaged", {"stage": "advantages", "section": {}, "inputs": {}})
    _fails(["stage", "train_step", "--from", advantaged], "is not an output of stage train_step",
           "it holds an output of stage advantages", "runs/<run>/iter_0000/checkpoint")
    plain = tmp_path / "plain"
    plain.mkdir()
    _fails(["stage", "train_step", "--from", plain], "is not an output of stage train_step", "no manifest.json")
    _fails(["stage", "train_step", "--from", tmp_path / "nope"], "it is not a folder")
    _fails(["stage", "eval", "--from", advantaged], "is not an output of stage eval")


def test_a_training_step_override_is_checked_before_anything_runs(tmp_path):
    old = _fake_train_step(tmp_path / "checkpoint", tmp_path / "advantaged", tmp_path / "base")
    _fails(["stage", "train_step", "--from", old, "--set", "actor_train.training_args.learning_rat=1e-4"],
           "learning_rat")
    _fails(["stage", "train_step", "--from", old, "--set", "actor_train.training_args.learning_rate=-1"],
           "learning_rate")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"], "nothing written"


def test_an_evaluation_record_is_written_last_kept_when_current_and_replaced_when_not(tmp_path):
    parts = tmp_path / "eval"
    (parts / "samples").mkdir(parents=True)
    out = Location.of(str(parts))
    calls = []

    def build():
        calls.append(1)
        return {"stage": "eval", "inputs": {}}

    manifest, skipped = commit_record(out, "f1", build)
    assert not skipped and manifest["fingerprint"] == "f1" and calls == [1]
    assert json.loads((parts / "manifest.json").read_text())["fingerprint"] == "f1"
    assert commit_record(out, "f1", build)[1] and calls == [1], "up to date: not rebuilt"
    (parts / ".manifest.json.tmp-1-dead").write_text("{")  # a killed earlier write
    manifest, skipped = commit_record(out, "f2", build)
    assert not skipped and json.loads((parts / "manifest.json").read_text())["fingerprint"] == "f2"
    assert sorted(p.name for p in parts.iterdir()) == ["manifest.json", "samples"]
    with pytest.raises(RollflowError, match="missing"):
        commit_record(Location.of(str(tmp_path / "none")), "f", build)


def test_pruning_leaves_re_run_checkpoints_and_the_originals_alone(tmp_path):
    from stages.train.checkpoint import prune_checkpoints

    for name, created in (("checkpoint", 1.0), ("checkpoint@abcd1234", 2.0)):
        _fake_output(tmp_path / name, {"stage": "train_step", "state": {"global_step": 1}, "created_unix": created})
    assert prune_checkpoints(Location.of(str(tmp_path)), 1) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint@abcd1234"]


def test_a_walk_from_a_re_run_output_reaches_the_re_runs_that_read_it_and_one_from_an_original_does_not(tmp_path):
    from flows.restage import affected as _affected

    def out(name: str, reads: str | None = None, stage: str = "eval") -> None:
        inputs = {"checkpoint": {"path": str(tmp_path / reads), "fingerprint": "f"}} if reads else {}
        _fake_output(tmp_path / name, {"stage": stage, "inputs": inputs})

    out("checkpoint", stage="train_step")
    out("eval", "checkpoint")
    out("checkpoint@a", stage="train_step")
    out("eval@a", "checkpoint@a")
    out("eval@b", "checkpoint")  # an earlier re-run of the evaluation alone, with other settings
    assert sorted(_affected(Location.of(str(tmp_path / "checkpoint")))) == [str(tmp_path / "eval")]
    assert sorted(_affected(Location.of(str(tmp_path / "checkpoint@a")))) == [str(tmp_path / "eval@a")]


def test_a_walk_from_a_rollout_starts_at_its_samples_among_the_outputs_beside_the_rollout_folder(tmp_path):
    """The layout of a training iteration (the manifests' inputs as the agentic flow records them): a replay of
    ``rollout`` re-runs what read ``rollout/samples`` beside the rollout folder — log-probs, values, rewards,
    advantages, the training step and the evaluation of its checkpoint — and not an earlier replay's outputs; a walk
    from that replay (``rollout@a``) reaches the outputs that read its samples."""
    from flows.restage import affected as _affected

    def out(name: str, stage: str, **reads: str) -> None:
        inputs = {key: {"path": str(tmp_path / path), "fingerprint": "f"} for key, path in reads.items()}
        _fake_output(tmp_path / name, {"stage": stage, "inputs": inputs})

    for replay in ("", "@a"):
        out(f"rollout{replay}/turns/turn_000", "rollout_turn", previous=f"rollout{replay}/episodes")
        out(f"rollout{replay}/samples", "rollout_samples", turn_000=f"rollout{replay}/turns/turn_000")
        out(f"logprobs{replay}", "logprobs", samples=f"rollout{replay}/samples")
    out("values", "values", samples="logprobs")
    out("rewarded", "response_rewards", samples="values")
    out("advantaged", "advantages", samples="values", rewarded="rewarded")
    out("checkpoint", "train_step", samples="advantaged", checkpoint="base")
    out("eval", "eval", checkpoint="checkpoint")
    out("eval_base", "eval", checkpoint="base")
    rollout = Location.of(str(tmp_path / "rollout"))
    assert sorted(_affected(rollout, rollout.child("samples").path)) == [
        str(tmp_path / n) for n in ("advantaged", "checkpoint", "eval", "logprobs", "rewarded", "values")]
    replay = Location.of(str(tmp_path / "rollout@a"))
    assert sorted(_affected(replay, replay.child("samples").path)) == [str(tmp_path / "logprobs@a")]


def test_lineage_compares_a_base_model_folder_as_its_readers_fingerprint_it(tmp_path):
    """A training step (or evaluation) of the first iteration read the base model, a plain model folder: it records
    the folder's checkpoint fingerprint (its files), and lineage compares with the same, so it is not stale; a
    replaced weight file makes it stale."""
    from flows.lineage import lineage_lines
    from stages.train.checkpoint import checkpoint_fingerprint

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"w")
    step = _fake_train_step(tmp_path / "run/checkpoint", tmp_path / "run/missing", base)
    m = json.loads((step / "manifest.json").read_text())
    m["inputs"]["checkpoint"]["fingerprint"] = checkpoint_fingerprint(str(base))
    m["inputs"].pop("samples")
    (step / "manifest.json").write_text(json.dumps(m))
    assert "none is stale" in "\n".join(lineage_lines(str(tmp_path / "run")))
    (base / "model.safetensors").write_bytes(b"ww")
    assert "input 'checkpoint'" in "\n".join(lineage_lines(str(tmp_path / "run")))
