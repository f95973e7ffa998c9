"""A mixed FrozenLake + Sokoban training run of one iteration, end to end: the shipped mixed config with the tiny
random model (HF engine, fp32) and small sizes — the same flow, stages, engines and DeepSpeed as the real run.
Both tags reach the samples, the advantages and the evaluation; per-tag metrics reach the metrics table, the
TensorBoard mirror and the report."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from tests.trainflow.test_train_flow import _rollflow

CONFIG = "configs/train_frozenlake_sokoban_mixed.yaml"
TAGS = ("FrozenLake", "SimpleSokoban")


def _mixed_args(runs_dir: Path, name: str) -> list[str]:
    from stages.generation.model_store import tiny_random_model_dir

    return ["train", "--config", CONFIG, "--set", f"run_name={name}", "--set", f"runs_dir={runs_dir}",
            "--set", "max_steps=1", "--set", f"pretrain={tiny_random_model_dir()}",
            "--set", "rollout.engine.backend=hf", "--set", "rollout.engine.options={}",
            "--set", "rollout.env.group_size=2", "--set", "rollout_batch_size=8",
            "--set", "rollout.custom_envs.FrozenLake.max_steps=2",
            "--set", "rollout.custom_envs.SimpleSokoban.max_steps=1",
            "--set", "rollout.generating_args.max_new_tokens=8",
            "--set", "eval.num_env_groups=2", "--set", "eval.num_groups_partition=[1,1]",
            "--set", "train.actor_train.model_args.dtype=fp32", "--set", "train.max_ckpt_to_keep=1",
            "--set", "train.actor_train.training_args.gradient_accumulation_steps=2"]


def _table(folder: Path):
    return pads.dataset(sorted(str(p) for p in folder.glob("*.parquet")), format="parquet").to_table()


@pytest.mark.slow
def test_mixed_frozenlake_sokoban_run_of_one_iteration(tmp_path, cli_env):
    done = _rollflow(*_mixed_args(tmp_path, "mixed"), env=cli_env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "mixed"
    samples = _table(run / "iter_0000/rollout/samples")
    tags = samples.column("tag").to_pylist()
    assert tags.count("FrozenLake") == 4 and tags.count("SimpleSokoban") == 4  # 2 groups of 2 episodes each
    assert len(set(samples.column("group_id").to_pylist())) == 4
    advantaged = _table(run / "iter_0000/advantaged")
    assert advantaged.num_rows == samples.num_rows and (run / "iter_0000/checkpoint/manifest.json").exists()
    assert sorted(set(_table(run / "iter_0000/eval/samples").column("tag").to_pylist())) == list(TAGS)

    metrics = pads.dataset(str(run / "metrics")).to_table()
    names = {(m["stage"], m["name"]) for m in metrics.select(["stage", "name"]).to_pylist()}
    for stage in ("rollout", "eval"):
        assert (stage, "rollout/success_rate") in names  # the totals keep their names
        for tag in TAGS:
            for what in ("success_rate", "valid_action_rate", "mean_episode_length"):
                assert (stage, f"rollout/{tag}/{what}") in names, (stage, tag, what)
    episodes = {m["name"]: m["value"] for m in metrics.to_pylist()
                if m["stage"] == "rollout" and m["name"].endswith("/episodes")}
    assert episodes == {"rollout/episodes": 8.0, "rollout/FrozenLake/episodes": 4.0,
                        "rollout/SimpleSokoban/episodes": 4.0}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {f"rollout/{tag}/success_rate" for tag in TAGS} <= scalars

    page = (run / "report/index.html").read_text()
    assert "Per environment tag" in page
    assert all(f"<td>{tag}</td>" in page for tag in TAGS)


def test_eval_summary_lists_each_tag_of_a_mixed_evaluation():
    from flows.agentic import eval_summary_lines

    metrics = {"rollout/success_rate": 0.5, "rollout/valid_action_rate": 0.75, "rollout/stop/max_steps": 1.0}
    for tag, rate in (("FrozenLake", 1.0), ("SimpleSokoban", 0.0)):
        metrics |= {f"rollout/{tag}/success_rate": rate, f"rollout/{tag}/valid_action_rate": 0.75,
                    f"rollout/{tag}/episodes": 2.0}
    lines = eval_summary_lines({"metrics": metrics, "checkpoint": "c", "episodes": 4, "output": "o"})
    tagged = [line.split() for line in lines if line.split()[0] in ("FrozenLake", "SimpleSokoban")]
    assert [(w[0], w[2]) for w in tagged] == [("FrozenLake", "1,"), ("SimpleSokoban", "0,")]
    single = {k: v for k, v in metrics.items() if "SimpleSokoban" not in k}
    assert not any(line.split()[0] == "FrozenLake" for line in eval_summary_lines(
        {"metrics": single, "checkpoint": "c", "episodes": 2, "output": "o"}))  # one tag: the totals say it all
