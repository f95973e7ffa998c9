"""The training flow: ROLL's agentic config rules, and a real run (Prefect ephemeral API, local Ray, HF engine,
DeepSpeed) on the tiny random model, resumed afterwards with every stage skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.config import load_config, validate_config
from schemas.errors import ConfigError
from schemas.train_flow_config import TrainFlowConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("train_*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_train_configs_validate(path):
    cfg = load_config(TrainFlowConfig, path)
    assert cfg.train.adv_estimator == cfg.adv_estimator
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
    from flows.train import check_cpu_budget
    from schemas.errors import RollflowError

    cfg = validate_config(TrainFlowConfig, {"rollout": {"engine": {"num_cpus_per_engine": 1}},
                                            "logprobs": {"cpus_per_actor": 1}})
    with pytest.raises(RollflowError, match="num_cpus_per_engine: 0"):
        check_cpu_budget(cfg, 2.0)
    check_cpu_budget(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={
        "engine": cfg.rollout.engine.model_copy(update={"num_cpus_per_engine": 0.0})})}), 2.0)


def _rollflow(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1500)


@pytest.mark.slow
def test_train_run_end_to_end_then_resume_skips_everything(tmp_path):
    from stages.generation.model_store import tiny_random_model_dir

    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "ROLLFLOW_CACHE": str(REPO / ".cache")}
    args = ["train", "--config", "configs/train_frozenlake_grpo.yaml", "--set", "run_name=t",
            "--set", f"runs_dir={tmp_path}", "--set", "max_steps=1", "--set", f"pretrain={tiny_random_model_dir()}",
            "--set", "rollout.engine.backend=hf", "--set", "rollout.engine.options={}",
            "--set", "rollout.env.num_env_groups=2", "--set", "rollout.env.group_size=2",
            "--set", "rollout_batch_size=4", "--set", "rollout.env.max_steps=2",
            "--set", "rollout.generating_args.max_new_tokens=8", "--set", "eval.num_env_groups=2",
            "--set", "train.actor_train.model_args.dtype=fp32"]
    first = _rollflow(*args, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = tmp_path / "t"
    for stage in ("rollout/samples", "logprobs", "rewarded", "advantaged", "checkpoint", "eval/samples"):
        assert (run / "iter_0000" / stage / "manifest.json").exists(), stage
    assert (run / "eval_base/samples/manifest.json").exists()
    assert (run / "report/index.html").exists() and (run / "report/success_rate.png").exists()
    train_manifest = json.loads((run / "iter_0000/checkpoint/manifest.json").read_text())
    assert "actor/pg_loss" in train_manifest["metrics"]
    import pyarrow.dataset as pads

    metrics = pads.dataset(str(run / "metrics")).to_table().to_pylist()
    assert {m["stage"] for m in metrics} >= {"rollout", "logprobs", "advantages", "train", "eval"}

    stamps = {p: p.stat().st_mtime_ns for p in run.glob("iter_0000/*/manifest.json")}
    again = _rollflow("train", "--resume", str(run), "--no-report", env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in run.glob("iter_0000/*/manifest.json")} == stamps

    bad = _rollflow("train", "--resume", str(run), "--set", "max_steps=2", env=env)
    assert bad.returncode == 2 and "cannot change a run being resumed" in bad.stderr
