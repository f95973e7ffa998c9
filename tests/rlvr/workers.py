"""Reward workers for the RLVR tests (importable by Ray workers as ``tests.rlvr.workers:<name>``)."""

from __future__ import annotations

import math
import os


def ground_truth_as_score(rows, scale: float = 1.0):
    """Score = ``float(ground_truth) * scale``; ``"none"`` → None (cannot score); ``"nan"`` → NaN (a worker bug)."""
    scores = []
    for truth in rows["ground_truth"]:
        if truth == "none":
            scores.append(None)
        elif truth == "nan":
            scores.append(math.nan)
        else:
            scores.append(float(truth) * scale)
    return scores


def keyword_judge_service():
    """A ``generate`` service factory (what a scoring process calls once): a fake judge model that answers
    'VERDICT: CORRECT' when the reference answer appears in the graded answer, no verdict for '???'."""

    def generate(prompts):
        replies = []
        for prompt in prompts:
            reference = prompt.split("Reference answer:\n", 1)[1].split("\n", 1)[0]
            answer = prompt.split("Answer to grade:\n", 1)[1].split("\n\nDecide", 1)[0]
            if "???" in answer:
                replies.append("I cannot tell.")
            else:
                replies.append("VERDICT: CORRECT" if reference in answer else "VERDICT: INCORRECT")
        return replies

    return generate


def process_id_as_score(rows):
    """Score = the id of the process that scores the row (which worker processes a reward stage ran in)."""
    return [float(os.getpid())] * len(rows["ground_truth"])
