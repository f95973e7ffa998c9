"""Prompts of the episode loop (spec §11.2), as exact token ids. Pure: a tokenizer in, lists of ints out.

Trajectory level (ROLL's TrajEnvManager): turn 0's prompt is the chat template over the system prompt and the first
user message (env instruction + first observation). A later turn's prompt is the previous prompt + the sampled
response ids + a continuation segment: the template's end of the assistant turn (without the end-of-turn token when
the reply already ended with it) followed by the templated next user message and the assistant header. Sampled
tokens are never re-tokenised, so the trajectory sample holds exactly what the model saw and produced.

Step level (ROLL's StepEnvManager, GiGPO): each turn is a fresh single-turn prompt with the instruction, a history of
the last ``history_length - 1`` turns (every entry rendered — BUG-16 fixed) and the current observation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from schemas.errors import RollflowError
from schemas.rollout_config import PromptConfig
from stages.generation.engines import chat_prompt_token_ids

_PROBE_USER, _PROBE_REPLY = "rollflow-probe-user", "rollflow-probe-reply"


def _render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


@dataclass
class ChatFormat:
    """The tokenizer's chat template, split into the pieces the episode loop concatenates.

    ``turn_closing``: the text the template puts after an assistant message's content (ChatML: ``"<|im_end|>\\n"``);
    ``end_of_turn_ids``: token ids that end a reply (eos); ``end_of_turn_text``: the eos text; ``examples``:
    in-context (user, assistant) turns placed after the system message in every prompt.
    """

    tokenizer: Any
    system_prompt: str
    turn_closing: str
    end_of_turn_ids: frozenset[int]
    end_of_turn_text: str
    examples: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, tokenizer: Any, system_prompt: str, examples: Sequence[tuple[str, str]] = ()) -> "ChatFormat":
        if not getattr(tokenizer, "chat_template", None):
            raise RollflowError("the checkpoint's tokenizer has no chat template; the rollout builds prompts with it "
                                "— use an instruct checkpoint whose tokenizer defines one")
        examples = tuple((str(u), str(a)) for u, a in examples)
        probe = _render(tokenizer, cls._head(system_prompt, examples) + [{"role": "user", "content": _PROBE_USER},
                                                                  {"role": "assistant", "content": _PROBE_REPLY}],
                        False)
        if _PROBE_REPLY not in probe:
            raise RollflowError("the tokenizer's chat template drops assistant messages; multi-turn prompts cannot "
                                "be built with it — use another checkpoint or sample_level: step")
        closing = probe[probe.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]
        eos = tokenizer.eos_token_id
        eos_ids = frozenset([int(eos)] if eos is not None else [])
        eos_text = tokenizer.eos_token or ""
        return cls(tokenizer, system_prompt, closing, eos_ids, eos_text, examples)

    @staticmethod
    def _head(system_prompt: str, examples: Sequence[tuple[str, str]]) -> list[dict]:
        """The messages before the episode's own: the system prompt and the in-context example turns."""
        head = [{"role": "system", "content": system_prompt}] if system_prompt else []
        for user, assistant in examples:
            head += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return head

    def single_turn_ids(self, user_content: str) -> list[int]:
        """System + one user message + the assistant header, as token ids."""
        return chat_prompt_token_ids(self.tokenizer, self._head(self.system_prompt, self.examples)
                                     + [{"role": "user", "content": user_content}])

    def continuation_ids(self, response_ids: Sequence[int], user_content: str) -> list[int]:
        """Token ids between a reply and the next reply: end of the assistant turn + next user turn + header."""
        base = self._head(self.system_prompt, self.examples) + [{"role": "user", "content": _PROBE_USER},
                                                   {"role": "assistant", "content": _PROBE_REPLY}]
        before = _render(self.tokenizer, base, False)
        after = _render(self.tokenizer, base + [{"role": "user", "content": user_content}], True)
        if not after.startswith(before):
            raise RollflowError("the tokenizer's chat template re-renders earlier turns when a message is added, so "
                                "a conversation cannot grow by appending tokens; use sample_level: step")
        closing = self.turn_closing
        ended_by_model = bool(response_ids) and int(response_ids[-1]) in self.end_of_turn_ids
        if ended_by_model and self.end_of_turn_text and closing.startswith(self.end_of_turn_text):
            closing = closing[len(self.end_of_turn_text):]
        return _ids(self.tokenizer, closing + after[len(before):])


# ---- message text --------------------------------------------------------------------------------------------------

def format_reward(reward: float) -> str:
    return f"{reward:g}"


def reply_summary(entry: dict) -> str:
    """What the history shows as the model's answer: the parsed action, or a note that there was none."""
    return entry["action_content"] if entry["action_valid"] else "no valid action"


def answer_options(prompt: PromptConfig, actions: Sequence[str], order_seed: int) -> str:
    """The env's ``actions`` as ``{answer_options}`` shows them: each through ``prompt.answer_option``, joined as
    "A, B, C or D", in the env's order (``action_order: listed``) or in one drawn from ``order_seed`` (shuffled)."""
    names = list(actions)
    if prompt.action_order == "shuffled":
        random.Random(order_seed).shuffle(names)
    shown = [prompt.answer_option.format(action=name) for name in names]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def first_user_message(prompt: PromptConfig, instruction: str, observation: str, turn: int, actions_left: int,
                       options: str = "") -> str:
    return prompt.first_user.format(instruction=instruction, observation=observation, turn=turn + 1,
                                    actions_left=actions_left, answer_options=options)


def next_user_message(prompt: PromptConfig, last: dict, observation: str, turn: int, actions_left: int,
                      options: str = "") -> str:
    """The user message after turn ``turn - 1`` whose history entry is ``last``."""
    return prompt.next_user.format(observation=observation, turn=turn + 1, actions_left=actions_left,
                                   reward=format_reward(last["reward"]), action_desc=last["action_desc"],
                                   reply=reply_summary(last), answer_options=options)


def history_block(prompt: PromptConfig, history: Sequence[dict]) -> str:
    """The last ``history_length - 1`` entries of ``history`` (all rendered: BUG-16 fixed), or "" if none."""
    keep = prompt.history_length - 1
    shown = list(history)[-keep:] if keep > 0 else []
    if not shown:
        return ""
    lines = [prompt.history_entry.format(turn=e["turn"] + 1, observation=e["observation"], reply=reply_summary(e),
                                         action_desc=e["action_desc"], reward=format_reward(e["reward"]))
             for e in shown]
    return prompt.history_header + "".join(lines) + "\n"


def step_user_message(prompt: PromptConfig, instruction: str, history: Sequence[dict], observation: str, turn: int,
                      actions_left: int, options: str = "") -> str:
    return prompt.step_user.format(instruction=instruction, history=history_block(prompt, history),
                                   observation=observation, turn=turn + 1, actions_left=actions_left,
                                   answer_options=options)
