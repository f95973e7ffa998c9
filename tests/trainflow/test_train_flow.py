"""The training flow: ROLL's agentic config rules, and a real run (Prefect, local Ray, HF engine, DeepSpeed) on the
tiny random model in the test's process, resumed afterwards with every stage skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import Result

from schemas.config import load_config, validate_config
from schemas.errors import ConfigError
from schemas.train_flow_config import TrainFlowConfig
from tests.processes import rollflow_here

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("train_*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_train_configs_validate(path):
    cfg = load_config(TrainFlowConfig, path)
    assert cfg.train_step_config().adv_estimator == cfg.adv_estimator  # the training step's is the run's
    assert validate_config(TrainFlowConfig, cfg.model_dump(mode="json")) == cfg  # the frozen copy round-trips


@pytest.mark.parametrize("data, words", [
    ({"rollout_batch_size": 30, "rollout": {"env": {"group_size": 8}}}, ["divisible", "group_size (8)", "32"]),
    ({"rollout_batch_size": 16, "rollout": {"env": {"group_size": 8, "num_env_groups": 8}}},
     ["must equal", "num_env_groups to 2"]),
    ({"adv_estimator": "gigpo", "rollout": {"sample_level": "trajectory"}}, ["sample_level: step"]),
    ({"adv_estimator": "grpo", "train": {"adv_estimator": "gae"}}, ["set it once"]),
    ({"adv_estimator": "grpo", "reward_normalization": {"grouping": "traj_group_id", "method": "mean_std"},
      "rollout": {"env": {"group_size": 1}}}, ["at least 2", "group_size: 8"]),
    ({"add_token_level_kl": True, "logprobs": {"enable_reference": False}}, ["enable_reference: true"]),
    ({"train": {"ratio_type": "segment", "policy_loss": "base"}}, ["policy_loss: agentic"]),
    ({"episode_reward_weight": -1.0}, [">= 0"]),
])
def test_agentic_rules_give_rule_reason_and_fix(data, words):
    with pytest.raises(ConfigError) as err:
        validate_config(TrainFlowConfig, data)
    for word in words:
        assert word in str(err.value)


def test_cpu_budget_check_names_the_fix():
    """The CPU rule of the resource plan start_run checks (flows/runkit.py check_plan, stages/plan.py)."""
    from flows.runkit import check_plan
    from schemas.errors import RollflowError
    from schemas.rollout_config import EngineConfig
    from stages.plan import EngineUse, default_engines, make_plan

    cfg = validate_config(TrainFlowConfig, {"rollout": {"engine": {"num_cpus_per_engine": 1}},
                                            "logprobs": {"cpus_per_actor": 1}})
    with pytest.raises(RollflowError, match="num_cpus_per_engine: 0"):
        check_plan(cfg, {"CPU": 2.0})
    idle = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={
        "engine": cfg.rollout.engine.model_copy(update={"num_cpus_per_engine": 0.0})})})
    check_plan(idle, {"CPU": 2.0})
    judge = EngineUse("LLM judge engine", "judge.engine", EngineConfig(num_cpus_per_engine=1.0, backend="hf"))
    with pytest.raises(RollflowError, match="engines hold 1 for the whole run"):  # a judge engine holding a CPU
        make_plan(idle, {"CPU": 2.0}, [*default_engines(idle), judge]).check()


class _Logged:
    """A stand-in for the metrics log: keeps what ``record`` logs."""

    def __init__(self):
        self.rows: list[tuple[int, str]] = []

    def log(self, iteration: int, stage: str, metrics: dict, wall_s: float | None = None) -> None:
        self.rows.append((iteration, stage))


def test_progress_line_names_the_eval_after_an_iteration_while_the_table_keeps_its_convention(capsys):
    from types import SimpleNamespace

    from flows.runkit import record

    logged, result = _Logged(), SimpleNamespace(metrics={"rollout/success_rate": 0.5}, seconds=3.0, skipped=False)
    record(logged, 1, "train", result)
    record(logged, 2, "eval", result, label="eval after iteration 1")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[iteration 1] train") and lines[1].startswith("[eval after iteration 1] eval")
    assert logged.rows == [(1, "train"), (2, "eval")]  # the table files the eval under the policy's step count


def _rollflow(*args: str, env: dict, cwd: Path = REPO, timeout_s: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout_s, start_new_session=True)


def _tiny_args(runs_dir: Path, name: str) -> list[str]:
    """A two-iteration FrozenLake GRPO run on the tiny random model (HF engine, fp32) — the shipped config with
    small sizes, not a mock: the same flow, runner, engines and DeepSpeed as the default run. The tiny random model
    scores every episode alike, so GRPO's group-normalised advantages would all be 0 and no step would move the
    weights; with ``reward_normalization.method=identity`` the advantages are the (non-zero) scores themselves, so the
    training steps, their resume and their re-runs are checked on weights that move. The engine sleeps between
    rollouts as a colocated one does (sleep_level 2: its weights discarded, the next checkpoint loaded on waking), so
    the flow's order of sleep, log-probs, training and wake is exercised on the CPU. The actor trains LoRA adapters
    (rank 4 on q_proj and v_proj; issue 16): every tiny run (re-runs, evaluation, and the asynchronous runs of
    tests/trainflow/test_async_rollout.py: two nodes, SIGKILLs, replay and S3) takes the LoRA path, whose checkpoints
    the engines read as plain HF folders (merged weights); full fine-tuning runs end to end in the RLVR run
    (tests/trainflow/test_rlvr_train.py). The engine plays in fp32, as the actor trains: the tests compare its
    log-probs between runs up to float32 rounding, and in bf16 (``auto`` on a CPU with native bf16) two runs of the
    same evaluation once differed by bf16 rounding (0.004 on 2 of 1,058 tokens, the tokens the same)."""
    from stages.generation.model_store import tiny_random_model_dir

    return ["train", "--config", "configs/train_frozenlake_grpo.yaml", "--set", f"run_name={name}",
            "--set", f"runs_dir={runs_dir}", "--set", "max_steps=2", "--set", f"pretrain={tiny_random_model_dir()}",
            "--set", "rollout.engine.backend=hf", "--set", "rollout.engine.options={}",
            "--set", "rollout.engine.sleep_level=2", "--set", "rollout.engine.dtype=float32",
            "--set", "rollout.env.num_env_groups=2", "--set", "rollout.env.group_size=2",
            "--set", "rollout_batch_size=4", "--set", "rollout.env.max_steps=2",
            "--set", "rollout.generating_args.max_new_tokens=8", "--set", "eval.num_env_groups=2",
            "--set", "eval.group_size=1", "--set", "eval.eval_steps=1",
            "--set", "train.actor_train.model_args.dtype=fp32", "--set", "train.max_ckpt_to_keep=1",
            "--set", "reward_normalization.method=identity",
            "--set", "train.actor_train.model_args.lora_rank=4",
            "--set", "train.actor_train.model_args.lora_target_modules=[q_proj,v_proj]"]


@dataclass(frozen=True)
class FinishedRun:
    """The finished run and its no-work resume."""

    run: Path  # the run folder
    stamps: dict  # the modification times of its manifests and metrics parts before the resume (_stamps)
    resumed: Result  # `rollflow train --resume RUN --no-report` in this process (Typer's result)
    stamps_resumed: dict  # and after it


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, prefect_server, ray_cluster) -> FinishedRun:
    """One uninterrupted tiny run in this process (``rollflow_here``: the session's Ray cluster and Prefect server),
    then ``rollflow train --resume`` of it, also here. It ran as a ``rollflow`` child on a two-node cluster of its
    own (issue 14, item 3) with the recompute and the resume as children beside it, 83 CPU-s against 45 here:
    tests/trainflow/test_async_rollout.py's two-node run now carries the placement checks and the recompute on its
    cluster (one two-node cluster and run for both modules), and its S3 chain the equality of a two-node run with a
    local one; a ``rollflow train`` child's exit status is that run's."""
    root = tmp_path_factory.mktemp("trainflow")
    run = root / "t"
    first = rollflow_here(*_tiny_args(root, "t"), api_url=prefect_server.api_url)
    assert first.exit_code == 0, first.output[-3000:]
    stamps = _stamps(run)
    resumed = rollflow_here("train", "--resume", str(run), "--no-report", api_url=prefect_server.api_url)
    return FinishedRun(run, stamps, resumed, _stamps(run))


def _stamps(run: Path) -> dict[Path, int]:
    """The modification times of the run's manifests and of its metrics table's parts (a stage skipped on resume
    keeps the record of the run that computed it: its wall time, and no rewrite of the TensorBoard mirror)."""
    return {p: p.stat().st_mtime_ns for p in [*run.glob("iter_*/*/manifest.json"), *run.glob("metrics/part-*")]}


@pytest.fixture(scope="module")
def finished_run(local_run) -> Path:
    """The run's folder (read-only): the reference of the evaluation test and the stage re-run. The run killed on S3
    and resumed is tests/trainflow/test_async_rollout.py's chain (one run for the object store and the overlap's kill
    points: a kill and resume of its own here cost 83-127 CPU-s), against an uninterrupted run on a two-node cluster;
    its evaluations equal to that run's are the equality of a two-node run's evaluation with a local one, which the
    evaluation test here checked while this run ran on two nodes."""
    return local_run.run


STAGES = ("rollout/samples", "logprobs", "rewarded", "advantaged", "checkpoint", "eval/samples")


@pytest.mark.slow
def test_train_run_end_to_end_then_resume_skips_everything(local_run, prefect_server, ray_cluster):
    run = local_run.run
    for k in (0, 1):
        for stage in STAGES:
            assert (run / f"iter_{k:04d}" / stage / "manifest.json").exists(), (k, stage)
    assert (run / "eval_base/samples/manifest.json").exists()
    assert (run / "report/index.html").exists() and (run / "report/success_rate.png").exists()
    train_manifest = json.loads((run / "iter_0000/checkpoint/manifest.json").read_text())
    assert "actor/pg_loss" in train_manifest["metrics"]
    # the worker group lives across steps: the first step trains the engines its log-prob pass built (issue 44),
    # the second the engines the first one left in memory
    assert train_manifest["metrics"]["train/engines_kept"] == 1.0
    assert json.loads((run / "iter_0001/checkpoint/manifest.json").read_text())["metrics"]["train/engines_kept"] == 1
    # save_steps (10) > max_steps: iteration 0 writes weights and a replay record, the last iteration the state too
    assert not (run / "iter_0000/checkpoint/deepspeed").exists() and (run / "iter_0001/checkpoint/deepspeed").is_dir()
    assert json.loads((run / "iter_0000/checkpoint/train_state.json").read_text())["replay"]["steps"]
    assert train_manifest["metrics"]["train/full_state_saved"] == 0.0
    assert list((run / "iter_0000/checkpoint").glob("*.safetensors"))
    _assert_lora_checkpoint(run)
    import pyarrow.dataset as pads

    metrics = pads.dataset(str(run / "metrics")).to_table().to_pylist()
    assert {m["stage"] for m in metrics} >= {"rollout", "logprobs", "advantages", "train", "eval", "engine"}
    assert {m["iteration"] for m in metrics if m["stage"] == "train"} == {0, 1}
    # the engine slept after each rollout, its weights discarded (the next rollout and the evaluations generated
    # with the checkpoint loaded on waking: a sleeping engine refuses to generate)
    released = {m["iteration"]: m["value"] for m in metrics if m["name"] == "engine/released_gib"}
    assert set(released) == {0, 1} and min(released.values()) > 0, released

    # the resume (local_run): every stage skipped, no manifest rewritten
    stamps, again = local_run.stamps, local_run.resumed
    assert again.exit_code == 0, again.output[-3000:]
    assert stamps and local_run.stamps_resumed == stamps

    # refused before Ray or Prefect is asked: the command in this process (no child importing rollflow again)
    bad = rollflow_here("train", "--resume", str(run), "--set", "max_steps=3", api_url=prefect_server.api_url)
    assert bad.exit_code == 2 and "cannot change a run being resumed" in bad.stderr, bad.output[-3000:]
    assert _stamps(run) == stamps


def _table(folder: Path, drop: tuple[str, ...] = ()):
    import pyarrow.dataset as pads

    table = pads.dataset(sorted(str(p) for p in folder.glob("*.parquet")), format="parquet").to_table()
    return table.drop_columns([c for c in drop if c in table.column_names]).sort_by("row_id")


def _assert_same_rows(got, want, where) -> None:
    """Two tables (sorted by row id) hold the same rows: equal columns, the float ones up to float32 rounding."""
    import numpy as np

    assert got.num_rows == want.num_rows and got.column_names == want.column_names, where
    for column in got.column_names:
        a, b = got.column(column).to_pylist(), want.column(column).to_pylist()
        assert a == b or np.allclose(np.concatenate([np.ravel(x) for x in a]).astype(float),
                                     np.concatenate([np.ravel(x) for x in b]).astype(float),
                                     rtol=1e-5, atol=1e-6), (where, column)


def _float32(tensors: dict) -> dict:
    """name -> float32 array. A weights-only checkpoint is written in the dtype the engines load: bf16 where the CPU
    has native bf16, which numpy cannot hold; float32 holds it exactly."""
    return {name: t.float().numpy() for name, t in tensors.items()}


def _weights(folder: Path) -> dict:
    """name -> float32 array of every tensor in the folder's safetensors files."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(_float32(load_file(str(f))))
    assert out, f"no weights in {folder}"
    return out


@pytest.mark.slow
def test_eval_of_a_checkpoint_equals_the_runs_own_evaluation(finished_run, prefect_server, ray_cluster, tmp_path):
    """``rollflow eval`` plays the config's held-out levels with a checkpoint, without training: on the run's last
    checkpoint it commits the same episodes as the run's own evaluation after that iteration; a re-run skips."""
    config = _tiny_args(finished_run.parent, finished_run.name)[1:]  # the run's config: --config FILE --set ...
    out = tmp_path / "eval"
    done = rollflow_here("eval", *config, "--checkpoint", str(finished_run / "iter_0001/checkpoint"), "--output",
                         str(out), api_url=prefect_server.api_url)
    assert done.exit_code == 0, done.output[-3000:]
    assert "held-out episodes" in done.stdout and "rollout/valid_action_rate" in done.stdout
    got, want = _table(out / "samples"), _table(finished_run / "iter_0001/eval/samples")
    assert want.num_rows > 0
    _assert_same_rows(got, want, "eval/samples")
    stamp = (out / "samples/manifest.json").stat().st_mtime_ns
    again = rollflow_here("eval", *config, "--checkpoint", str(finished_run / "iter_0001/checkpoint"), "--output",
                           str(out), api_url=prefect_server.api_url)
    assert again.exit_code == 0 and (out / "samples/manifest.json").stat().st_mtime_ns == stamp, again.output[-3000:]
    missing = rollflow_here("eval", *config, "--checkpoint", str(tmp_path / "nope"), "--output",
                             str(tmp_path / "e2"), api_url=prefect_server.api_url)
    assert missing.exit_code == 2 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    assert not (tmp_path / "e2").exists()


@pytest.mark.slow
def test_stage_rerun_of_the_logprobs_in_another_dtype_recomputes_what_reads_them(finished_run, prefect_server,
                                                                                   ray_cluster):
    """``rollflow stage logprobs --set dtype=… --downstream`` on an iteration of a finished run: new log-probs beside
    the old ones, then the rewards and advantages that read them (each ``<folder>@<tag>``, the advantages after both
    of their re-run inputs), the training step on the new advantages and the evaluation of its checkpoint; the run's
    own outputs are untouched, and the same call again is up to date and writes nothing."""
    it = finished_run / "iter_0000"
    old_manifest = json.loads((it / "logprobs/manifest.json").read_text())
    dtype = "fp32" if old_manifest["section"]["dtype"] == "bf16" else "bf16"
    stamps = {p: p.stat().st_mtime_ns for p in it.glob("*/manifest.json")}
    before = _re_runs(it)
    done = rollflow_here("stage", "logprobs", "--from", str(it / "logprobs"), "--set", f"dtype={dtype}",
                         "--downstream", api_url=prefect_server.api_url)
    assert done.exit_code == 0, done.output[-3000:]
    tags = {name.split("@")[1] for name in _re_runs(it) - before}
    assert len(tags) == 1
    tag = tags.pop()
    assert sorted(_re_runs(it) - before) == [f"{n}@{tag}" for n in ("advantaged", "checkpoint", "eval", "logprobs",
                                                                     "rewarded")]
    manifest = {n: json.loads((it / f"{n}@{tag}/manifest.json").read_text()) for n in ("logprobs", "advantaged")}
    assert manifest["logprobs"]["section"]["dtype"] == dtype
    assert manifest["advantaged"]["inputs"]["samples"]["path"] == str(it / f"logprobs@{tag}")
    assert manifest["advantaged"]["inputs"]["rewarded"]["path"] == str(it / f"rewarded@{tag}")
    import numpy as np
    import pyarrow.compute as pc

    old_lp, new_lp = (pc.list_flatten(_table(folder).column("old_log_probs")).to_numpy()
                      for folder in (it / "logprobs", it / f"logprobs@{tag}"))
    assert old_lp.shape == new_lp.shape and not np.array_equal(old_lp, new_lp)
    assert np.abs(old_lp - new_lp).max() < 0.5, "the same model in another precision"
    assert "was not recomputed" not in done.stdout and f"to {it / f'checkpoint@{tag}'} (old output" in done.stdout
    trained = json.loads((it / f"checkpoint@{tag}/manifest.json").read_text())
    assert trained["inputs"]["samples"]["path"] == str(it / f"advantaged@{tag}")
    assert json.loads((it / f"eval@{tag}/manifest.json").read_text())["inputs"]["checkpoint"]["path"] == str(
        it / f"checkpoint@{tag}")
    assert {p: p.stat().st_mtime_ns for p in it.glob("*/manifest.json") if "@" not in p.parent.name} == stamps
    from tests.spine.helpers import tree_digest

    before = tree_digest(it)
    again = rollflow_here("stage", "logprobs", "--from", str(it / "logprobs"), "--set", f"dtype={dtype}",
                           "--downstream", api_url=prefect_server.api_url)
    assert again.exit_code == 0 and again.stdout.count("up to date") == 5, again.output
    assert tree_digest(it) == before, "an up-to-date re-run writes nothing"


def _assert_lora_checkpoint(run: Path) -> None:
    """The LoRA run's last checkpoint: the DeepSpeed state holds the adapters alone, the checkpoint records the base
    its adapter applies to, the merged weights differ from the base only in the target modules, and they moved
    when a gradient was there (the tiny random model often scores every episode alike: identity-normalised
    advantages are then equal, not 0, so a step usually has one)."""
    import torch

    from stages.generation.model_store import tiny_random_model_dir

    last = run / "iter_0001/checkpoint"
    state = json.loads((last / "train_state.json").read_text())
    assert state["lora"]["actor"]["base"] == str(tiny_random_model_dir())
    assert state["lora"]["actor"]["options"]["lora_target_modules"] == ["q_proj", "v_proj"]
    assert (last / "lora/actor/adapter_model.safetensors").is_file()
    module = torch.load(last / "deepspeed/actor/state/mp_rank_00_model_states.pt", weights_only=False,
                        map_location="cpu")["module"]
    assert module and all(".lora_" in k for k in module)
    got, base = _weights(last), _weights(tiny_random_model_dir())
    assert got.keys() == base.keys()
    changed = {k for k in got if not (got[k] == base[k]).all()}
    assert all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed  # only the targets move
    norms = [json.loads((run / f"iter_{k:04d}/checkpoint/manifest.json").read_text())["metrics"]["actor/grad_norm"]
             for k in (0, 1)]
    assert bool(changed) == (max(norms) > 0), (norms, changed)


def _re_runs(folder: Path) -> set[str]:
    """The names of the re-run outputs (``<name>@<tag>``) in an iteration folder."""
    return {p.name for p in folder.iterdir() if "@" in p.name}
