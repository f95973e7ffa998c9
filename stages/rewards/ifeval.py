"""Instruction-following reward (ALGORITHMS.md §10, ``GeneralRuleRewardWorker`` of ROLL's ifeval file).

``ground_truth`` is a constraint, a JSON object ``{"func_name": "validate_word_constraint", "N": 50,
"quantifier": "at most"}`` (ROLL's / open-instruct's vocabulary, :data:`CONSTRAINTS`), or a list of them (all must
hold). Score: 1 if every constraint holds on the answer (text after the last ``</think>``), else 0. Reward: score +
3-gram repetition penalty (max −0.5) of the whole response. A row whose constraint has no or an unknown
``func_name``, lacks a parameter, or asks for an unsupported check (response language) cannot be scored: None, and
the penalty list stays aligned with the rows ([BUG-15] fixed: ROLL skipped the append, and reused a stale result).

The checks are written here from the constraint descriptions; one ROLL/open-instruct defect is fixed:
``verify_keyword_frequency`` counted every word (``word == word``), it now counts the keyword.
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any, Callable

from stages.rewards.base import GROUND_TRUTH, RESPONSE, Rows, Score, json_ground_truth, outputs
from stages.rewards.registry import REWARD_WORKERS
from stages.rewards.text import after_last_think, repetition_penalty, strip_special_tokens


class Unscorable(ValueError):
    """The constraint cannot be checked (missing/unknown function or parameter, unsupported check)."""


def _quantified(count: int, n: int, quantifier: str, around: int) -> bool:
    if quantifier == "at least":
        return count >= n
    if quantifier == "at most":
        return count <= n
    if quantifier == "around":
        return abs(count - n) <= around
    raise Unscorable(f"quantifier '{quantifier}' is not 'at least', 'at most' or 'around'")


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+\b", text.lower())


def verify_keywords(text: str, keyword_list: list[str]) -> bool:
    lower = text.lower()
    return all(k.lower() in lower for k in keyword_list)


def verify_keyword_frequency(text: str, word: str, N: int) -> bool:
    return _words(text).count(word.lower()) == int(N)


def validate_forbidden_words(text: str, forbidden_words: list[str]) -> bool:
    return not any(re.search(r"\b" + re.escape(w.lower()) + r"\b", text.lower()) for w in forbidden_words)


def verify_letter_frequency(text: str, letter: str, N: int) -> bool:
    if len(letter) != 1:
        raise Unscorable(f"letter must be one character, got {letter!r}")
    return text.count(letter) == int(N)


def validate_response_language(text: str, language: str) -> bool:
    raise Unscorable("response-language checks need a language detector, which rollflow does not ship")


def verify_paragraph_count(text: str, N: int) -> bool:
    cleaned = "\n".join(line.strip() for line in text.splitlines()).strip()
    paragraphs = cleaned.split("* * *")
    return all(p.strip() for p in paragraphs) and len(paragraphs) == int(N)


def validate_word_constraint(text: str, N: int, quantifier: str) -> bool:
    return _quantified(len(text.split()), int(N), quantifier, around=max(round(int(N) * 0.1), 1))


def verify_sentence_constraint(text: str, N: int, quantifier: str) -> bool:
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s.strip()]
    return _quantified(len(sentences), int(N), quantifier, around=1)


def validate_paragraphs(text: str, N: int, first_word: str, i: int) -> bool:
    paragraphs = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    if len(paragraphs) != int(N) or not 1 <= int(i) <= len(paragraphs):
        return False
    words = paragraphs[int(i) - 1].split()
    return bool(words) and words[0].strip(".,;:!?\"'").lower() == first_word.lower()


def verify_postscript(text: str, postscript_marker: str) -> bool:
    at = text.rfind(postscript_marker)
    return at >= 0 and len(text[at:].strip()) > len(postscript_marker)


def validate_placeholders(text: str, N: int) -> bool:
    return len(re.findall(r"\[[^\[\]\n]+\]", text)) >= int(N)


def verify_bullet_points(text: str, N: int) -> bool:
    return sum(1 for line in text.splitlines() if re.match(r"\s*[*-]\s+\S", line)) == int(N)


def validate_title(text: str) -> bool:
    return re.search(r"<<[^<>\n]+>>", text) is not None


def validate_choice(text: str, options: list[str]) -> bool:
    return any(option in text for option in options)


def validate_highlighted_sections(text: str, N: int) -> bool:
    return len(re.findall(r"\*[^\s*][^*\n]*\*", text)) >= int(N)


def validate_sections(text: str, N: int, section_splitter: str) -> bool:
    sections = re.split(r"\s*" + re.escape(section_splitter) + r"\s*\d*\s*", text)
    if sections and not sections[0].strip():
        sections = sections[1:]
    return len(sections) == int(N)


def validate_json_format(text: str) -> bool:
    body = re.sub(r"^```(?:json)?\s*|\s*```$", "", text.strip())
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def validate_repeat_prompt(text: str, original_prompt: str) -> bool:
    return text.strip().startswith(original_prompt.strip())


def validate_two_responses(text: str) -> bool:
    parts = text.split("******")
    return len(parts) == 2 and all(p.strip() for p in parts) and parts[0].strip() != parts[1].strip()


def validate_uppercase(text: str) -> bool:
    return text == text.upper()


def validate_lowercase(text: str) -> bool:
    return text == text.lower()


def validate_frequency_capital_words(text: str, N: int, quantifier: str) -> bool:
    return _quantified(len(re.findall(r"\b[A-Z][A-Z]+\b", text)), int(N), quantifier, around=0)


def validate_end(text: str, end_phrase: str) -> bool:
    return text.strip().endswith(end_phrase.strip())


def validate_quotation(text: str) -> bool:
    stripped = text.strip()
    return len(stripped) >= 2 and stripped[0] == '"' and stripped[-1] == '"'


def validate_no_commas(text: str) -> bool:
    return "," not in text


CONSTRAINTS: dict[str, Callable[..., bool]] = {f.__name__: f for f in (
    verify_keywords, verify_keyword_frequency, validate_forbidden_words, verify_letter_frequency,
    validate_response_language, verify_paragraph_count, validate_word_constraint, verify_sentence_constraint,
    validate_paragraphs, verify_postscript, validate_placeholders, verify_bullet_points, validate_title,
    validate_choice, validate_highlighted_sections, validate_sections, validate_json_format, validate_repeat_prompt,
    validate_two_responses, validate_uppercase, validate_lowercase, validate_frequency_capital_words, validate_end,
    validate_quotation, validate_no_commas)}


def parse_constraints(ground_truth: Any) -> list[dict]:
    spec = json_ground_truth(ground_truth, "constraint is", Unscorable)
    spec = [spec] if isinstance(spec, dict) else spec
    if not isinstance(spec, list) or not spec or not all(isinstance(c, dict) for c in spec):
        raise Unscorable("expected a constraint object or a non-empty list of them")
    return spec


def check_constraint(text: str, constraint: dict) -> bool:
    """Run one constraint; parameters not in the check's signature are ignored (as ROLL does)."""
    name = constraint.get("func_name")
    if name not in CONSTRAINTS:
        raise Unscorable(f"func_name {name!r} is missing or unknown; known: {', '.join(sorted(CONSTRAINTS))}")
    check = CONSTRAINTS[name]
    parameters = list(inspect.signature(check).parameters)[1:]
    missing = [p for p in parameters if constraint.get(p) is None]
    if missing:
        raise Unscorable(f"{name} needs parameters {missing}")
    try:
        return bool(check(text, **{p: constraint[p] for p in parameters}))
    except (TypeError, ValueError) as error:
        if isinstance(error, Unscorable):
            raise
        raise Unscorable(f"{name}: bad parameter ({error})") from None


def instruction_score(response: str, ground_truth: Any) -> Score:
    """1.0 if every constraint holds on the answer, 0.0 if one fails, None if they cannot be checked."""
    try:
        constraints = parse_constraints(ground_truth)
        results = [check_constraint(response, c) for c in constraints]
    except Unscorable:
        return None
    return 1.0 if all(results) else 0.0


@REWARD_WORKERS.register("ifeval")
class IFEvalWorker:
    """Columns: ``response``, ``ground_truth`` (constraints). Kwargs: ``repetition_ngram``,
    ``repetition_max_penalty`` (≤ 0; 0 disables the penalty)."""

    columns = (RESPONSE, GROUND_TRUTH)

    def __init__(self, repetition_ngram: int = 3, repetition_max_penalty: float = -0.5) -> None:
        self.repetition_ngram = repetition_ngram
        self.repetition_max_penalty = repetition_max_penalty

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]:
        scores: list[Score] = []
        rewards: list[Score] = []
        for response, ground_truth in zip(rows[RESPONSE], rows[GROUND_TRUTH]):
            text = strip_special_tokens(str(response))
            score = instruction_score(after_last_think(text), ground_truth)
            scores.append(score)
            penalty = repetition_penalty(text, self.repetition_ngram, self.repetition_max_penalty)
            rewards.append(None if score is None else score + penalty)
        return outputs(scores, rewards)
