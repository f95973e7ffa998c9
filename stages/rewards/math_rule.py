"""Math rule reward (ALGORITHMS.md §10, ``MathRuleRewardWorker``): 1 if the final answer equals the ground truth.

Extraction as ROLL: the answer region is the text after the last ``</think>`` (final paragraph without think tags,
empty when the tags are malformed, :func:`math_answer_region`); the prediction is its last brace-matched
``\\boxed{}``, or the whole region. Equivalence is ``math_verify``'s ``verify(gold, pred)``.

Speed (>= 1,000 responses/s): a fast path decides plain numbers without ``math_verify``: identical normalised strings
are equal; two plain numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``, ``1,000``) are compared exactly with
fractions. Anything else (expressions, sets, units, percentages) goes to ``math_verify``, whose own SIGALRM timeout
bounds each parse/verify without spawning a process. SIGALRM only works in the main thread; elsewhere (e.g. a Ray
actor thread) calls run without a timeout. Parsed ground truths are cached (the ``n`` samples of a prompt share one).

Scores: 1/0; 0 when the response has no parseable answer; None ("cannot score") when the ground truth is empty or
unparseable. ROLL's unused side rewards (repetition, format, length) are not computed.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

from stages.rewards.base import GROUND_TRUTH, RESPONSE, Rows, Score, outputs
from stages.rewards.registry import REWARD_WORKERS
from stages.rewards.text import last_boxed, math_answer_region, strip_special_tokens

_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SLASH_FRACTION = re.compile(r"([+-]?\d+)/(\d+)")
_LATEX_FRACTION = re.compile(r"([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{(\d+)\}")
_NOISE = re.compile(r"\\[!,;: ]|\\left|\\right|(?<!\d)\s+|\s+(?!\d)")
_TEXT_WRAP = re.compile(r"^\\(?:text|mathrm|textbf|mathbf)\{(.*)\}$")


def normalise_answer(text: str) -> str:
    """Cheap canonical form used by the fast path: no spaces/LaTeX spacing, no ``$``, no trailing period."""
    text = _NOISE.sub("", text.strip().rstrip(".").strip().strip("$")).rstrip(".")
    wrapped = _TEXT_WRAP.match(text)
    return (wrapped.group(1) if wrapped else text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def plain_number(text: str) -> Fraction | None:
    """Exact value of a plain number in normalised text, or None when the text is anything else."""
    if _DECIMAL.fullmatch(text):
        return Fraction(text)
    if _THOUSANDS.fullmatch(text):
        return Fraction(text.replace(",", ""))
    match = _SLASH_FRACTION.fullmatch(text)
    if match and int(match.group(2)) != 0:
        return Fraction(int(match.group(1)), int(match.group(2)))
    match = _LATEX_FRACTION.fullmatch(text)
    if match and int(match.group(3)) != 0:
        value = Fraction(int(match.group(2)), int(match.group(3)))
        return -value if match.group(1) == "-" else value
    return None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class MathVerifier:
    """``math_verify`` parse/verify with its per-call SIGALRM timeout (main thread only) and a gold-answer cache."""

    def __init__(self, timeout_seconds: int = 5, gold_cache_size: int = 4096) -> None:
        import math_verify  # imported here: sympy makes it slow to import (~0.3 s)

        self._math_verify = math_verify
        self.timeout_seconds = int(timeout_seconds)
        self.parse_gold = lru_cache(maxsize=gold_cache_size)(self._parse_gold)

    def _timeout(self) -> int | None:
        return self.timeout_seconds if self.timeout_seconds > 0 and _in_main_thread() else None

    def parse(self, text: str) -> list[Any]:
        try:
            return self._math_verify.parse(text, parsing_timeout=self._timeout())
        except Exception:  # math_verify raises on pathological input despite raise_on_error=False
            return []

    def _parse_gold(self, gold: str) -> tuple[Any, ...]:
        """Parsed ground truth; empty when math_verify finds no expression (it falls back to the raw string)."""
        wrapped = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
        parsed = self.parse(wrapped) or self.parse(gold)
        return tuple(parsed) if any(not isinstance(item, str) for item in parsed) else ()

    def equal(self, gold: tuple[Any, ...], pred: list[Any]) -> bool:
        try:
            return bool(self._math_verify.verify(list(gold), pred, timeout_seconds=self._timeout()))
        except Exception:
            return False


@REWARD_WORKERS.register("math_rule")
class MathRuleWorker:
    """1 if the response's final answer is mathematically equal to ``ground_truth``, else 0; None when the ground
    truth cannot be parsed. Columns: ``response`` (decoded text), ``ground_truth`` (answer string)."""

    columns = (RESPONSE, GROUND_TRUTH)

    def __init__(self, timeout_seconds: int = 5, fast_path: bool = True) -> None:
        self.fast_path = fast_path
        self.verifier = MathVerifier(timeout_seconds)

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]:
        scores = [self.score(str(r), g) for r, g in zip(rows[RESPONSE], rows[GROUND_TRUTH])]
        return outputs(scores)

    def score(self, response: str, ground_truth: Any) -> Score:
        gold = "" if ground_truth is None else normalise_answer(str(ground_truth))
        if not gold:
            return None
        region = math_answer_region(strip_special_tokens(response))
        boxed = last_boxed(region)
        candidate = normalise_answer(region if boxed is None else boxed)
        gold_number = plain_number(gold)
        if self.fast_path and candidate and gold_number is not None:
            if candidate == gold:
                return 1.0
            pred_number = plain_number(candidate)
            if pred_number is not None:
                return 1.0 if pred_number == gold_number else 0.0
        gold_parsed = self.verifier.parse_gold(str(ground_truth).strip())
        if not gold_parsed:
            return None
        if self.fast_path and candidate == gold:
            return 1.0
        if not region:
            return 0.0
        pred_parsed = self.verifier.parse("\\boxed{" + boxed + "}" if boxed is not None else region)
        if not pred_parsed:
            return 0.0
        return 1.0 if self.verifier.equal(gold_parsed, pred_parsed) else 0.0
