"""The pure parts of the rollout: prompts as token ids, one turn of an episode, the stop rules, the config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.errors import ConfigError
from schemas.rollout_config import RolloutConfig, turn_section
from stages.envs import restore_env
from stages.example import state_hash
from stages.rollout.episode import level_seed, play_turn, reset_row, turn_request
from stages.rollout.prompts import ChatFormat, answer_options, history_block, step_user_message

from .helpers import GARBAGE, GOOD, fake_result, small_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatFormat.of(tokenizer, "You play games.")


def _template_text(tokenizer, turns: list[tuple[str, str]], last_user: str) -> str:
    messages = [{"role": "system", "content": "You play games."}]
    for user, reply in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": last_user})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---- prompts ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ended_by_eos", [True, False])
def test_growing_conversation_equals_the_chat_template(tokenizer, chat, ended_by_eos):
    """prompt_0 + reply ids + continuation renders exactly the template over the whole conversation, whether the
    reply ended with the end-of-turn token or was cut (then the continuation supplies it)."""
    first = chat.single_turn_ids("observe 1")
    reply = tokenizer("<answer>Left</answer>", add_special_tokens=False)["input_ids"]
    if ended_by_eos:
        reply = reply + [tokenizer.eos_token_id]
    continuation = chat.continuation_ids(reply, "observe 2")
    assert (continuation[0] == tokenizer.eos_token_id) is (not ended_by_eos)
    text = tokenizer.decode(first + reply + continuation, skip_special_tokens=False)
    assert text == _template_text(tokenizer, [("observe 1", "<answer>Left</answer>")], "observe 2")


def test_example_turns_precede_the_episode_in_every_prompt(tokenizer):
    """prompt.examples: the in-context turns sit between the system message and the episode's own messages, in the
    first prompt and in the growing conversation alike."""
    config = small_config(**{"prompt.examples": [{"user": "EX STATE", "assistant": "<answer>Right</answer>"}]})
    examples = config.prompt.example_turns()
    assert examples == (("EX STATE", "<answer>Right</answer>"),)
    chat = ChatFormat.of(tokenizer, "You play games.", examples)
    first = chat.single_turn_ids("observe 1")
    reply = tokenizer("<answer>Left</answer>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    text = tokenizer.decode(first + reply + chat.continuation_ids(reply, "observe 2"), skip_special_tokens=False)
    assert text == _template_text(tokenizer, [*examples, ("observe 1", "<answer>Left</answer>")], "observe 2")
    with pytest.raises(ValueError, match="assistant"):
        small_config(**{"prompt.examples": [{"user": "EX STATE"}]})


def test_step_prompt_renders_every_history_entry(tokenizer):
    """BUG-16 fixed: valid and invalid past turns both appear; only the last history_length - 1 of them."""
    config = small_config(**{"prompt.history_length": 3})
    history = [{"turn": k, "observation": f"GRID{k}", "action_content": a, "action_valid": v,
                "action_desc": f"desc{k}", "reward": r}
               for k, (a, v, r) in enumerate([("Up", True, 0.0), ("", False, -0.01), ("Left", True, 1.0)])]
    text = step_user_message(config.prompt, "INSTR", history, "NOW", 3, 2)
    assert "GRID0" not in text  # history_length 3 → the 2 previous turns
    assert "GRID1" in text and "GRID2" in text and "no valid action" in text and "Your answer: Left" in text
    assert text.index("GRID1") < text.index("GRID2") < text.index("NOW")
    assert history_block(small_config(**{"prompt.history_length": 1}).prompt, history) == ""



_OPTIONS_USER = "{instruction}\n{observation}\nReply with one of {answer_options}."
_OPTIONS_NEXT = "{action_desc}\n{observation}\nReply with one of {answer_options}."


def test_answer_options_list_every_action_once_in_the_env_or_a_seeded_order():
    listed = small_config().prompt
    assert answer_options(listed, ["Left", "Down", "Right", "Up"], 0) == \
        "<answer>Left</answer>, <answer>Down</answer>, <answer>Right</answer> or <answer>Up</answer>"
    shuffled = small_config(**{"prompt.action_order": "shuffled", "prompt.answer_option": "'{action}'",
                               "prompt.first_user": _OPTIONS_USER}).prompt
    orders = [answer_options(shuffled, ["Left", "Down", "Right", "Up"], seed) for seed in range(64)]
    for text in orders:
        assert sorted(text.replace(" or ", ", ").split(", ")) == ["'Down'", "'Left'", "'Right'", "'Up'"]
    assert orders[5] == answer_options(shuffled, ["Left", "Down", "Right", "Up"], 5)  # seeded
    firsts = [text.split(",")[0] for text in orders]
    assert all(firsts.count(f"'{a}'") >= 8 for a in ("Left", "Down", "Right", "Up")), firsts
    assert answer_options(listed, ["Stay"], 0) == "<answer>Stay</answer>"
    # dumped (and so fingerprinted) only when set: runs committed before the options existed keep their stages
    assert "action_order" not in listed.model_dump() and shuffled.model_dump()["action_order"] == "shuffled"


def test_shuffled_answer_options_are_drawn_per_episode_and_turn_and_replay_exactly(tokenizer, chat):
    """Every prompt shows the env's four moves; the order differs between episodes and turns of one level, and
    rebuilding a turn from its row gives the same prompt (resume and replay see what the model saw)."""
    section = turn_section(small_config(**{"prompt.first_user": _OPTIONS_USER, "prompt.next_user": _OPTIONS_NEXT,
                                           "prompt.action_order": "shuffled", "env.group_size": 8}))
    starts = [reset_row(section, chat, env_id) for env_id in range(8)]
    texts = [tokenizer.decode(r["next_prompt_ids"]) for r in starts]
    shown = [t[t.rindex("Reply with one of"):] for t in texts]
    assert len(set(shown)) > 1 and all(s.count("<answer>") == 4 for s in shown)
    assert reset_row(section, chat, 3) == starts[3]
    row = play_turn(section, chat, starts[0], fake_result(tokenizer, GOOD))
    later = tokenizer.decode(row["next_prompt_ids"])
    assert later.count("Reply with one of") == 2 and all(m in later[later.rindex("Reply"):]
                                                           for m in ("Left", "Down", "Right", "Up"))
    assert play_turn(section, chat, starts[0], fake_result(tokenizer, GOOD)) == row
    listed = turn_section(small_config(**{"prompt.first_user": _OPTIONS_USER}))
    assert "<answer>Left</answer>, <answer>Down</answer>, <answer>Right</answer> or <answer>Up</answer>" in \
        tokenizer.decode(reset_row(listed, chat, 0)["next_prompt_ids"])


def test_answer_options_need_an_env_with_named_actions(chat):
    section = turn_section(small_config(**{"env.tag": "GemMath", "prompt.first_user": _OPTIONS_USER,
                                           "env.env_config": {"data": [{"question": "1+1?", "answer": "2"}]}}))
    with pytest.raises(ConfigError, match="answer_options.*GemMath|no named actions"):
        reset_row(section, chat, 0)
    with pytest.raises(ValueError, match="answer_option must contain"):
        small_config(**{"prompt.answer_option": "<answer>{move}</answer>"})
    with pytest.raises(ValueError, match="which no user message shows"):
        small_config(**{"prompt.action_order": "shuffled"})


# ---- reset and seeds -------------------------------------------------------------------------------------------

def test_groups_share_a_level_and_ids_follow_roll(chat):
    section = turn_section(small_config(**{"env.num_env_groups": 3}))
    rows = [reset_row(section, chat, env_id) for env_id in range(6)]
    assert rows[0]["level_seed"] == rows[1]["level_seed"] == level_seed(42, 0, 0)
    assert rows[0]["observation"] == rows[1]["observation"]
    assert len({r["level_seed"] for r in rows}) == 3
    assert rows[3]["group_id"] == f"FrozenLake_1_0_{rows[3]['level_seed']}" and rows[3]["traj_id"].endswith("_1")
    assert [r["turn_idx"] for r in rows] == [-1] * 6 and all(r["next_prompt_ids"] for r in rows)
    again = turn_section(small_config(**{"env.num_env_groups": 3}))
    assert reset_row(again, chat, 5) == rows[5]  # deterministic
    other_iteration = turn_section(small_config(iteration=1))
    assert reset_row(other_iteration, chat, 0)["level_seed"] != rows[0]["level_seed"]


def test_requests_are_seeded_per_episode_and_turn(chat):
    section = turn_section(small_config())
    rows = [reset_row(section, chat, env_id) for env_id in range(2)]
    seeds = {turn_request(section, r).sampling.seed for r in rows}
    assert len(seeds) == 2  # same prompt, different samples
    assert turn_request(section, rows[0]) == turn_request(section, rows[0])


def test_first_prompt_longer_than_sequence_length_is_a_config_error(chat):
    with pytest.raises(ConfigError, match="sequence_length"):
        reset_row(turn_section(small_config(sequence_length=40)), chat, 0)


# ---- one turn ------------------------------------------------------------------------------------------------

def test_garbage_reply_gets_the_format_penalty_and_the_episode_goes_on(tokenizer, chat):
    section = turn_section(small_config())
    start = reset_row(section, chat, 0)
    row = play_turn(section, chat, start, fake_result(tokenizer, GARBAGE))
    assert (row["action_valid"], row["reward"], row["format_penalty"], row["done"]) == (False, -0.01, -0.01, False)
    assert row["observation"] == row["next_observation"] == start["observation"]
    assert row["state_hash"] == state_hash(start["observation"]) and row["next_prompt_ids"]
    assert json.loads(row["history"])[0]["action_valid"] is False


def test_configured_penalty_and_ending_on_invalid_replies(tokenizer, chat):
    section = turn_section(small_config(format_penalty=-0.5, on_invalid_action="end"))
    row = play_turn(section, chat, reset_row(section, chat, 0), fake_result(tokenizer, GARBAGE))
    assert (row["reward"], row["done"], row["stop_reason"], row["next_prompt_ids"]) == (-0.5, True,
                                                                                         "invalid_action", [])


def test_overlong_reply_is_marked_and_the_next_turn_closes_it(tokenizer, chat):
    section = turn_section(small_config())
    start = reset_row(section, chat, 0)
    result = fake_result(tokenizer, "I will think about this for a long", finish_reason="length", eos=False)
    row = play_turn(section, chat, start, result)
    assert row["response_truncated"] and row["finish_reason"] == "length"
    cut = len(start["next_prompt_ids"]) + len(result.response_token_ids)
    assert row["next_prompt_ids"][:cut] == start["next_prompt_ids"] + result.response_token_ids
    assert row["next_prompt_ids"][cut] == tokenizer.eos_token_id


def test_max_steps_ends_the_episode(tokenizer, chat):
    section = turn_section(small_config(**{"env.max_steps": 1}))
    row = play_turn(section, chat, reset_row(section, chat, 0), fake_result(tokenizer, GOOD))
    assert (row["done"], row["stop_reason"], row["next_prompt_ids"]) == (True, "max_steps", [])


def test_next_prompt_beyond_sequence_length_ends_the_episode(tokenizer, chat):
    first_len = len(reset_row(turn_section(small_config()), chat, 0)["next_prompt_ids"])
    section = turn_section(small_config(sequence_length=first_len + 12))
    start = reset_row(section, chat, 0)
    assert turn_request(section, start).sampling.max_new_tokens == 8  # min(max_new_tokens, room = 12)
    tight = turn_section(small_config(sequence_length=first_len + 5))
    assert turn_request(tight, reset_row(tight, chat, 0)).sampling.max_new_tokens == 5
    row = play_turn(section, chat, start, fake_result(tokenizer, GOOD))
    assert (row["done"], row["stop_reason"], row["next_prompt_ids"]) == (True, "max_tokens", [])


def _terminal_move(section, chat):
    """An episode and a reply that moves its player onto a hole or the goal from the start."""
    moves = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
    for env_id in range(0, 200, section.env.group_size):
        start = reset_row(section, chat, env_id)
        env = restore_env(start["env_state"])
        r, c = divmod(env.s, env.size)
        for name, (dr, dc) in moves.items():
            if 0 <= r + dr < env.size and 0 <= c + dc < env.size and env.desc[r + dr][c + dc] in "HG":
                return start, name, env.desc[r + dr][c + dc]
    raise AssertionError("no level with a hole or goal next to the start in 100 groups")


def test_terminating_move_ends_the_episode(tokenizer, chat):
    section = turn_section(small_config(**{"env.num_env_groups": 100}))
    start, move, cell = _terminal_move(section, chat)
    row = play_turn(section, chat, start, fake_result(tokenizer, f"<answer>{move}</answer>"))
    assert row["action_valid"] and row["env_terminated"] and row["done"] and row["stop_reason"] == "terminated"
    assert row["reward"] == (1.0 if cell == "G" else 0.0) and row["success"] is (cell == "G")


# ---- config ------------------------------------------------------------------------------------------------------

def test_config_rules():
    from schemas.config import load_config, validate_config

    for name in ("rollout_frozenlake.yaml", "rollout_sokoban.yaml"):
        assert load_config(RolloutConfig, REPO / "configs" / name).num_episodes == 64
    with pytest.raises(ConfigError, match="unknown field"):
        validate_config(RolloutConfig, {"prompt": {"first_user": "{observation} {board}"}})
    with pytest.raises(ConfigError, match="max_model_len"):
        validate_config(RolloutConfig, {"sequence_length": 4096, "engine": {"max_model_len": 2048}})
    with pytest.raises(ConfigError, match="unknown option"):
        validate_config(RolloutConfig, {"generating_args": {"num_beams": 2}})
