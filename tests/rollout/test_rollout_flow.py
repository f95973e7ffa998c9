"""The rollout as committed Ray Data stages with the HF backend on the tiny random model (plumbing, not quality):
it writes every table, samples validate, a re-run skips everything without building an engine, a rollout
killed in the middle of a turn resumes to the same samples as an uninterrupted one, a rollout into an object store
(a local S3 server) commits the same tables, and ``show`` renders it.

The tiny random model writes garbage, so every reply is unparseable: that exercises the format penalty path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import typer
import yaml
from typer.testing import CliRunner

from flows.cli import app as rollflow_app
from schemas.config import load_config
from schemas.rollout_config import RolloutConfig
from schemas.tables import SAMPLES, check_row_invariants, check_structure
from stages.storage import Location, read_manifest
from tests.objstore import BUCKET, objects, s3  # noqa: F401  (s3: the module's S3 server, a fixture)

pytestmark = pytest.mark.usefixtures("ray_cluster")  # the CLI commands join it, as they join a running one

CONFIG = {"sample_level": "step", "sequence_length": 1024, "seed": 7,
          "env": {"num_env_groups": 2, "group_size": 2, "max_steps": 3},
          "generating_args": {"max_new_tokens": 8, "temperature": 1.0},
          "engine": {"backend": "hf", "dtype": "float32", "threads": 1, "options": {"max_batch_size": 8}},
          "runtime": {"num_cpus": 2}}

CHILD = """
import sys
from flows import settings
settings.configure()
from schemas.config import load_config
from schemas.rollout_config import RolloutConfig
from stages.cluster import ensure_ray
from stages.rollout.driver import run_rollout
if __name__ == "__main__":
    ensure_ray(num_cpus=2, progress=False)  # joins the cluster at RAY_ADDRESS
    run_rollout(load_config(RolloutConfig, sys.argv[1]), sys.argv[3], sys.argv[2])
"""


def _app() -> typer.Typer:
    return rollflow_app


def _table(folder: Path) -> pa.Table:
    files = Location.of(str(folder)).parquet_files()
    return pads.dataset(files).to_table().sort_by("row_id" if "row_id" in pads.dataset(files).schema.names
                                                  else "traj_id")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "rollout.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@dataclass(frozen=True)
class Rollouts:
    """The module's two full rollouts of ``CONFIG``: one uninterrupted, one killed in turn 2 and resumed."""

    uninterrupted: Path  # its output folder
    killed: Path  # the killed rollout's output folder, resumed
    partial: str  # ``show`` of the killed rollout before the resume (what was committed so far)
    turn_001_committed: bool  # at the kill
    turn_002_committed: bool
    resumed: object  # the resume's RolloutResult
    leftovers: list[str]  # the temporary folders left in turns/ after the resume


def _wait_for_tmp_of_turn(out: Path, turn: int, proc: subprocess.Popen, limit: float = 300.0) -> None:
    turns = out / "turns"
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the rollout finished before turn {turn} could be interrupted")
        if turns.exists() and any(p.name.startswith(f".turn_{turn:03d}.tmp-") for p in turns.iterdir()):
            return
        time.sleep(0.02)
    raise AssertionError(f"turn {turn} did not start within {limit} s")


def _kill_in_turn_2(out: Path, config_file: Path, tiny_model: Path) -> None:
    """A rollout's driver in a child process, on the session's Ray cluster as a driver on a shared cluster (not a
    cluster of its own: about 18 CPU-s of Ray's start-up), SIGKILLed while turn 2 is written; Ray ends its job's
    engine and tasks with it (waited for: they must not write into the folder the resume cleans)."""
    import ray

    from tests.processes import ray_jobs, wait_ray_jobs_gone

    repo = Path(__file__).resolve().parents[2]
    env, jobs = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}, ray_jobs()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(config_file), str(tiny_model), str(out)], cwd=repo,
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_tmp_of_turn(out, 2, proc)  # turn 2 is being written: turns 0 and 1 are committed
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver's whole session
        proc.wait()
    wait_ray_jobs_gone(jobs)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, config_file, tiny_model, ray_cluster) -> Rollouts:
    """The killed rollout first (its child's engine ends with it), then ONE engine pool in this process
    (``run_rollout(pool=...)``, as a training flow passes its own) for the uninterrupted rollout and the killed one's
    resume: an engine actor's start (about 6 CPU-s) less than a pool each. Two engines at once would hold both CPUs
    of the session's cluster, so the pool is closed before the other tests build theirs. ``rollflow rollout`` as a
    command (its own pool, its console) is the object-store test's."""
    from schemas.rollout_config import turn_section
    from stages.rollout.driver import resolve_model_dir, run_rollout
    from stages.rollout.engine_pool import EnginePool
    from stages.rollout.show import render_rollout

    root = tmp_path_factory.mktemp("run")
    killed = tmp_path_factory.mktemp("killed") / "b"
    _kill_in_turn_2(killed, config_file, tiny_model)
    committed = [read_manifest(Location.of(str(killed / "turns" / t))) is not None for t in ("turn_001", "turn_002")]
    partial = render_rollout(str(killed), episodes=1)  # show reads what is committed so far

    cfg = load_config(RolloutConfig, config_file)
    pool = EnginePool(cfg.engine, resolve_model_dir(str(tiny_model)), turn_section(cfg).engine.max_model_len)
    try:
        run_rollout(cfg, str(root / "a"), str(tiny_model), pool=pool)
        resumed = run_rollout(cfg, str(killed), str(tiny_model), pool=pool)
    finally:
        pool.close()
    leftovers = [p.name for p in (killed / "turns").iterdir() if p.name.startswith(".turn_")]
    return Rollouts(root / "a", killed, partial, *committed, resumed, leftovers)


@pytest.fixture(scope="module")
def uninterrupted(rollouts) -> Path:
    return rollouts.uninterrupted


def test_rollout_commits_every_table_and_valid_samples(uninterrupted):
    for name in ("episodes", "turns/turn_000", "turns/turn_001", "turns/turn_002", "samples"):
        assert read_manifest(Location.of(str(uninterrupted / name))) is not None, name
    assert not (uninterrupted / "turns" / "turn_003").exists()
    samples = _table(uninterrupted / "samples")
    SAMPLES.check_schema(samples.schema, "test", ("state_hash", "infer_logprobs", "prompt_len"))
    check_row_invariants(SAMPLES, samples, "test")
    check_structure(samples, "test", group_size=2)
    assert samples.num_rows == 4 * 3  # garbage replies never end an episode early: 4 episodes x max_steps
    # every reply was unparseable: the format penalty is the reward, recorded in the turn rows
    turns = pa.concat_tables([_table(uninterrupted / "turns" / f"turn_{t:03d}") for t in range(3)])
    assert not any(turns.column("action_valid").to_pylist())
    assert turns.column("format_penalty").to_pylist() == pytest.approx([-0.01] * 12)
    assert turns.column("reward").to_pylist() == pytest.approx([-0.01] * 12)
    assert samples.column("score").to_pylist() == pytest.approx([-0.01] * 12)
    assert samples.column("episode_score").to_pylist() == pytest.approx([-0.03] * 12)
    assert set(turns.column("finish_reason").to_pylist()) <= {"stop", "length"}
    cut = turns.filter(pa.compute.field("finish_reason") == "length")
    assert all(len(ids) == 8 for ids in cut.column("response_ids").to_pylist())  # cut at max_new_tokens
    assert all(cut.column("response_truncated").to_pylist())
    metrics = read_manifest(Location.of(str(uninterrupted / "samples")))["metrics"]
    assert metrics["rollout/format_penalty_rate"] == 1.0 and metrics["rollout/episodes"] == 4
    assert metrics["env/FrozenLake/num_actions"] == 3


def test_rerun_skips_every_stage_and_builds_no_engine(uninterrupted, config_file, tiny_model):
    from stages.rollout.driver import run_rollout

    result = run_rollout(load_config(RolloutConfig, config_file), str(uninterrupted), str(tiny_model))
    assert result.episodes.skipped and all(t.skipped for t in result.turns) and result.samples.skipped
    assert result.engine_build_seconds == 0.0


def test_a_rollout_into_an_object_store_commits_the_same_tables(uninterrupted, config_file, tiny_model, s3):
    """``rollflow rollout --output s3://...`` (a local moto S3 server; docs/object-storage.md): every table committed
    by its manifest under an attempt prefix on the store (the driver once handed the stages bare bucket paths, which
    landed in a local folder named after the bucket), the samples equal to the local rollout's. The module's one run
    of the command (its pre-flight, its own engine pool, its console: a line per turn and the metrics)."""
    uri = f"s3://{BUCKET}/rollout"
    args = ["rollout", "--config", str(config_file), "--checkpoint", str(tiny_model), "--output", uri]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    assert "turn   3:" in result.output and "rollout/format_penalty_rate" in result.output
    for name in ("episodes", "turns/turn_000", "turns/turn_002", "samples"):
        manifest = read_manifest(Location.of(f"{uri}/{name}"))
        local = read_manifest(Location.of(str(uninterrupted / name)))
        assert manifest is not None and manifest["fingerprint"] == local["fingerprint"], name
        assert all(key.startswith(".attempt-") or key == "manifest.json" for key in objects(f"{uri}/{name}")), name
    loc = Location.of(f"{uri}/samples")
    got = pa.concat_tables([pq.read_table(p, filesystem=loc.fs) for p in loc.parquet_files()])
    assert got.sort_by("row_id").equals(_table(uninterrupted / "samples"))
    assert not Path(BUCKET).exists(), "nothing written to a local folder named after the bucket"


def test_show_renders_episodes_turn_by_turn(uninterrupted):
    result = CliRunner().invoke(_app(), ["show", str(uninterrupted), "--episodes", "2", "--max-text", "30"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.count("episode FrozenLake_") == 2 and out.count("  turn 3") == 2
    assert "format penalty -0.01" in out and "reward: -0.01" in out and "ended: max_steps" in out
    grid = [line.strip() for line in out.splitlines() if line.strip() and set(line.strip()) <= set("_OGP")]
    assert grid and all(len(line) == 4 for line in grid)


def test_cli_reports_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**CONFIG, "env": {**CONFIG["env"], "tag": "NoSuchGame"}}))
    result = CliRunner().invoke(_app(), ["rollout", "--config", str(bad), "--output", str(tmp_path / "o")])
    assert result.exit_code == 2 and "NoSuchGame" in result.output and "FrozenLake" in result.output


def test_rollout_killed_mid_turn_resumes_to_the_same_samples(rollouts):
    """The rollout's driver, on the session's Ray cluster as a driver on a shared cluster, SIGKILLed while turn 2 is
    written (``rollouts``); Ray ends its job's engine and tasks with it. The same rollout again, in this process,
    skips the committed turns, cleans the killed one's temporary folder and gives the uninterrupted rollout's
    tables."""
    assert rollouts.turn_001_committed and not rollouts.turn_002_committed
    partial = rollouts.partial
    assert "2 turn table(s)" in partial and "still running" in partial and "  turn 2" in partial
    result = rollouts.resumed
    assert result.episodes.skipped and [t.skipped for t in result.turns] == [True, True, False]
    assert not rollouts.leftovers  # leftovers cleaned
    for name in ("turns/turn_000", "turns/turn_001", "turns/turn_002", "samples"):
        assert _table(rollouts.killed / name).equals(_table(rollouts.uninterrupted / name)), name


# ---- rollflow stage rollout_turn: a replay from a turn of this rollout (with a changed setting and --downstream in
# a training run's iteration: tests/trainflow/test_rerun_train.py) ------------------------------------------------

def _stage(*args) -> str:
    result = CliRunner().invoke(_app(), ["stage", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.parquet"))}


def _replay(output: str) -> Path:
    """The rollout folder a replay wrote, from its first line ("rollout_turn: wrote N rows to <folder>/samples")."""
    line = output.splitlines()[0]
    assert line.startswith("rollout_turn: "), output
    return Path(line.split(" rows to ")[1].split(" ")[0]).parent


def test_replay_from_a_turn_without_changes_reproduces_it_and_shares_the_earlier_turns(uninterrupted):
    """``rollflow stage rollout_turn --from turns/turn_001`` with nothing changed: turns 1 and 2 are played again with
    the recorded checkpoint (sampling is seeded per episode and turn) and equal the original byte for byte, with the
    same fingerprints; the reset table and turn 0 are not copied — the new folder's manifests point at them, so
    ``show`` and ``lineage`` find them; the original is untouched; the same call again writes nothing."""
    from tests.spine.helpers import tree_digest

    before = tree_digest(uninterrupted)
    out = _stage("rollout_turn", "--from", uninterrupted / "turns/turn_001")
    new = _replay(out)
    assert new.parent == uninterrupted.parent and new.name.startswith("a@")
    assert f"wrote 12 rows to {new / 'samples'}" in out and "turns 1-2 played anew" in out
    assert sorted(p.name for p in new.iterdir()) == ["samples", "turns"]
    assert sorted(p.name for p in (new / "turns").iterdir()) == ["turn_001", "turn_002"]
    for name in ("turns/turn_001", "turns/turn_002", "samples"):
        assert _files(new / name) == _files(uninterrupted / name), name
        assert (read_manifest(Location.of(str(new / name)))["fingerprint"]
                == read_manifest(Location.of(str(uninterrupted / name)))["fingerprint"]), name
    samples = read_manifest(Location.of(str(new / "samples")))
    assert {k: v["path"] for k, v in samples["inputs"].items()} == {
        "turn_000": str(uninterrupted / "turns/turn_000"), "turn_001": str(new / "turns/turn_001"),
        "turn_002": str(new / "turns/turn_002")}
    assert tree_digest(uninterrupted) == before, "the original is untouched"

    shown = CliRunner().invoke(_app(), ["show", str(new), "--episodes", "1", "--max-text", "10"])
    assert shown.exit_code == 0 and "3 turn table(s)" in shown.output and "  turn 3" in shown.output, shown.output
    lineage = CliRunner().invoke(_app(), ["lineage", str(new / "samples")])
    assert f"<- turn_000: {uninterrupted / 'turns/turn_000'}  stage rollout_turn" in lineage.output
    assert f"<- previous: {uninterrupted / 'episodes'}  stage rollout_reset" in lineage.output
    assert "none is stale" in lineage.output

    again = tree_digest(new)
    assert "rollout_turn: up to date" in _stage("rollout_turn", "--from", uninterrupted / "turns/turn_001")
    assert tree_digest(new) == again and tree_digest(uninterrupted) == before


def test_replay_with_a_shorter_reply_budget_plays_new_turns_and_downstream_recomputes_what_read_the_samples(
        uninterrupted, tiny_model, tmp_path):
    """``--set generating_args.max_new_tokens=3 --checkpoint COPY --downstream`` (the recorded checkpoint copied with
    its files' times, ``cp -a``): turns 1 and 2 are new, every reply cut at 3 tokens (the original's at 8), from the
    same prompts at turn 1; turn 0 is shared. The rewards beside the rollout folder that read its samples (a real
    reader; in a training iteration the log-probs read them, and tests/trainflow/test_rerun_train.py checks that the
    walk finds that chain) are re-run on the new samples into ``rewarded@<tag>``; the originals are untouched."""
    import shutil

    from schemas.config import ResponseRewardSection, section
    from stages.response_rewards import ResponseRewardsStage
    from stages.runner import run_stage
    from tests.spine.helpers import GRPO, config, tree_digest

    root, rollout = uninterrupted.parent, uninterrupted
    rewards = section(config(GRPO, group_size=2), ResponseRewardSection)
    run_stage(ResponseRewardsStage(), rewards, {"samples": str(rollout / "samples")}, str(root / "rewarded"))
    before = {k: v for k, v in tree_digest(root).items() if "@" not in k}
    copy = Path(shutil.copytree(tiny_model, tmp_path / "ckpt"))  # copy2: sizes and modification times kept
    out = _stage("rollout_turn", "--from", rollout / "turns/turn_001", "--set", "generating_args.max_new_tokens=3",
                 "--checkpoint", copy, "--downstream")
    new = _replay(out)
    tag = new.name.split("@")[1]
    assert {"a", "rewarded", f"a@{tag}", f"rewarded@{tag}"} <= {p.name for p in root.iterdir()}
    assert f"wrote 12 rows to {new / 'samples'}" in out and "response_rewards: wrote" in out and "stale" not in out
    assert sorted(p.name for p in (new / "turns").iterdir()) == ["turn_001", "turn_002"]
    for turn in ("turn_001", "turn_002"):
        now, was = _table(new / "turns" / turn), _table(rollout / "turns" / turn)
        assert max(len(ids) for ids in now.column("response_ids").to_pylist()) <= 3
        assert {len(ids) for ids in was.column("response_ids").to_pylist()} == {8}
        assert now.column("traj_id").equals(was.column("traj_id"))
        manifest = read_manifest(Location.of(str(new / "turns" / turn)))
        assert manifest["section"]["generating_args"]["max_new_tokens"] == 3
        assert manifest["state_in"]["checkpoint"]["path"] == str(copy)
    assert _table(new / "turns/turn_001").column("prompt_ids").equals(
        _table(rollout / "turns/turn_001").column("prompt_ids")), "turn 1 is played from the same turn 0"
    played = ["row_id", "input_ids", "response_mask", "infer_logprobs", "prompt_len"]
    now, was = (_table(folder / "samples").select(played) for folder in (new, rollout))
    first = pa.compute.field("row_id").isin(_table(rollout / "samples").filter(
        pa.compute.field("turn_idx") == 0).column("row_id"))
    assert now.filter(first).equals(was.filter(first)), "the samples of turn 0 are the run's"
    assert now.num_rows == was.num_rows == 12 and not now.equals(was)
    rewarded = read_manifest(Location.of(str(root / f"rewarded@{tag}")))
    assert rewarded["inputs"]["samples"]["path"] == str(new / "samples")
    assert rewarded["section"] == read_manifest(Location.of(str(root / "rewarded")))["section"]
    assert {k: v for k, v in tree_digest(root).items() if "@" not in k} == before, "the originals are untouched"


def test_replay_refuses_bad_requests_with_exit_2_and_writes_nothing(uninterrupted, tiny_model, tmp_path):
    """Not a turn folder, a turn beyond the last, an unknown key, a key fixed by the reused turns, an output inside
    the rollout, a checkpoint that is not the one it was played with: exit 2, one message, nothing written."""
    import shutil

    from tests.spine.helpers import tree_digest

    changed = Path(shutil.copytree(tiny_model, tmp_path / "changed"))
    (changed / "config.json").write_text((changed / "config.json").read_text() + " ")
    parent = uninterrupted.parent
    before = {p.name for p in parent.iterdir()}, tree_digest(uninterrupted)
    cases = [
        (["--from", uninterrupted / "samples"], "is not an output of stage rollout_turn (it holds an output of stage "
                                                "rollout_samples)"),
        (["--from", uninterrupted / "turns/turn_005"], "played 3 turn(s), turn_000 to turn_002; pass one of those"),
        (["--from", uninterrupted / "turns/turn_001", "--set", "generating_args.temprature=0.5"],
         "generating_args.temprature"),
        (["--from", uninterrupted / "turns/turn_001", "--set", "seed=8"], "from a turn on only the sampling"),
        (["--from", uninterrupted / "turns/turn_001", "--output", uninterrupted / "x"], "lies in the rollout"),
        (["--from", uninterrupted / "turns/turn_001", "--checkpoint", tmp_path], "has no config.json"),
        (["--from", uninterrupted / "turns/turn_001", "--checkpoint", changed], "is not the checkpoint the rollout "
                                                                               "was played with"),
    ]
    for args, phrase in cases:
        result = CliRunner().invoke(_app(), ["stage", "rollout_turn", *map(str, args)])
        assert result.exit_code == 2, (args, result.output)
        assert phrase in " ".join(result.output.split()), (args, result.output)
    reset = CliRunner().invoke(_app(), ["stage", "rollout_reset", "--from", uninterrupted / "turns/turn_001"])
    assert reset.exit_code == 2 and "is not an output of stage rollout_reset" in reset.output
    assert ({p.name for p in parent.iterdir()}, tree_digest(uninterrupted)) == before, "nothing written"
