"""ROLL's default action parser (spec §9.3): model text → action id, action text, think text.

``parse_action(text, pattern, lookup, special_tokens)`` reproduces ``default_parser_action_func``:
1. every special token is removed from ``text`` (the text is stripped after each removal);
2. ``re.search(pattern, text, DOTALL)`` — the **first** match only;
3. one capture group → ``action_content = group(1).strip()``; two groups → ``think = group(1)``,
   ``action_content = group(2)`` (both stripped); no match → both ``""`` and ``action = None``;
4. with a non-empty lookup (id → name) the action is the id whose name equals the content case-insensitively, else
   ``None``; without a lookup the action is the content itself (possibly ``""``).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Mapping, NamedTuple, Sequence

from schemas.errors import ConfigError

DEFAULT_ACTION_PATTERN = "<answer>(.*?)</answer>"
THINK_ACTION_PATTERN = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>"
DEFAULT_SPECIAL_TOKENS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")


class ParsedAction(NamedTuple):
    """Result of parsing one model response. ``action`` is ``None`` when the response holds no legal action."""

    action: int | str | None
    action_content: str
    think_content: str

    def as_info(self) -> dict:
        """The three keys ROLL merges into ``info``."""
        return {"action": self.action, "action_content": self.action_content, "think_content": self.think_content}


class ActionParser:
    """A parser bound to one pattern, lookup and special-token list (compiled once; what the envs hold)."""

    __slots__ = ("pattern", "lookup", "special_tokens", "_regex", "_reverse")

    def __init__(self, pattern: str = DEFAULT_ACTION_PATTERN, lookup: Mapping[int | str, str] | None = None,
                 special_tokens: Sequence[str] | None = DEFAULT_SPECIAL_TOKENS) -> None:
        self.pattern = pattern
        self.lookup = dict(lookup) if lookup else None
        self.special_tokens = tuple(special_tokens) if special_tokens else ()
        try:
            self._regex = re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise ConfigError(f"action_pattern {pattern!r} is not a valid regular expression ({exc}); fix the "
                              "env_config (ROLL's default is '<answer>(.*?)</answer>')") from None
        self._reverse = {str(name).lower(): key for key, name in self.lookup.items()} if self.lookup else None

    def __call__(self, text: str) -> ParsedAction:
        """Parse one response (spec §9.3). Never raises on any input."""
        if not isinstance(text, str):
            text = "" if text is None else str(text)
        for token in self.special_tokens:
            text = text.replace(token, "").strip()
        match = self._regex.search(text)
        if match is None:
            return ParsedAction(None, "", "")
        groups = match.groups()
        if len(groups) >= 2:
            think, content = (groups[0] or "").strip(), (groups[1] or "").strip()
        elif len(groups) == 1:
            think, content = "", (groups[0] or "").strip()
        else:  # a pattern without groups: ROLL would fail on group(1); we take the whole match as the content
            think, content = "", match.group(0).strip()
        if self._reverse is None:
            return ParsedAction(content, content, think)
        return ParsedAction(self._reverse.get(content.lower()), content, think)


@lru_cache(maxsize=64)
def _cached_parser(pattern: str, lookup_items: tuple, special_tokens: tuple) -> ActionParser:
    return ActionParser(pattern, dict(lookup_items), special_tokens)


def parse_action(
    text: str,
    pattern: str = DEFAULT_ACTION_PATTERN,
    lookup: Mapping[int | str, str] | None = None,
    special_tokens: Sequence[str] | None = DEFAULT_SPECIAL_TOKENS,
) -> ParsedAction:
    """Parse ``text`` exactly like ROLL's ``default_parser_action_func`` (spec §9.3). Never raises on any str."""
    items = tuple(lookup.items()) if lookup else ()
    return _cached_parser(pattern, items, tuple(special_tokens) if special_tokens else ())(text)


def default_parser_action_func(text: str, action_pattern: str, action_lookup: Mapping | None,
                               special_token_list: Sequence[str] | None) -> dict:
    """ROLL's name and signature, returning ROLL's dict ``{action, action_content, think_content}``."""
    return parse_action(text, action_pattern, action_lookup, special_token_list).as_info()
