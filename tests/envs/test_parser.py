"""The §9.3 action parser: golden table, hand cases, robustness."""

from __future__ import annotations

import pytest

from schemas.errors import ConfigError
from stages.envs import default_parser_action_func, parse_action
from stages.envs.frozen_lake import ACTION_LOOKUP as FROZEN_LOOKUP
from stages.envs.parser import ActionParser
from stages.envs.sokoban import ACTION_LOOKUP as SOKOBAN_LOOKUP
from tests import golden

LOOKUPS = {"frozen": FROZEN_LOOKUP, "sokoban": SOKOBAN_LOOKUP, "none": None}
SPECIAL = ["<|im_start|>", "<|im_end|>"]


PARSER = golden.family("roll.pipeline.agentic.env.parse_action_utils.default_parser_action_func")


@pytest.mark.parametrize("name", PARSER)
def test_golden_parser_table(name):
    case = golden.load(name)
    tokens = case.check_params(("special_token_list",)).get("special_token_list", SPECIAL)
    rows = case.outputs["table"]
    assert len(rows) > 0
    for text, pattern, lookup_name, action, content, think in rows.tolist():
        assert lookup_name in LOOKUPS, f"{name}: action lookup {lookup_name!r} unknown here (known {sorted(LOOKUPS)})"
        got = default_parser_action_func(text, pattern, LOOKUPS[lookup_name], tokens)
        assert (str(got["action"]), got["action_content"], got["think_content"]) == (action, content, think), \
            (text, pattern, lookup_name)


@pytest.mark.parametrize("text, action, content, think", [
    ("<answer> left </answer>", 0, "left", ""),
    ("<answer>left right</answer>", None, "left right", ""),
    ("<answer></answer>", None, "", ""),
    ("<answer>Up</answer><answer>Down</answer>", 3, "Up", ""),      # first match only
    ("<|im_start|><answer>DOWN</answer><|im_end|>", 1, "DOWN", ""),
    ("no tags", None, "", ""),
    ("<answer>\nRight\n</answer>", 2, "Right", ""),
])
def test_hand_cases_with_lookup(text, action, content, think):
    parsed = parse_action(text, lookup=FROZEN_LOOKUP)
    assert (parsed.action, parsed.action_content, parsed.think_content) == (action, content, think)


def test_two_groups_and_no_lookup():
    pattern = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>"
    parsed = parse_action("<think> plan </think>\n<answer> Up </answer>", pattern)
    assert (parsed.action, parsed.action_content, parsed.think_content) == ("Up", "Up", "plan")
    assert parse_action("<answer></answer>").action == ""  # ROLL: without a lookup an empty content is the action


def test_special_tokens_strip_only_when_given():
    assert parse_action("  hi  ", "^(.*)$", special_tokens=SPECIAL).action == "hi"
    assert parse_action("<|im_end|>x", "^(.*)$", special_tokens=None).action == "<|im_end|>x"


@pytest.mark.parametrize("junk", ["", "\x00\x01", "🧊🧊<answer>🔥</answer>", "<answer>", None, 42, "a" * 10000])
def test_never_raises(junk):
    parsed = ActionParser(lookup=SOKOBAN_LOOKUP)(junk)
    assert parsed.action is None


def test_bound_parser_equals_function():
    parser = ActionParser(lookup=SOKOBAN_LOOKUP)
    for text in ["<answer>up</answer>", "<answer>Left</answer> x", "<answer>fly</answer>", ""]:
        assert parser(text) == parse_action(text, lookup=SOKOBAN_LOOKUP)


def test_bad_pattern_is_config_error():
    with pytest.raises(ConfigError, match="action_pattern"):
        ActionParser("<answer>(.*?</answer>")
