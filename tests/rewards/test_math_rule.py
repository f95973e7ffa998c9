"""Math rule reward (§10): extraction, fast path vs math_verify, None for unparseable ground truth, shipped data."""

from __future__ import annotations

from fractions import Fraction

import pytest

from stages.rewards.math_rule import MathRuleWorker, normalise_answer, plain_number
from stages.rewards.text import last_boxed, math_answer_region
from tests.rewards.conftest import columns, load_rows


@pytest.fixture(scope="module")
def worker():
    return MathRuleWorker()


@pytest.fixture(scope="module")
def slow_worker():
    return MathRuleWorker(fast_path=False)


@pytest.mark.parametrize("text, region", [
    ("<think>a \\boxed{1}</think>\n\nso \\boxed{2}", "so \\boxed{2}"),
    ("</think>x</think>final", "final"),                      # prompt opened the think block
    ("<think>never closed \\boxed{2}", ""),                    # malformed → empty
    ("<think>a</think>b<think>c", ""),                         # unclosed block after the last close
    ("step 1\n\nstep 2\n \nThe answer is 7.", "The answer is 7."),  # no tags → last paragraph
    ("only line", "only line"),
    ("", ""),
])
def test_answer_region_follows_roll_rules(text, region):
    assert math_answer_region(text) == region


@pytest.mark.parametrize("text, boxed", [
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{{a}{b}}", "{a}{b}"),
    (r"\fbox{7}", "7"),
    (r"\boxed{unclosed", None),
    ("none", None),
])
def test_last_boxed_matches_braces(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize("text, value", [
    ("42", Fraction(42)), ("-3.50", Fraction(-7, 2)), ("1,000", Fraction(1000)), ("7/8", Fraction(7, 8)),
    (r"\frac{3}{4}", Fraction(3, 4)), (r"-\frac{3}{4}", Fraction(-3, 4)), (".5", Fraction(1, 2)),
    ("1,2", None), ("x+1", None), ("1/0", None), (r"\sqrt{2}", None), ("10\\%", None),
])
def test_plain_number_reads_only_plain_numbers(text, value):
    assert plain_number(normalise_answer(text)) == value


def test_normalise_keeps_digits_apart():
    assert normalise_answer(r"$ 1\,000 $.") == "1000"
    assert normalise_answer("1 2") == "1 2"  # not the number 12
    assert normalise_answer(r"\text{ B }") == "B"


CASES = [
    # (response, ground truth, expected score)
    (r"<think>2+2</think>The answer is \boxed{4}.", "4", 1.0),
    (r"<think>2+2</think>The answer is \boxed{5}.", "4", 0.0),
    (r"So \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"So \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{7}{8}}", r"\frac{7}{8}", 1.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    (r"\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    ("The answer is 17", "17", 1.0),                      # no box: the whole region is parsed
    ("no number here at all", "17", 0.0),
    (r"<think>\boxed{17}", "17", 0.0),                    # malformed think tags: empty region
    (r"\boxed{1 2}", "12", 0.0),
    (r"\boxed{3}", "", None),                             # no ground truth: cannot score
    (r"\boxed{3}", None, None),
    (r"\boxed{3}<|im_end|>", "3", 1.0),
]


@pytest.mark.parametrize("response, gold, expected", CASES)
def test_hand_checked_cases(worker, response, gold, expected):
    assert worker.score(response, gold) == expected


def test_fast_path_agrees_with_math_verify_alone(worker, slow_worker):
    rows = load_rows("math")
    golds = [r["ground_truth"] for r in rows]
    responses = []
    for i, gold in enumerate(golds):
        value = plain_number(normalise_answer(gold))
        wrong = str(value + 1) if value is not None else "0"
        responses += [rf"<think>...</think>\boxed{{{gold}}}", rf"\boxed{{{wrong}}}", f"It is {gold}", "I give up"]
    golds4 = [g for g in golds for _ in range(4)]
    fast = worker.score_batch({"response": responses, "ground_truth": golds4})
    slow = slow_worker.score_batch({"response": responses, "ground_truth": golds4})
    assert fast == slow
    assert fast["scores"][0::4] == [1.0] * len(golds) and fast["scores"][1::4] == [0.0] * len(golds)
    assert fast["scores"][3::4] == [0.0] * len(golds)


def test_unparseable_ground_truth_cannot_be_scored(worker):
    assert worker.score(r"\boxed{3}", r"\frac{") is None
    assert worker.score(r"\boxed{???}", "???") is None  # math_verify only echoes the string back


def test_shipped_math_answers_equal_their_check_expressions():
    rows = load_rows("math")
    assert len(rows) >= 50 and len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        expected = Fraction(eval(row["check_expression"], {"Fraction": Fraction})).limit_denominator(1000)
        assert plain_number(normalise_answer(row["ground_truth"])) == expected, row["id"]
        assert row["domain"] == "math" and "\\boxed{}" in row["prompt"]


def test_scores_shipped_rows_through_score_batch(worker):
    rows = load_rows("math")
    out = worker.score_batch(columns(rows, response=[rf"\boxed{{{r['ground_truth']}}}" for r in rows]))
    assert out["scores"] == [1.0] * len(rows) and out["response_level_rewards"] == out["scores"]


class RecordingMathVerify:
    """Wraps math_verify and records the timeouts it is called with."""

    def __init__(self, real):
        self.real, self.timeouts = real, []

    def parse(self, text, parsing_timeout):
        self.timeouts.append(("parse", parsing_timeout))
        return self.real.parse(text, parsing_timeout=parsing_timeout)

    def verify(self, gold, pred, timeout_seconds):
        self.timeouts.append(("verify", timeout_seconds))
        return self.real.verify(gold, pred, timeout_seconds=timeout_seconds)


def test_math_verify_timeout_in_the_main_thread_and_none_in_other_threads():
    """SIGALRM timeouts only work in the main thread; elsewhere math_verify would fail silently (score 0)."""
    import threading

    worker = MathRuleWorker(timeout_seconds=3)
    recorder = RecordingMathVerify(worker.verifier._math_verify)
    worker.verifier._math_verify = recorder
    assert worker.score(r"\boxed{2\sqrt{3}}", r"\sqrt{12}") == 1.0
    assert {t for _, t in recorder.timeouts} == {3}
    recorder.timeouts.clear()
    results = []
    thread = threading.Thread(target=lambda: results.append(worker.score(r"\boxed{\sqrt{12}}", r"2\sqrt{3}")))
    thread.start()
    thread.join()
    assert results == [1.0] and {t for _, t in recorder.timeouts} == {None}
