"""LLM-as-judge reward (ALGORITHMS.md §10, ``LLMJudgeRewardWorker``) with structured verdict parsing.

The judge model is reached through a ``generate(prompts: list[str]) -> list[str]`` callable that the reward stage
injects (the generation stage owns the engine; this worker only builds prompts and parses replies). ROLL's parser
looked for the substrings "yes"/"no" ("no" matches "know", "yes" matches "eyes") while its default prompt asked for a
0–10 score [BUG-10]; and if every API retry failed it returned an undefined variable [BUG-11]. Here:

Both prompts ask for the verdict line first and a brief explanation after it, so a reply cut at the judge's token
budget (``judge.max_new_tokens``) keeps its verdict.

* ``verdict_format="verdict"``: the reply must contain a line ``VERDICT: CORRECT`` or ``VERDICT: INCORRECT``
  (case-insensitive, whole words, optional markdown emphasis); the last such line wins → 1.0 / 0.0;
* ``verdict_format="score"``: a line ``Score: N`` or ``Score: N/10`` with ``0 <= N <= max_score`` → N / max_score;
* a reply without a parseable verdict, or a row whose judge call failed after ``max_retries`` retries, cannot be
  scored: None (never a crash, never a guess).
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Sequence

from schemas.errors import InvariantError
from stages.rewards.base import GROUND_TRUTH, PROMPT, RESPONSE, Rows, Score, outputs
from stages.rewards.registry import REWARD_WORKERS
from stages.rewards.text import after_last_think, strip_special_tokens

logger = logging.getLogger(__name__)

Generate = Callable[[list[str]], Sequence[str | None]]

# what both judge prompts show the judge: the question, the reference and the answer to grade
_GRADING_HEADER = """You are grading an answer to a question against a reference answer.

Question:
{question}

Reference answer:
{reference}

Answer to grade:
{response}

"""

VERDICT_PROMPT = _GRADING_HEADER + """Decide whether the answer to grade is correct, i.e. equivalent to the reference answer. Begin your reply with \
exactly one line of the form
VERDICT: CORRECT
or
VERDICT: INCORRECT
then explain briefly on the following lines."""

SCORE_PROMPT = _GRADING_HEADER + """Rate the answer to grade from 0 (wrong) to 10 (fully correct). Begin your reply with exactly one line of the form
Score: N/10
then explain briefly on the following lines."""

_DECORATION = r"[\s*_#>`]*"
_VERDICT_LINE = re.compile(rf"^{_DECORATION}verdict{_DECORATION}:{_DECORATION}(correct|incorrect)\b{_DECORATION}\.?"
                           rf"{_DECORATION}$", re.IGNORECASE | re.MULTILINE)
_SCORE_LINE = re.compile(rf"^{_DECORATION}score{_DECORATION}:{_DECORATION}(\d+(?:\.\d+)?)\s*(?:/\s*(\d+))?"
                         rf"{_DECORATION}\.?{_DECORATION}$", re.IGNORECASE | re.MULTILINE)


def parse_verdict(reply: str | None) -> Score:
    """``VERDICT: CORRECT`` → 1.0, ``VERDICT: INCORRECT`` → 0.0 (last such line); anything else → None."""
    matches = _VERDICT_LINE.findall(reply or "")
    return None if not matches else (1.0 if matches[-1].lower() == "correct" else 0.0)


def parse_score(reply: str | None, max_score: float = 10.0) -> Score:
    """``Score: N`` / ``Score: N/10`` (last such line) → N / max_score; None if absent or out of range."""
    matches = _SCORE_LINE.findall(reply or "")
    if not matches:
        return None
    value, denominator = matches[-1]
    if denominator and float(denominator) != max_score:
        return None
    number = float(value)
    return number / max_score if 0 <= number <= max_score else None


@REWARD_WORKERS.register("llm_judge")
class LLMJudgeWorker:
    """Columns: ``prompt`` (the question), ``ground_truth`` (reference answer), ``response``. Kwargs:
    ``verdict_format`` (``verdict`` | ``score``), ``prompt_template`` (with ``{question}``, ``{reference}``,
    ``{response}``), ``max_score``, ``max_retries``. Service: ``generate``."""

    columns = (PROMPT, GROUND_TRUTH, RESPONSE)
    requires = ("generate",)

    def __init__(self, generate: Generate, verdict_format: str = "verdict", prompt_template: str | None = None,
                 max_score: float = 10.0, max_retries: int = 2) -> None:
        if verdict_format not in ("verdict", "score"):
            raise ValueError(f"llm_judge verdict_format '{verdict_format}' must be 'verdict' or 'score'")
        template = prompt_template or (VERDICT_PROMPT if verdict_format == "verdict" else SCORE_PROMPT)
        if "{response}" not in template:
            raise ValueError("llm_judge prompt_template must contain '{response}' (and usually '{question}' and "
                             "'{reference}')")
        self.generate = generate
        self.verdict_format = verdict_format
        self.template = template
        self.max_score = float(max_score)
        self.max_retries = int(max_retries)
        self.last_error: str | None = None

    def judge_prompt(self, question: object, reference: object, response: str) -> str:
        answer = after_last_think(strip_special_tokens(response)).strip()
        return self.template.format(question=question, reference=reference, response=answer)

    def parse(self, reply: str | None) -> Score:
        if self.verdict_format == "verdict":
            return parse_verdict(reply)
        return parse_score(reply, self.max_score)

    def _replies(self, prompts: list[str]) -> list[str | None]:
        """Judge replies; all None when every attempt raised ([BUG-11] fixed: the result is always defined)."""
        self.last_error = None
        for attempt in range(self.max_retries + 1):
            try:
                replies = list(self.generate(prompts))
            except Exception as error:  # the engine's failure must not crash scoring
                self.last_error = f"{type(error).__name__}: {error}"
                logger.warning("llm_judge: generate failed (attempt %d/%d): %s", attempt + 1,
                               self.max_retries + 1, self.last_error)
                continue
            if len(replies) != len(prompts):
                raise InvariantError(f"llm_judge: generate returned {len(replies)} replies for {len(prompts)} "
                                     "prompts; the generation service must return one reply per prompt, in order")
            return replies
        return [None] * len(prompts)

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]:
        prompts = [self.judge_prompt(q, g, str(r))
                   for q, g, r in zip(rows[PROMPT], rows[GROUND_TRUTH], rows[RESPONSE])]
        return outputs([self.parse(reply) for reply in self._replies(prompts)] if prompts else [])
