"""LLM judge (§10): structured verdict parsing (BUG-10), failed calls give None (BUG-11), routing with the injected
generate service. The engine is not under test: a deterministic fake ``generate`` stands in for it."""

from __future__ import annotations

import pytest

from schemas.errors import InvariantError
from stages.rewards.llm_judge import LLMJudgeWorker, parse_score, parse_verdict
from stages.rewards.routing import RewardRouter


@pytest.mark.parametrize("reply, expected", [
    ("The answer matches.\nVERDICT: CORRECT", 1.0),
    ("Wrong sum.\nverdict: incorrect", 0.0),
    ("**Verdict:** **CORRECT**", 1.0),
    ("VERDICT: CORRECT.\n", 1.0),
    ("First VERDICT: CORRECT\nOn reflection:\nVERDICT: INCORRECT", 0.0),   # the last verdict line wins
    ("I know the answer, yes it is right", None),                         # ROLL: "no" in "know" → 0
    ("Her eyes were blue. The answer is fine.", None),                     # ROLL: "yes" in "eyes" → 1
    ("VERDICT: CORRECTLY DONE", None),                                     # whole words only
    ("The verdict: correct, mostly", None),                                # not a verdict line
    ("", None), (None, None),
])
def test_parse_verdict(reply, expected):
    assert parse_verdict(reply) == expected


@pytest.mark.parametrize("reply, expected", [
    ("Good.\nScore: 7/10", 0.7), ("Score: 10", 1.0), ("**Score:** 0/10", 0.0), ("Score: 8.5/10", 0.85),
    ("Score: 11/10", None), ("Score: 3/5", None), ("I'd score it 7", None), ("Score: 2/10\nScore: 9/10", 0.9),
])
def test_parse_score(reply, expected):
    if expected is None:
        assert parse_score(reply) is None
    else:
        assert parse_score(reply) == pytest.approx(expected)


class FakeJudge:
    """Deterministic stand-in for the generation stage: replies by whether the graded answer contains the reference.
    Records the prompts it was given."""

    def __init__(self, fail_times: int = 0):
        self.calls: list[list[str]] = []
        self.fail_times = fail_times

    def __call__(self, prompts: list[str]) -> list[str]:
        self.calls.append(prompts)
        if len(self.calls) <= self.fail_times:
            raise ConnectionError("judge endpoint down")
        replies = []
        for prompt in prompts:
            reference = prompt.split("Reference answer:\n")[1].split("\n")[0]
            graded = prompt.split("Answer to grade:\n")[1].split("\n\n")[0]
            verdict = "CORRECT" if reference in graded else "INCORRECT"
            replies.append("no verdict" if "mumble" in graded else f"Reasoning...\nVERDICT: {verdict}")
        return replies


ROWS = {"prompt": ["Capital of France?", "2+2?", "Colour of the sky?"],
        "ground_truth": ["Paris", "4", "blue"],
        "response": ["<think>hmm</think>It is Paris.", "It is 5.", "mumble"]}


def test_judge_scores_through_the_injected_generate():
    fake = FakeJudge()
    out = LLMJudgeWorker(fake).score_batch(ROWS)
    assert out["scores"] == [1.0, 0.0, None] and out["response_level_rewards"] == out["scores"]
    assert len(fake.calls) == 1 and "It is Paris." in fake.calls[0][0] and "hmm" not in fake.calls[0][0]


def test_failed_calls_are_retried_then_give_none_instead_of_crashing():
    flaky = FakeJudge(fail_times=2)
    assert LLMJudgeWorker(flaky, max_retries=2).score_batch(ROWS)["scores"] == [1.0, 0.0, None]
    down = FakeJudge(fail_times=10)
    worker = LLMJudgeWorker(down, max_retries=1)
    assert worker.score_batch(ROWS)["scores"] == [None, None, None]  # BUG-11: defined result
    assert len(down.calls) == 2 and "judge endpoint down" in worker.last_error


def test_a_generate_that_drops_replies_is_a_contract_error():
    with pytest.raises(InvariantError, match="returned 1 replies for 3 prompts"):
        LLMJudgeWorker(lambda prompts: ["VERDICT: CORRECT"]).score_batch(ROWS)


def test_score_format_uses_the_score_prompt():
    seen = []

    def generate(prompts):
        seen.extend(prompts)
        return ["Score: 6/10"] * len(prompts)

    out = LLMJudgeWorker(generate, verdict_format="score").score_batch(ROWS)
    assert out["scores"] == [pytest.approx(0.6)] * 3 and "Score: N/10" in seen[0]


def test_bad_judge_config_is_rejected():
    with pytest.raises(ValueError, match="verdict_format"):
        LLMJudgeWorker(FakeJudge(), verdict_format="yesno")
    with pytest.raises(ValueError, match="must contain '{response}'"):
        LLMJudgeWorker(FakeJudge(), prompt_template="Grade {question}")


def test_router_gives_the_judge_the_stage_generate_service():
    rows = {**ROWS, "domain": ["open", "math", "open"]}
    rows["response"] = ["It is Paris.", r"\boxed{4}", "mumble"]
    router = RewardRouter({"open": {"worker": "llm_judge", "kwargs": {"max_retries": 0}}, "math": "math_rule"},
                          services={"generate": FakeJudge()})
    out = router.score(rows)
    assert out.score_list() == [1.0, 1.0, None]
    assert out.worker.tolist() == ["llm_judge", "math_rule", "llm_judge"]


@pytest.mark.parametrize("verdict_format, first_line, value", [("verdict", "VERDICT: CORRECT", 1.0),
                                                               ("score", "Score: 7/10", 0.7)])
def test_a_reply_cut_at_the_token_budget_keeps_its_verdict(verdict_format, first_line, value):
    """The default prompts ask for the verdict line first and the explanation after it: a judge that follows the
    prompt and is cut off mid-explanation (the engine's max_new_tokens) still gives a score."""
    def follows_the_prompt(prompts):
        replies = []
        for prompt in prompts:
            asked_first = prompt.index("Begin your reply with") < prompt.index("then explain briefly")
            reply = f"{first_line}\nThe answer matches the reference because" if asked_first else \
                "The answer matches the reference because"
            replies.append(reply[:60])  # cut at the budget, mid-explanation
        return replies

    out = LLMJudgeWorker(follows_the_prompt, verdict_format=verdict_format).score_batch(ROWS)
    assert out["scores"] == [pytest.approx(value)] * 3
