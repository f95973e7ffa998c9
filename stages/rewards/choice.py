"""Multiple-choice rewards (ALGORITHMS.md §10): ``MultipleChoiceBoxedRuleRewardWorker`` (BUG-12 fixed),
``GeneralValRuleRewardWorker`` (BUG-13 fixed) and ``CrossThinkQARuleRewardWorker`` (BUG-14 fixed).

The choice letter of a response is the first uppercase character of its answer. Ground truths are letters
(``"B"``, or text starting with the letter); an empty ground truth cannot be scored (None).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from stages.rewards.base import GROUND_TRUTH, RESPONSE, RESPONSE_LENGTH, TAG, Rows, Score, outputs
from stages.rewards.registry import REWARD_WORKERS
from stages.rewards.text import after_last_think, first_uppercase, last_boxed, repetition_penalty, strip_special_tokens

_SIMPLE_BOXED = re.compile(r"\\boxed\{([^}]+)\}")


def _gold_letter(ground_truth: Any) -> str | None:
    text = "" if ground_truth is None else str(ground_truth).strip()
    return text[0] if text else None


@dataclass(frozen=True)
class ChoiceAnswer:
    """What the single-choice rule read from a response: the answer text, whether it came from ``\\boxed{}``
    (the format flag), and the chosen letter."""

    text: str
    boxed: bool
    letter: str | None

    def correct(self, gold: str) -> bool:
        return self.letter == gold


def single_choice_answer(answer: str) -> ChoiceAnswer:
    """ROLL's single-choice extraction: last ``\\boxed{...}`` (no nested braces); else the text after the last
    "answer is" (case-insensitive); else the whole answer. The letter is its first uppercase character."""
    boxes = _SIMPLE_BOXED.findall(answer)
    if boxes:
        text, boxed = boxes[-1], True
    else:
        at = answer.lower().rfind("answer is")
        text, boxed = (answer if at < 0 else answer[at + len("answer is"):]), False
    return ChoiceAnswer(text, boxed, first_uppercase(text))


# (correct, boxed) → reward for each reward_type (§10 table).
CHOICE_REWARDS = {
    "loose": {(True, True): 1.0, (True, False): 1.0, (False, True): -1.0, (False, False): -1.0},
    "soft": {(True, True): 1.0, (True, False): 0.5, (False, True): -0.5, (False, False): -1.0},
    "strict": {(True, True): 1.0, (True, False): -1.0, (False, True): -1.0, (False, False): -1.0},
}


def choice_reward(answer: ChoiceAnswer, gold: str, reward_type: str = "loose") -> float:
    return CHOICE_REWARDS[reward_type][(answer.correct(gold), answer.boxed)]


@REWARD_WORKERS.register("multiple_choice_boxed")
class MultipleChoiceBoxedWorker:
    """Score 1 if the last (brace-matched) ``\\boxed{}`` exists and its first uppercase letter equals the ground
    truth's first character, else 0. The reward equals the score (ROLL emits zero rewards, [BUG-12])."""

    columns = (RESPONSE, GROUND_TRUTH)

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]:
        scores: list[Score] = []
        for response, ground_truth in zip(rows[RESPONSE], rows[GROUND_TRUTH]):
            gold = _gold_letter(ground_truth)
            if gold is None:
                scores.append(None)
                continue
            boxed = last_boxed(after_last_think(strip_special_tokens(str(response))))
            scores.append(1.0 if boxed is not None and first_uppercase(boxed) == gold else 0.0)
        return outputs(scores)


@REWARD_WORKERS.register("general_val_rule")
class GeneralValRuleWorker:
    """Validation-only single-choice check for the tags in ``tags`` (default ceval, race_high, mmlu_pro,
    commonsense_qa): score 1 if the loose choice reward is positive (the letter is correct), else 0; reward 0
    (validation gives no training signal). Rows with any other tag cannot be scored: None ([BUG-13] fixed)."""

    columns = (RESPONSE, GROUND_TRUTH, TAG)
    DEFAULT_TAGS = ("ceval", "race_high", "mmlu_pro", "commonsense_qa")

    def __init__(self, tags: Sequence[str] = DEFAULT_TAGS) -> None:
        self.tags = frozenset(tags)

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]:
        scores: list[Score] = []
        for response, ground_truth, tag in zip(rows[RESPONSE], rows[GROUND_TRUTH], rows[TAG]):
            gold = _gold_letter(ground_truth)
            if tag not in self.tags or gold is None:
                scores.append(None)
                continue
            answer = single_choice_answer(after_last_think(strip_special_tokens(str(response))))
            scores.append(1.0 if choice_reward(answer, gold, "loose") > 0 else 0.0)
        return outputs(scores, [None if s is None else 0.0 for s in scores])


@REWARD_WORKERS.register("crossthinkqa")
class CrossThinkQAWorker:
    """Reward = choice reward (``reward_type`` loose/soft/strict table) + 3-gram repetition penalty (down to
    ``repetition_max_penalty``) + ``response_length_penalty_coef`` · length reward; score = 1 if the choice reward is
    positive. The length reward is ``−min(1, response_length / max_response_length)`` on the row's real (unpadded)
    token count, column ``response_length`` ([BUG-14] fixed: ROLL measured the padded tensor, a constant); it is
    only read when the coefficient is not 0."""

    columns = (RESPONSE, GROUND_TRUTH)

    def __init__(self, reward_type: str = "loose", repetition_ngram: int = 3, repetition_max_penalty: float = -0.5,
                 response_length_penalty_coef: float = 0.0, max_response_length: int = 4096) -> None:
        if reward_type not in CHOICE_REWARDS:
            raise ValueError(f"crossthinkqa reward_type '{reward_type}' is not one of {sorted(CHOICE_REWARDS)}")
        if max_response_length <= 0:
            raise ValueError(f"crossthinkqa max_response_length must be positive, got {max_response_length}")
        self.reward_type = reward_type
        self.repetition_ngram = repetition_ngram
        self.repetition_max_penalty = repetition_max_penalty
        self.length_coef = response_length_penalty_coef
        self.max_response_length = max_response_length
        if response_length_penalty_coef:
            self.columns = (RESPONSE, GROUND_TRUTH, RESPONSE_LENGTH)

    def length_reward(self, response_length: int) -> float:
        return -min(1.0, max(0, int(response_length)) / self.max_response_length)

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]:
        lengths = rows[RESPONSE_LENGTH] if self.length_coef else [0] * len(rows[RESPONSE])
        scores: list[Score] = []
        rewards: list[Score] = []
        for response, ground_truth, length in zip(rows[RESPONSE], rows[GROUND_TRUTH], lengths):
            gold = _gold_letter(ground_truth)
            if gold is None:
                scores.append(None)
                rewards.append(None)
                continue
            text = strip_special_tokens(str(response))
            choice = choice_reward(single_choice_answer(after_last_think(text)), gold, self.reward_type)
            reward = choice + repetition_penalty(text, self.repetition_ngram, self.repetition_max_penalty)
            if self.length_coef:
                reward += self.length_coef * self.length_reward(length)
            scores.append(1.0 if choice > 0 else 0.0)
            rewards.append(reward)
        return outputs(scores, rewards)
