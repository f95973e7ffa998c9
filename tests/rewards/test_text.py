"""Shared text helpers of the rule workers (stages/rewards/text.py)."""

from __future__ import annotations

import pytest

from stages.rewards.text import after_last_think, last_code_block, strip_special_tokens, think_tags_malformed


@pytest.mark.parametrize("text, answer", [
    ("<think>x</think>\n\nanswer", "answer"), ("no tags", "no tags"), ("a</think>b</think>\nc", "c")])
def test_after_last_think(text, answer):
    assert after_last_think(text) == answer


@pytest.mark.parametrize("text, malformed", [
    ("<think>a</think>b", False), ("a</think>b", False), ("plain", False), ("<think>a", True),
    ("<think>a</think><think>b", True), ("<think><think>a</think>", True)])
def test_think_tags_malformed(text, malformed):
    assert think_tags_malformed(text) is malformed


def test_last_code_block_prefers_the_last_python_block():
    text = "```python\nfirst()\n```\ntext\n```bash\nls\n```\n```py\nsecond()\n```"
    assert last_code_block(text) == "second()\n"
    assert last_code_block("```\nplain()\n```") == "plain()\n"
    assert last_code_block("no code") is None
    assert last_code_block("```bash\nls\n```") is None


def test_strip_special_tokens():
    assert strip_special_tokens("a<|im_end|><pad><pad>") == "a"
    assert strip_special_tokens("x<eos>", ("<eos>",)) == "x"
