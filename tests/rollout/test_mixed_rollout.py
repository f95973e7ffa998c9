"""A mixed rollout (ROLL's tags + num_groups_partition): groups are assigned to tags in order, each group plays one
level of its own environment with its own turn limit, ids and level seeds are distinct over the whole rollout, and
the metrics are split per tag next to the totals. The pure episode code with fake replies, then a real rollout
(Ray Data stages, HF engine, the tiny random model)."""

from __future__ import annotations

import copy

import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from schemas.rollout_config import turn_section
from stages.rollout.episode import play_turn, reset_row
from stages.rollout.prompts import ChatFormat
from stages.rollout.samples import rollout_metrics
from stages.rollout.tables import NARROW_COLUMNS, TURNS

from .helpers import GARBAGE, GOOD, fake_result, small_config

MIXED = {"env": {"tags": ["FrozenLake", "Sokoban6"], "num_groups_partition": [1, 2], "num_env_groups": 3,
                 "group_size": 2, "max_steps": 2},
         "custom_envs": {"Sokoban6": {"env_type": "SimpleSokoban", "max_steps": 1,
                                      "env_config": {"dim_room": [6, 6], "num_boxes": 1}}}}


def _config(**overrides):
    mixed = copy.deepcopy(MIXED)  # small_config applies dotted overrides in place
    return small_config(**{"env": mixed["env"], "custom_envs": mixed["custom_envs"], **overrides})


def test_groups_play_the_tags_of_the_partition(tokenizer):
    config = _config()
    section = turn_section(config)
    chat = ChatFormat.of(tokenizer, config.prompt.system_prompt)
    rows = [reset_row(section, chat, env_id) for env_id in range(6)]
    assert [r["tag"] for r in rows] == ["FrozenLake"] * 2 + ["Sokoban6"] * 4
    assert [r["group_index"] for r in rows] == [0, 0, 1, 1, 2, 2]
    groups = {r["group_id"] for r in rows}
    assert len(groups) == 3 and all(g.startswith(r["tag"] + "_") for r in rows for g in [r["group_id"]])
    seeds = {r["group_index"]: r["level_seed"] for r in rows}
    assert len(set(seeds.values())) == 3  # a level seed per group, distinct across tags
    assert all(r["level_seed"] == seeds[r["group_index"]] for r in rows)  # same level within a group
    assert "#" in rows[2]["observation"] and "#" not in rows[0]["observation"]  # Sokoban walls, FrozenLake has none
    assert rows[2]["observation"] != rows[4]["observation"]  # the two Sokoban groups play different levels
    # each tag's turn limit: Sokoban6 (max_steps 1) ends after one turn, FrozenLake (2) goes on after an invalid one
    played = [play_turn(section, chat, r, fake_result(tokenizer, GARBAGE)) for r in rows]
    assert [p["done"] for p in played] == [False, False, True, True, True, True]
    assert not any(p["success"] for p in played)
    assert played[0]["format_penalty"] != played[2]["format_penalty"]  # each environment's own penalty
    again = play_turn(section, chat, played[0], fake_result(tokenizer, GOOD))
    assert again["done"] and again["stop_reason"] in ("max_steps", "terminated")


def test_metrics_are_split_per_tag_next_to_the_totals():
    """FrozenLake: one successful 2-turn episode (valid, valid). Sokoban6: two 1-turn failures (invalid)."""
    base = {"group_id": "g", "env_id": 0, "format_penalty": 0.0, "response_truncated": False, "episode_return": 0.0,
            "action_effective": False, "success": False, "done": True, "stop_reason": "max_steps"}
    spec = [("FrozenLake", "A", 0, 0.0, True, {"done": False, "stop_reason": ""}),
            ("FrozenLake", "A", 1, 1.0, True, {"success": True, "stop_reason": "terminated"}),
            ("Sokoban6", "B", 0, -0.15, False, {"format_penalty": -0.15}),
            ("Sokoban6", "C", 0, -0.15, False, {"format_penalty": -0.15})]
    rows = [{**base, "tag": tag, "traj_id": t, "turn_idx": k, "reward": r, "action_valid": v, **extra}
            for tag, t, k, r, v, extra in spec]
    schema = TURNS.arrow_schema()
    narrow = pa.Table.from_pylist(rows, schema=pa.schema([schema.field(c) for c in NARROW_COLUMNS]))
    m = rollout_metrics(narrow, response_tokens=40, prompt_tokens=400)
    assert m["rollout/success_rate"] == pytest.approx(1 / 3) and m["rollout/valid_action_rate"] == 0.5
    assert m["rollout/FrozenLake/episodes"] == 1 and m["rollout/Sokoban6/episodes"] == 2
    assert m["rollout/FrozenLake/success_rate"] == 1.0 and m["rollout/Sokoban6/success_rate"] == 0.0
    assert m["rollout/FrozenLake/valid_action_rate"] == 1.0 and m["rollout/Sokoban6/valid_action_rate"] == 0.0
    assert m["rollout/FrozenLake/mean_episode_length"] == 2.0 and m["rollout/Sokoban6/mean_episode_length"] == 1.0
    assert m["rollout/FrozenLake/episode_score/mean"] == 1.0
    assert m["rollout/Sokoban6/episode_score/mean"] == pytest.approx(-0.15)
    assert m["env/FrozenLake/success"] == 1.0 and m["env/Sokoban6/action_is_valid"] == 0.0  # ROLL's names stay


@pytest.mark.usefixtures("ray_cluster")
def test_real_mixed_rollout_commits_both_tags(tiny_model, tmp_path):
    from stages.rollout.driver import run_rollout

    config = _config(**{"sample_level": "trajectory", "seed": 3})
    result = run_rollout(config, str(tmp_path / "mixed"), str(tiny_model))
    samples = pads.dataset(sorted(str(p) for p in (tmp_path / "mixed/samples").glob("*.parquet"))).to_table()
    tags = samples.column("tag").to_pylist()
    assert tags.count("FrozenLake") == 2 and tags.count("Sokoban6") == 4  # one sample per episode
    by_tag: dict[str, set[str]] = {}
    for tag, group in zip(tags, samples.column("group_id").to_pylist()):
        by_tag.setdefault(tag, set()).add(group)
    assert {t: len(g) for t, g in by_tag.items()} == {"FrozenLake": 1, "Sokoban6": 2}
    assert all(g.startswith(t + "_") for t, gs in by_tag.items() for g in gs)
    assert samples.group_by("group_id").aggregate([("row_id", "count")]).column("row_id_count").to_pylist() == [2] * 3
    m = result.metrics
    assert m["rollout/episodes"] == 6 and m["rollout/FrozenLake/episodes"] == 2 and m["rollout/Sokoban6/episodes"] == 4
    assert m["rollout/Sokoban6/mean_episode_length"] == 1.0  # its max_steps
    assert 1.0 <= m["rollout/FrozenLake/mean_episode_length"] <= 2.0
    for tag in ("FrozenLake", "Sokoban6"):
        assert 0.0 <= m[f"rollout/{tag}/success_rate"] <= 1.0 and f"rollout/{tag}/valid_action_rate" in m
    assert len(result.turns) <= 2  # the longest tag's turn limit


@pytest.mark.parametrize("overrides, words", [
    ({"env.tags": ["Nope", "FrozenLake"]}, ["env.tags entry 'Nope'", "declare the tag in rollout.custom_envs",
                                             "SimpleSokoban"]),
    ({"custom_envs.Sokoban6.env_type": "Sokobann"}, ["custom_envs.Sokoban6.env_type 'Sokobann'", "use one of"]),
])
def test_an_unknown_environment_is_refused_before_anything_runs(overrides, words, tmp_path):
    from schemas.errors import ConfigError
    from stages.rollout.driver import run_rollout

    with pytest.raises(ConfigError) as err:
        run_rollout(_config(**overrides), str(tmp_path / "never"), "/nonexistent/checkpoint")
    for word in words:
        assert word in str(err.value), str(err.value)
    assert not (tmp_path / "never").exists()
