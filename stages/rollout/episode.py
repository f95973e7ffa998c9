"""One turn of an episode as a pure function of the previous turn's row (spec §11): no Ray, no engine.

``reset_row`` starts episode ``env_id``; ``turn_request`` is what to ask the engine for the next turn;
``play_turn`` takes the previous row and the engine's sample and returns the new row: the env is restored from the
row's state, stepped with the reply text, and the next prompt is built. An episode ends when the env terminates, at
``max_steps`` turns, after an invalid reply when ``on_invalid_action: end``, or when the next prompt would not fit
in ``sequence_length`` (ROLL's MAX_LENGTH stop: the unanswered turn is never played).

Ids follow ROLL (§11.1): ``group_id`` = ``{tag}_{group_index}_{iteration}_{level_seed}`` (ROLL's traj_group_id with
the iteration as episode id), ``traj_id`` = ``{group_id}_{env_index}``. A mixed rollout numbers its groups across
tags (ROLL's make_env_configs): group ``g`` plays the tag whose range of the partition holds it, so group indices,
level seeds and ids stay distinct over the whole rollout. Level seeds and sampling seeds are derived
from the config seed by SHA-256 (ROLL draws them from Python's global RNG: not reproducible).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from schemas.errors import ConfigError
from schemas.rollout_config import TagEnv, TurnSection, tag_of_group
from stages.envs import make_env, restore_env
from stages.example import state_hash
from stages.generation.engines import GenRequest, GenResult, SamplingSpec
from stages.rollout.prompts import (ChatFormat, answer_options, first_user_message, next_user_message,
                                   step_user_message)
from stages.rollout.tables import STOP_INVALID, STOP_MAX_STEPS, STOP_MAX_TOKENS, STOP_TERMINATED

SEED_BITS = 31


def _derived_seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << SEED_BITS) - 1)


def level_seed(seed: int, iteration: int, group_index: int) -> int:
    """The level every episode of group ``group_index`` plays in ``iteration``."""
    return _derived_seed("rollflow-level", seed, iteration, group_index)


def request_seed(seed: int, iteration: int, env_id: int, turn: int) -> int:
    """The sampling seed of episode ``env_id``'s reply in ``turn``: independent of batching and engine count."""
    return _derived_seed("rollflow-sample", seed, iteration, env_id, turn)


def env_kwargs(section: TurnSection, entry: TagEnv) -> dict[str, Any]:
    """Constructor arguments of tag ``entry``'s environment: its env_config + max_steps (+ the config's
    format_penalty)."""
    kwargs = dict(entry.env_config)
    kwargs["max_steps"] = entry.max_steps
    if section.format_penalty is not None:
        kwargs["format_penalty"] = section.format_penalty
    return kwargs


def env_entry(section: TurnSection, env_id: int) -> TagEnv:
    """The tag (environment, turn limit) episode ``env_id`` plays."""
    return tag_of_group(section.env_layout(), env_id // section.env.group_size)


def _entry_of_tag(section: TurnSection, tag: str) -> TagEnv:
    for entry in section.env_layout():
        if entry.tag == tag:
            return entry
    raise ConfigError(f"episode of tag '{tag}': the rollout's tags are {list(section.env.tag_list)}; the turn "
                      "table was written by another config — re-run the rollout with --force")


def _ids(env_id: int, tag: str, section: TurnSection, seed: int) -> dict[str, Any]:
    group_index, env_index = divmod(env_id, section.env.group_size)
    group_id = f"{tag}_{group_index}_{section.iteration}_{seed}"
    return {"traj_id": f"{group_id}_{env_index}", "group_id": group_id, "tag": tag, "env_id": env_id,
            "group_index": group_index, "env_index": env_index, "level_seed": seed}


def _actions_left(max_steps: int, turn: int) -> int:
    return max_steps - turn


def _options(section: TurnSection, env: Any, env_id: int, turn: int) -> str:
    """``{answer_options}`` of episode ``env_id``'s ``turn`` ("" when no template shows it); a shuffled order is
    seeded by episode and turn, so a replayed or resumed turn sees the same prompt."""
    if not section.prompt.shows_answer_options():
        return ""
    actions = env.action_names()
    if not actions:
        raise ConfigError(f"prompt templates show {{answer_options}}, but environment {type(env).__name__} has no "
                          "named actions (free-text replies); remove {answer_options} from the prompt or use an "
                          "environment with an action_lookup")
    return answer_options(section.prompt, actions,
                          _derived_seed("rollflow-actions", section.seed, section.iteration, env_id, turn))


def _prompt_for(section: TurnSection, chat: ChatFormat, instruction: str, history: list[dict], observation: str,
                turn: int, prev: dict | None, max_steps: int, options: str) -> list[int]:
    """Token ids the engine gets in ``turn`` (``prev``: the row of turn - 1, None at turn 0)."""
    left = _actions_left(max_steps, turn)
    if section.sample_level == "step":
        return chat.single_turn_ids(step_user_message(section.prompt, instruction, history, observation, turn, left,
                                                      options))
    if prev is None:
        return chat.single_turn_ids(first_user_message(section.prompt, instruction, observation, turn, left, options))
    message = next_user_message(section.prompt, history[-1], observation, turn, left, options)
    return list(prev["prompt_ids"]) + list(prev["response_ids"]) + chat.continuation_ids(prev["response_ids"],
                                                                                          message)


def reset_row(section: TurnSection, chat: ChatFormat, env_id: int) -> dict:
    """The ``turn_idx = -1`` row of episode ``env_id``: the level reset and the first prompt."""
    seed = level_seed(section.seed, section.iteration, env_id // section.env.group_size)
    entry = env_entry(section, env_id)
    env = make_env(entry.env_type, **env_kwargs(section, entry))
    observation, info = env.reset(seed)
    first = _prompt_for(section, chat, info["env_instruction"], [], observation, 0, None, entry.max_steps,
                        _options(section, env, env_id, 0))
    if len(first) >= section.sequence_length:
        raise ConfigError(f"the first prompt of {entry.tag} has {len(first)} tokens, which does not fit "
                          f"sequence_length={section.sequence_length}; raise sequence_length (and the engine's "
                          "max_model_len) or shorten prompt templates")
    return {**_ids(env_id, entry.tag, section, seed), "turn_idx": -1, "observation": observation,
            "state_hash": state_hash(observation), "prompt_ids": [], "context_mask": [], "context_logprobs": [],
            "response_ids": [], "logprobs": [], "finish_reason": "", "response_truncated": False, "text": "",
            "action_content": "", "action_valid": False, "action_effective": False, "action_desc": "",
            "reward": 0.0, "format_penalty": 0.0, "success": False, "env_terminated": False, "env_truncated": False,
            "episode_return": 0.0, "done": False, "stop_reason": "", "next_observation": observation,
            "env_state": env.get_state(), "history": "[]", "next_prompt_ids": first}


def turn_request(section: TurnSection, prev: dict) -> GenRequest:
    """What to generate for the episode whose latest row is ``prev`` (its next prompt, seeded per episode/turn)."""
    prompt = prev["next_prompt_ids"]
    turn = prev["turn_idx"] + 1
    g = section.generating_args
    room = section.sequence_length - len(prompt)
    spec = SamplingSpec(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                        max_new_tokens=max(1, min(g.max_new_tokens, room)), stop=g.stop,
                        seed=request_seed(section.seed, section.iteration, prev["env_id"], turn), n=1)
    return GenRequest(prompt_token_ids=list(prompt), sampling=spec)


def _context(section: TurnSection, prev: dict, prompt_len: int) -> tuple[list[int], list[float]]:
    """``context_mask (P,)`` and ``context_logprobs (P-1,)`` of this turn's prompt (see tables.py)."""
    if section.sample_level == "step" or prev["turn_idx"] < 0:
        return [0] * prompt_len, [0.0] * max(prompt_len - 1, 0)
    tail = prompt_len - len(prev["prompt_ids"]) - len(prev["response_ids"])
    mask = list(prev["context_mask"]) + [1] * len(prev["response_ids"]) + [0] * tail
    logprobs = list(prev["context_logprobs"]) + list(prev["logprobs"]) + [0.0] * tail
    return mask, logprobs


def play_turn(section: TurnSection, chat: ChatFormat, prev: dict, result: GenResult) -> dict:
    """Step the episode of ``prev`` (its latest row) with the engine's ``result``; return this turn's row."""
    turn = prev["turn_idx"] + 1
    env = restore_env(prev["env_state"])
    observation = prev["next_observation"]
    next_observation, reward, terminated, truncated, info = env.step(result.text)
    metrics = info["metrics"]
    valid = bool(metrics["action_is_valid"])
    history = json.loads(prev["history"]) + [{
        "turn": turn, "observation": observation, "action_content": str(info.get("action_content", "")),
        "action_valid": valid, "action_desc": str(info.get("action_desc", "")), "reward": float(reward)}]
    done, stop = bool(terminated), STOP_TERMINATED if terminated else ""
    max_steps = _entry_of_tag(section, prev["tag"]).max_steps
    if not done and turn + 1 >= max_steps:
        done, stop = True, STOP_MAX_STEPS
    if not done and not valid and section.on_invalid_action == "end":
        done, stop = True, STOP_INVALID
    prompt = prev["next_prompt_ids"]
    row_so_far = {"prompt_ids": prompt, "response_ids": result.response_token_ids}
    next_prompt: list[int] = []
    if not done:
        next_prompt = _prompt_for(section, chat, env.get_instructions(), history, next_observation, turn + 1,
                                  row_so_far, max_steps, _options(section, env, prev["env_id"], turn + 1))
        if len(next_prompt) >= section.sequence_length:
            done, stop, next_prompt = True, STOP_MAX_TOKENS, []
    mask, logprobs = _context(section, prev, len(prompt))
    return {key: prev[key] for key in ("traj_id", "group_id", "tag", "env_id", "group_index", "env_index",
                                       "level_seed")} | {
        "turn_idx": turn, "observation": observation, "state_hash": state_hash(observation),
        "prompt_ids": list(prompt), "context_mask": mask, "context_logprobs": logprobs,
        "response_ids": list(result.response_token_ids), "logprobs": [float(x) for x in result.logprobs],
        "finish_reason": result.finish_reason, "response_truncated": result.truncated, "text": result.text,
        "action_content": str(info.get("action_content", "")), "action_valid": valid,
        "action_effective": bool(metrics["action_is_effective"]), "action_desc": str(info.get("action_desc", "")),
        "reward": float(reward), "format_penalty": float(metrics.get("format_penalty", 0.0)),
        "success": bool(metrics["success"]), "env_terminated": bool(terminated), "env_truncated": bool(truncated),
        "episode_return": float(prev["episode_return"]) + float(reward), "done": done, "stop_reason": stop,
        "next_observation": next_observation, "env_state": env.get_state(), "history": json.dumps(history),
        "next_prompt_ids": next_prompt}
