"""Detection reward (§10): IoU, matching, AP, format, count penalty, threshold modes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stages.rewards.detection import (DetectionWorker, IoUThreshold, answer_block, average_precision, greedy_matches,
                                      iou_matrix, parse_boxes)


def wrap(boxes) -> str:
    return "<think>look</think>\n<answer>\n" + json.dumps(boxes) + "\n</answer>"


GT = [{"bbox_2d": [0, 0, 10, 10], "label": "cat"}, {"bbox_2d": [20, 20, 30, 40], "label": "dog"}]


def test_iou_hand_computed():
    a = np.array([[0, 0, 10, 10], [5, 5, 15, 15], [0, 0, 0, 0]], float)
    b = np.array([[0, 0, 10, 10], [10, 10, 20, 20]], float)
    expected = np.array([[1.0, 0.0], [25 / 175, 25 / 175], [0.0, 0.0]])
    np.testing.assert_allclose(iou_matrix(a, b), expected)


def test_iou_matrix_matches_a_pairwise_loop():
    rng = np.random.default_rng(1)
    lo = rng.uniform(0, 50, (7, 2))
    boxes = np.concatenate([lo, lo + rng.uniform(0, 30, (7, 2))], axis=1)
    loop = np.zeros((7, 7))
    for i, p in enumerate(boxes):
        for j, g in enumerate(boxes):
            w = max(0, min(p[2], g[2]) - max(p[0], g[0]))
            h = max(0, min(p[3], g[3]) - max(p[1], g[1]))
            union = (p[2] - p[0]) * (p[3] - p[1]) + (g[2] - g[0]) * (g[3] - g[1]) - w * h
            loop[i, j] = w * h / union if union > 0 else 0
    np.testing.assert_allclose(iou_matrix(boxes, boxes), loop)


def test_greedy_matching_takes_the_highest_iou_first():
    iou = np.array([[0.9, 0.8], [0.85, 0.1]])
    assert greedy_matches(iou) == [(0, 0, 0.9), (1, 1, 0.1)]


def test_average_precision_perfect_and_with_a_false_positive_first():
    perfect = np.eye(2)
    assert average_precision(perfect, 0.5) == pytest.approx(1.0)
    ranked = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # a miss ranked first
    # precision after each prediction: 0, 1/2, 2/3 → interpolated 2/3 at every recall point from 0 to 1
    assert average_precision(ranked, 0.5) == pytest.approx(2 / 3)


def test_format_requires_one_closing_tag_and_an_opening_tag_on_its_own_line():
    assert answer_block("\n<answer>\n[]\n</answer>") == "[]"
    assert answer_block("<answer>[]</answer>") is None
    assert answer_block("\n<answer>\n[]\n</answer>\n</answer>") is None


def test_perfect_prediction_scores_one_and_bad_format_scores_zero():
    worker = DetectionWorker()
    out = worker.score_batch({"response": [wrap(GT), "[[0, 0, 10, 10]]", wrap(GT)[:-3]],
                              "ground_truth": [json.dumps(GT)] * 3})
    assert out["scores"] == [pytest.approx(1.0), 0.0, 0.0]


def test_parseable_but_wrong_boxes_get_the_format_share_only():
    worker = DetectionWorker(accuracy_ratio=1.0, format_ratio=0.1)
    far = [{"bbox_2d": [100, 100, 110, 110], "label": "cat"}, {"bbox_2d": [200, 200, 210, 210], "label": "dog"}]
    assert worker.score_one(wrap(far), GT) == pytest.approx(0.1 / 1.1)


def test_count_penalty_and_label_matching():
    worker = DetectionWorker(accuracy_weights={"max_iou": 1.0}, format_ratio=0.0)
    one = worker.score_one(wrap(GT[:1]), GT)  # half the boxes, one fewer prediction
    assert one == pytest.approx(0.5 * 0.6)
    label_only = DetectionWorker(accuracy_weights={"label": 1.0}, format_ratio=0.0)
    swapped = [{"bbox_2d": GT[0]["bbox_2d"], "label": "dog"}, {"bbox_2d": GT[1]["bbox_2d"], "label": "cat"}]
    assert label_only.score_one(wrap(swapped), GT) == 0.0
    assert worker.score_one(wrap(swapped), GT) == pytest.approx(1.0)


def test_empty_ground_truth_and_unparseable_ground_truth():
    worker = DetectionWorker(format_ratio=0.0)
    assert worker.score_one(wrap([]), []) == 1.0
    assert worker.score_one(wrap(GT), []) == 0.0
    assert worker.score_one(wrap(GT), "not json") is None


def test_threshold_modes():
    assert IoUThreshold(0.7).values.tolist() == [0.7]
    assert IoUThreshold("average").values.tolist() == pytest.approx([0.5 + 0.05 * k for k in range(10)])
    assert IoUThreshold("dynamic", training_progress=1.0).values.tolist() == pytest.approx([0.95])
    assert IoUThreshold("dynamic", training_progress=0.0).values.tolist() == pytest.approx([0.5])
    with pytest.raises(ValueError):
        IoUThreshold(1.5)
    shifted = [{"bbox_2d": [0, 0, 10, 12.5], "label": "cat"}]  # IoU 0.8 with the first gt box
    strict = DetectionWorker(accuracy_weights={"max_iou": 1.0}, format_ratio=0.0, iou_threshold=0.9)
    loose = DetectionWorker(accuracy_weights={"max_iou": 1.0}, format_ratio=0.0, iou_threshold=0.75)
    assert strict.score_one(wrap(shifted), GT[:1]) == 0.0 and loose.score_one(wrap(shifted), GT[:1]) == 1.0


def test_parse_boxes_accepts_bare_lists_and_rejects_malformed():
    boxes, labels = parse_boxes("[[1, 2, 3, 4]]")
    assert boxes.tolist() == [[1, 2, 3, 4]] and labels == [""]
    assert parse_boxes("[[1, 2, 3]]") is None and parse_boxes("[[3, 3, 1, 1]]") is None
    assert parse_boxes('{"bbox_2d": [1, 2, 3, 4]}') is None


def test_the_reward_stage_hands_the_training_progress_to_the_dynamic_threshold():
    """The router passes the run-time context (the RLVR training flow's step / max_steps) to the workers that read
    it; a value set in the route's kwargs wins; without context the worker keeps its default (offline scoring)."""
    from schemas.rlvr_config import RewardsConfig
    from stages.rewards import RewardRouter
    from stages.rlvr.generate import reads_context
    from stages.rlvr.stages import ScoreBatch, run_context

    dynamic = {"detection": {"worker": "detection", "kwargs": {"iou_threshold": "dynamic"}}}
    router = RewardRouter(dynamic, context={"training_progress": 1.0})
    assert router.workers["detection"].threshold.values.tolist() == pytest.approx([0.95])
    assert RewardRouter(dynamic).workers["detection"].threshold.values.tolist() == pytest.approx([0.5])
    fixed = {"detection": {"worker": "detection", "kwargs": {"iou_threshold": "dynamic", "training_progress": 0.2}}}
    assert RewardRouter(fixed, context={"training_progress": 1.0}).workers["detection"].threshold.values.tolist() \
        == pytest.approx([0.59])
    # workers that read no context are built as before; the stage's actor takes the context from its state_in
    assert RewardRouter({"math": {"worker": "math_rule"}}, context={"training_progress": 1.0}).workers["math"]
    actor = ScoreBatch(dynamic, "domain", {}, "(test)", run_context({"training_progress": 0.5, "kl_ctrl": {}}))
    assert actor.router.workers["detection"].threshold.values.tolist() == pytest.approx([0.725])
    assert reads_context(RewardsConfig(routes=dynamic), "training_progress")
    assert not reads_context(RewardsConfig(routes={"math": {"worker": "math_rule"}}), "training_progress")
