"""Single-turn GEM-style environments for RLVR-style agent tasks: math (``\\boxed{}``) and QA (``<answer>`` tag).

``reset(seed)`` picks one ``{question, answer}`` item (GEM's rule: ``random.Random(seed).randint(0, n - 1)``) and
returns the question; ``step(text)`` parses the answer, rewards 1 if correct else 0, and terminates. A response with
no parseable answer gets ``format_penalty`` (recorded in the metrics). Data comes from an in-memory list of dicts or
a local ``.jsonl`` / ``.json`` / ``.parquet`` file (stages/envs/records.py) — nothing is downloaded.

Math verification here is deliberately simple (normalised string or numeric equality); the math-verify reward
worker in ``stages/rewards`` is the rich one.
"""

from __future__ import annotations

import math
import random
import re
import string
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from schemas.errors import ConfigError
from stages.envs.base import EnvStateError, TextEnv, check_seed, fresh_seed, step_info
from stages.envs.parser import DEFAULT_ACTION_PATTERN, DEFAULT_SPECIAL_TOKENS, ActionParser
from stages.envs.records import read_records
from stages.envs.registry import EnvSpec, register_env

TERMINAL_STATE = "TERMINAL_STATE"  # GEM's observation after a single-turn episode ended
MATH_INSTRUCTION = ("Solve the math problem. Reason step by step, then put the final answer within \\boxed{}.")
QA_INSTRUCTION = ("Answer the question. Put the final answer inside <answer> </answer> tags, "
                  "e.g. <answer>Paris</answer>.")


# ---- answer extraction and checking -------------------------------------------------------------------------------
def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (brace-matched) or ``\\boxed x``; ``None`` if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i):
        rest = text[i + 1:].split("$")[0].strip()
        return rest or None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


_LATEX_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle", "^{\\circ}", "^\\circ",
                "\\%", "%", "$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_FRAC = re.compile(r"^(-?)\\frac\{?(-?\d+)\}?\{?(-?\d+)\}?$")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")


def normalize_math_answer(answer: str) -> str:
    """Light normalisation: drop ``$``/spacing macros/units of degree and percent, ``\\text{}`` wrappers,
    ``dfrac``/``tfrac``, spaces, a trailing period and one pair of outer braces."""
    s = str(answer).strip()
    s = _TEXT.sub(r"\1", s)
    for noise in _LATEX_NOISE:
        s = s.replace(noise, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = "".join(s.split()).rstrip(".")
    if len(s) >= 2 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


def numeric_value(normalized: str) -> float | None:
    """``normalized`` as a number (``12``, ``-0.5``, ``3/4``, ``\\frac{3}{4}``), else ``None``."""
    frac = _FRAC.match(normalized)
    try:
        if frac:
            value = Fraction(int(frac.group(2)), int(frac.group(3)))
            return float(-value if frac.group(1) else value)
        if re.fullmatch(r"-?\d+/\d+", normalized):
            return float(Fraction(normalized))
        return float(normalized) if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)(e-?\d+)?", normalized) else None
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def math_answers_equal(predicted: str, gold: str) -> bool:
    """Exact equality after :func:`normalize_math_answer`, or equal numbers (relative tolerance 1e-9)."""
    p, g = normalize_math_answer(predicted), normalize_math_answer(gold)
    if p == g:
        return True
    pv, gv = numeric_value(p), numeric_value(g)
    return pv is not None and gv is not None and math.isclose(pv, gv, rel_tol=1e-9, abs_tol=1e-12)


def normalize_qa_answer(answer: str) -> str:
    """SQuAD-style: lower case, no punctuation, no articles, single spaces."""
    s = str(answer).lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


# ---- data ---------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _read_data_file(path: str, mtime_ns: int) -> tuple[dict, ...]:
    """The records of a data file, cached per file version (``mtime_ns``)."""
    return tuple(read_records(Path(path)))


def load_items(data: Sequence[Mapping] | None, data_path: str | None, question_key: str, answer_key: str,
               where: str) -> tuple[dict, ...] | None:
    """The ``{question, answer}`` items, checked; ``None`` when neither ``data`` nor ``data_path`` is given."""
    if data is not None and data_path is not None:
        raise ConfigError(f"{where}: give either data (in-memory list) or data_path (local file), not both")
    if data_path is not None:
        path = Path(data_path)
        if not path.is_file():
            raise ConfigError(f"{where}: data_path '{data_path}' does not exist; point it at a local "
                              ".jsonl/.json/.parquet file (no download is attempted)")
        rows = _read_data_file(str(path.resolve()), path.stat().st_mtime_ns)
        origin = str(data_path)
    elif data is not None:
        rows, origin = tuple(data), "data"
    else:
        return None
    if not rows:
        raise ConfigError(f"{where}: {origin} holds no items; give at least one {{question, answer}} item")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or question_key not in row or answer_key not in row:
            raise ConfigError(f"{where}: {origin} item {i} lacks '{question_key}' or '{answer_key}'; "
                              "set question_key/answer_key to the field names the data uses")
    return rows


# ---- environments -------------------------------------------------------------------------------------------------
class _SingleTurnEnv(TextEnv):
    """Shared logic: pick an item by seed, one answer step, reward 1/0, ``format_penalty`` when unparseable."""

    default_instruction = ""

    def __init__(self, data: Sequence[Mapping] | None = None, data_path: str | None = None,
                 question_key: str = "question", answer_key: str = "answer", format_penalty: float = 0.0,
                 env_instruction: str | None = None, action_pattern: str = DEFAULT_ACTION_PATTERN,
                 special_token_list: Sequence[str] | None = DEFAULT_SPECIAL_TOKENS, max_steps: int = 1) -> None:
        name = type(self).__name__
        self.items = load_items(data, data_path, question_key, answer_key, name)
        self.question_key, self.answer_key = question_key, answer_key
        self.format_penalty, self.max_steps = float(format_penalty), int(max_steps)
        self.env_instruction = env_instruction if env_instruction is not None else self.default_instruction
        self.special_tokens = tuple(special_token_list) if special_token_list is not None else ()
        self.parser = ActionParser(action_pattern, None, special_token_list)
        # in-memory data is not part of the state; restore(state, data=...) supplies it for further resets
        self._set_config({"data_path": data_path, "question_key": question_key, "answer_key": answer_key,
                          "format_penalty": self.format_penalty, "env_instruction": env_instruction,
                          "action_pattern": action_pattern, "special_token_list": special_token_list,
                          "max_steps": self.max_steps})
        self.question: str | None = None
        self.answer: Any = None
        self.index = -1
        self.seed: int | None = None
        self.step_count = 0
        self.done = False

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        seed = check_seed(seed, f"{type(self).__name__}.reset")
        if self.items is None:
            raise EnvStateError(f"{type(self).__name__}.reset: no data; pass data=[{{question, answer}}, ...] or "
                                "data_path=<local .jsonl> (also to restore(state, data=...))")
        self.seed = fresh_seed() if seed is None else seed
        self.index = random.Random(self.seed).randint(0, len(self.items) - 1)
        item = self.items[self.index]
        self.question, self.answer = str(item[self.question_key]), item[self.answer_key]
        self.step_count, self.done = 0, False
        return self.question, {"env_instruction": self.get_instructions()}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict]:
        if self.question is None:
            raise EnvStateError(f"{type(self).__name__}.step() called before reset(seed); reset the env first")
        self.step_count += 1
        parsed, answer = self._extract(action_text)
        if self.done:
            info = step_info(parsed, valid=False, effective=False, success=False, format_penalty=0.0,
                             action_desc=f"At turn {self.step_count}, the episode is already over.")
            return TERMINAL_STATE, 0.0, True, False, info
        self.done = True
        if answer is None:
            info = step_info(parsed, valid=False, effective=False, success=False, format_penalty=self.format_penalty,
                             action_desc=f"At turn {self.step_count}, You did not provide a valid answer.")
            return TERMINAL_STATE, self.format_penalty, True, False, info
        correct = self._is_correct(answer)
        verdict = "correct" if correct else "incorrect"
        info = step_info(parsed, valid=True, effective=True, success=correct, format_penalty=0.0,
                         action_desc=f"At turn {self.step_count}, you answered {answer}, which is {verdict}.")
        return TERMINAL_STATE, 1.0 if correct else 0.0, True, False, info

    def _extract(self, action_text: str) -> tuple[dict, str | None]:
        raise NotImplementedError

    def _is_correct(self, answer: str) -> bool:
        raise NotImplementedError

    def _gold_answers(self) -> list[str]:
        gold = self.answer
        return [str(g) for g in gold] if isinstance(gold, (list, tuple)) else [str(gold)]

    def render(self) -> str:
        if self.question is None:
            raise EnvStateError(f"{type(self).__name__}.render() called before reset(seed); reset the env first")
        return TERMINAL_STATE if self.done else self.question

    def get_instructions(self) -> str:
        return self.env_instruction

    def _started(self) -> bool:
        return self.question is not None

    def _dynamic_state(self) -> dict:
        return {"question": self.question, "answer": self.answer, "index": self.index, "seed": self.seed,
                "steps": self.step_count, "done": self.done}

    def _load_dynamic_state(self, state: Mapping[str, Any]) -> None:
        try:
            self.question, self.answer, self.index = str(state["question"]), state["answer"], int(state["index"])
            self.seed, self.step_count, self.done = state["seed"], int(state["steps"]), bool(state["done"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvStateError(f"{type(self).__name__} state is malformed ({exc!r}); pass the string get_state() "
                                "returned") from None


class GemMathEnv(_SingleTurnEnv):
    """Single-turn math: the answer is the last ``\\boxed{}``; correct = normalised string or numeric equality."""

    default_instruction = MATH_INSTRUCTION

    def _extract(self, action_text: str) -> tuple[dict, str | None]:
        text = action_text if isinstance(action_text, str) else ""
        for token in self.special_tokens:
            text = text.replace(token, "")
        boxed = last_boxed_content(text)
        answer = boxed.strip() if boxed is not None and boxed.strip() else None
        return {"action": answer, "action_content": answer or "", "think_content": ""}, answer

    def _is_correct(self, answer: str) -> bool:
        return any(math_answers_equal(answer, gold) for gold in self._gold_answers())


class GemQAEnv(_SingleTurnEnv):
    """Single-turn QA: the answer is ROLL's first ``<answer>...</answer>`` match (§9.3 parser, no lookup);
    correct = SQuAD-normalised exact match with any gold answer."""

    default_instruction = QA_INSTRUCTION

    def _extract(self, action_text: str) -> tuple[dict, str | None]:
        parsed = self.parser(action_text)
        answer = parsed.action_content if parsed.action_content else None
        info = parsed.as_info()
        info["action"] = answer
        return info, answer

    def _is_correct(self, answer: str) -> bool:
        predicted = normalize_qa_answer(answer)
        return any(predicted == normalize_qa_answer(gold) for gold in self._gold_answers())


# ---- registration (demo data: a self-contained instance for ``rollflow show`` and the contract test) --------------
_DEMO_MATH = ({"question": "What is 2 + 3?", "answer": "5"},
              {"question": "Compute 12 / 4.", "answer": "3"},
              {"question": "Simplify 6/8 to lowest terms.", "answer": "\\frac{3}{4}"})
_DEMO_QA = ({"question": "What is the capital of France?", "answer": "Paris"},
            {"question": "Which planet is known as the Red Planet?", "answer": ["Mars", "planet Mars"]})

register_env("GemMath", EnvSpec(
    GemMathEnv, {}, multi_turn=False, needs_data=True, demo_kwargs={"data": _DEMO_MATH},
    description="single-turn math, answer in \\boxed{}, reward 1/0 (data: data=[...] or data_path=.jsonl)"))
register_env("GemQA", EnvSpec(
    GemQAEnv, {}, multi_turn=False, needs_data=True, demo_kwargs={"data": _DEMO_QA},
    description="single-turn QA, answer in <answer></answer>, reward 1/0 (data: data=[...] or data_path=.jsonl)"))
