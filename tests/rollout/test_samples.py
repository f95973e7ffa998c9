"""Turn rows → training samples in both of ROLL's modes (spec §11.2), and the rollout metrics."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from schemas.rollout_config import samples_section, turn_section
from schemas.tables import SAMPLES, check_row_invariants, check_structure
from stages.example import state_hash
from stages.rollout.episode import play_turn, reset_row
from stages.rollout.prompts import ChatFormat
from stages.rollout.samples import concat_rows, episode_summary, rollout_metrics, turns_to_samples
from stages.rollout.tables import NARROW_COLUMNS, TURNS, rows_to_table

from .helpers import GARBAGE, fake_result, small_config

REPLIES = [(GARBAGE, "stop", True), ("<answer>Down</answer>", "stop", False), ("I am thinking about", "length", False)]


def _play(tokenizer, level: str) -> tuple[list[list[dict]], object]:
    """Every turn of 2 groups x 2 episodes x up to 3 turns, with fake replies; returns rows per turn."""
    config = small_config(sample_level=level)
    section = turn_section(config)
    chat = ChatFormat.of(tokenizer, config.prompt.system_prompt, config.prompt.example_turns())
    current = [reset_row(section, chat, env_id) for env_id in range(4)]
    turns = []
    for turn in range(config.env.max_steps):
        played = []
        for row in current:
            text, finish, eos = REPLIES[(turn + row["env_id"]) % len(REPLIES)]
            played.append(play_turn(section, chat, row, fake_result(tokenizer, text, finish, eos, -0.1 * (turn + 1))))
        turns.append(played)
        current = [r for r in played if not r["done"]]
        if not current:
            break
    return turns, config


def _validate(samples: pa.Table, group_size: int) -> None:
    SAMPLES.check_schema(samples.schema, "test", ("infer_logprobs", "prompt_len"))
    check_row_invariants(SAMPLES, samples, "test")
    check_structure(samples, "test", group_size)


def test_step_level_samples(tokenizer):
    turns, config = _play(tokenizer, "step")
    rows = [r for played in turns for r in played]
    table = rows_to_table(rows)
    summary = episode_summary(table.select(NARROW_COLUMNS))
    samples = turns_to_samples(table, samples_section(config), summary)
    _validate(samples, config.env.group_size)
    assert samples.num_rows == len(rows)
    for row, sample in zip(rows, samples.to_pylist()):
        prompt, response = row["prompt_ids"], row["response_ids"]
        assert sample["input_ids"] == prompt + response and sample["prompt_len"] == len(prompt)
        assert sample["response_mask"] == [0] * len(prompt) + [1] * len(response)
        assert np.allclose(sample["infer_logprobs"], [0.0] * (len(prompt) - 1) + row["logprobs"])
        assert sample["state_hash"] == state_hash(row["observation"]) and sample["turn_idx"] == row["turn_idx"]
        assert sample["score"] == pytest.approx(row["reward"])
        ep = [r for r in rows if r["traj_id"] == row["traj_id"]]
        assert sample["episode_score"] == pytest.approx(sum(r["reward"] for r in ep))
        assert sample["num_turns"] == len(ep)
    assert len(set(samples.column("row_id").to_pylist())) == len(rows)


def test_trajectory_level_samples_have_one_segment_per_turn(tokenizer):
    turns, config = _play(tokenizer, "trajectory")
    rows = [r for played in turns for r in played]
    table = rows_to_table(rows)
    summary = episode_summary(table.select(NARROW_COLUMNS))
    last = rows_to_table([r for r in rows if r["done"]])
    samples = turns_to_samples(last, samples_section(config), summary)
    _validate(samples, config.env.group_size)
    assert samples.num_rows == 4
    for sample in samples.to_pylist():
        ep = sorted((r for r in rows if r["traj_id"] == sample["traj_id"]), key=lambda r: r["turn_idx"])
        ids, mask, infer = sample["input_ids"], np.array(sample["response_mask"]), np.array(sample["infer_logprobs"])
        # the last prompt holds every earlier prompt and reply verbatim
        assert ids == ep[-1]["prompt_ids"] + ep[-1]["response_ids"]
        starts = np.flatnonzero(np.diff(np.r_[0, mask]) == 1)
        assert len(starts) == len(ep) == sample["num_turns"]
        for start, row in zip(starts, ep):
            assert start == len(row["prompt_ids"])  # each reply starts where its turn's prompt ended
            length = len(row["response_ids"])
            assert ids[start:start + length] == row["response_ids"] and mask[start:start + length].all()
            assert np.allclose(infer[start - 1:start - 1 + length], row["logprobs"])
        assert mask.sum() == sum(len(r["response_ids"]) for r in ep)
        assert np.array_equal(infer != 0, mask[1:] == 1)
        assert sample["prompt_len"] == len(ep[0]["prompt_ids"]) and sample["turn_idx"] == 0
        assert sample["score"] == pytest.approx(sum(r["reward"] for r in ep)) == sample["episode_score"]
        assert sample["state_hash"] is None


def test_a_rollout_played_ahead_writes_its_staleness_and_one_in_turn_writes_no_column(tokenizer):
    """async_generation_ratio > 0: every sample carries the training steps between the policy that played it and the
    one trained on it (a column of the section, so the samples' fingerprint names it); in turn (None) the table and
    the section's dump are as before the column existed."""
    turns, config = _play(tokenizer, "step")
    table = rows_to_table([r for played in turns for r in played])
    summary = episode_summary(table.select(NARROW_COLUMNS))
    in_turn = turns_to_samples(table, samples_section(config), summary)
    assert "staleness" not in in_turn.column_names and "staleness" not in samples_section(config).model_dump()
    ahead = turns_to_samples(table, samples_section(config, staleness=1), summary)
    _validate(ahead, config.env.group_size)
    SAMPLES.check_schema(ahead.schema, "test", ("staleness",))
    assert ahead.column("staleness").to_pylist() == [1] * ahead.num_rows
    assert ahead.drop_columns(["staleness"]).equals(in_turn)
    assert samples_section(config, staleness=1).model_dump()["staleness"] == 1


def test_trajectory_text_is_the_chat_template_of_the_conversation(tokenizer):
    """Replies that ended with the end-of-turn token: the sample decodes to the template over all messages."""
    config = small_config(sample_level="trajectory", **{"env.max_steps": 2})
    section = turn_section(config)
    chat = ChatFormat.of(tokenizer, config.prompt.system_prompt, config.prompt.example_turns())
    row = reset_row(section, chat, 0)
    rows = []
    for _ in range(2):
        row = play_turn(section, chat, row, fake_result(tokenizer, GARBAGE))
        rows.append(row)
    history = [row["observation"] for row in rows]
    text = tokenizer.decode(rows[-1]["prompt_ids"] + rows[-1]["response_ids"], skip_special_tokens=False)
    assert text.count(GARBAGE) == 2 and text.count("<|im_start|>assistant") == 2
    assert text.startswith("<|im_start|>system\n" + config.prompt.system_prompt)
    assert all(h in text for h in history) and text.endswith(GARBAGE + "<|im_end|>")


def test_concat_rows_matches_a_loop():
    rng = np.random.default_rng(0)
    la, lb = rng.integers(0, 5, 20), rng.integers(0, 5, 20)
    la[3] = lb[3] = 0
    a, b = rng.integers(0, 100, la.sum()).astype(np.int32), rng.integers(0, 100, lb.sum()).astype(np.int32)
    got = concat_rows((a, la), (b, lb), pa.list_(pa.int32())).to_pylist()
    oa, ob = np.r_[0, np.cumsum(la)], np.r_[0, np.cumsum(lb)]
    assert got == [list(a[oa[i]:oa[i + 1]]) + list(b[ob[i]:ob[i + 1]]) for i in range(20)]


def test_rollout_metrics_by_hand():
    """Episode A: invalid, valid+effective, valid reaching the goal. Episode B: invalid, invalid (max_steps)."""
    base = {"group_id": "g", "tag": "FrozenLake", "env_id": 0, "format_penalty": 0.0, "response_truncated": False,
            "episode_return": 0.0, "success": False, "done": False, "stop_reason": "", "action_effective": False}
    spec = [("A", 0, -0.01, False, {"format_penalty": -0.01, "response_truncated": True}),
            ("A", 1, 0.0, True, {"action_effective": True}),
            ("A", 2, 1.0, True, {"action_effective": True, "success": True, "done": True, "stop_reason": "terminated"}),
            ("B", 0, -0.01, False, {"format_penalty": -0.01}),
            ("B", 1, -0.01, False, {"format_penalty": -0.01, "done": True, "stop_reason": "max_steps"})]
    rows = [{**base, "traj_id": t, "turn_idx": k, "reward": r, "action_valid": v, **extra}
            for t, k, r, v, extra in spec]
    schema = TURNS.arrow_schema()
    narrow = pa.Table.from_pylist(rows, schema=pa.schema([schema.field(c) for c in NARROW_COLUMNS]))
    m = rollout_metrics(narrow, response_tokens=50, prompt_tokens=500)
    assert m["rollout/episodes"] == 2 and m["rollout/turns"] == 5
    assert m["rollout/success_rate"] == m["env/FrozenLake/success"] == 0.5
    assert m["rollout/valid_action_rate"] == pytest.approx(2 / 5)
    assert m["env/FrozenLake/action_is_valid"] == pytest.approx((2 / 3 + 0) / 2)
    assert m["env/FrozenLake/action_is_effective"] == pytest.approx((2 / 3 + 0) / 2)
    assert m["env/FrozenLake/format_penalty"] == pytest.approx((-0.01 / 3 - 0.01) / 2)
    assert m["env/FrozenLake/num_actions"] == m["rollout/mean_episode_length"] == 2.5
    assert m["rollout/format_penalty_rate"] == pytest.approx(3 / 5)
    assert m["rollout/truncated_response_rate"] == pytest.approx(1 / 5)
    assert m["rollout/episode_score/mean"] == pytest.approx((0.99 - 0.02) / 2)
    assert m["rollout/stop/terminated"] == m["rollout/stop/max_steps"] == 0.5
    assert m["env/response_length"] == 10 and m["rollout/response_tokens"] == 50
