"""Text helpers shared by the rule workers (ALGORITHMS.md §10): answer extraction, ``\\boxed{}``, repetition.

All functions are pure and work on decoded response text.
"""

from __future__ import annotations

import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Special tokens ROLL strips from decoded responses before scoring.
SPECIAL_TOKENS = ("<|endoftext|>", "<pad>", "<|im_end|>")
_BOXED = ("\\boxed{", "\\fbox{")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def strip_special_tokens(text: str, tokens: tuple[str, ...] = SPECIAL_TOKENS) -> str:
    for token in tokens:
        if token in text:
            text = text.replace(token, "")
    return text


def after_last_think(text: str) -> str:
    """Text after the last ``</think>`` with leading newlines removed; the whole text when there is none."""
    end = text.rfind(THINK_CLOSE)
    return text if end < 0 else text[end + len(THINK_CLOSE):].lstrip("\n")


def think_tags_malformed(text: str) -> bool:
    """A ``<think>`` after the last ``</think>`` (an unclosed block), or more ``<think>`` than ``</think>``.

    A response may close a think block that its prompt opened (chat templates that add ``<think>`` to the prompt),
    so ``</think>`` without ``<think>`` is well-formed.
    """
    opens, closes = text.count(THINK_OPEN), text.count(THINK_CLOSE)
    return opens > closes or (opens > 0 and text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE))


def math_answer_region(text: str) -> str:
    """The part of a response the math rule grades (§10): after the last ``</think>``; without think tags, after the
    last blank line (the final paragraph); empty when the think tags are malformed."""
    if think_tags_malformed(text):
        return ""
    if THINK_CLOSE in text:
        return after_last_think(text).strip()
    paragraphs = [p for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    return paragraphs[-1].strip() if paragraphs else ""


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if absent or unclosed."""
    start = max(text.rfind(marker) for marker in _BOXED)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def first_uppercase(text: str) -> str | None:
    """The first uppercase character of ``text`` (ROLL's choice-letter rule), or None."""
    for char in text:
        if char.isupper():
            return char
    return None


def repetition_penalty(text: str, ngram_size: int = 3, max_penalty: float = -0.5) -> float:
    """N-gram repetition penalty in ``[max_penalty, 0]``: ``(1 − unique/total) · max_penalty`` over lower-cased
    whitespace words; 0 for texts shorter than one n-gram."""
    if max_penalty > 0:
        raise ValueError(f"repetition_penalty: max_penalty {max_penalty} must be <= 0 (it is a penalty)")
    words = text.lower().split()
    total = len(words) - ngram_size + 1
    if total <= 0:
        return 0.0
    unique = len(set(zip(*(words[k:] for k in range(ngram_size)))))
    return (1.0 - unique / total) * max_penalty


def last_code_block(text: str, languages: tuple[str, ...] = ("python", "py", "python3", "")) -> str | None:
    """The last fenced code block (```python ... ```) whose language tag is in ``languages``; None if none."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in languages]
    return blocks[-1] if blocks else None
