"""Object-detection reward (ALGORITHMS.md §10, ``DetectionRewardWorker``): ``(acc·a + fmt·f) / (a + f)``.

* Boxes: the response's answer block ``\\n<answer>\\n ... \\n</answer>`` holds a JSON list of boxes, each
  ``{"bbox_2d": [x1, y1, x2, y2], "label": "cat"}`` or a bare ``[x1, y1, x2, y2]`` (label ``""``). The ground
  truth is the same JSON (string or list).
* Format (``fmt``, 0/1): exactly one ``\\n</answer>``, at least one ``\\n<answer>\\n``, and the boxes parse.
* Accuracy (``acc``): a weighted mix (``accuracy_weights``) of matching scores, times ``0.6^|#pred − #gt|``:
  ``max_iou`` (greedy one-to-one matching, highest IoU first, ignoring labels), ``label`` (the same within each
  label), each the fraction of ground-truth boxes matched with IoU ≥ threshold; ``map`` (COCO-style AP averaged
  over IoU 0.50:0.05:0.95), ``map50``, ``map75``. Predictions carry no confidence, so their listed order ranks
  them. ``iou_threshold``: a number, ``"average"`` (mean over 0.50:0.05:0.95) or ``"dynamic"`` (0.5 rising
  linearly to 0.95 with ``training_progress`` in [0, 1], which the reward stage passes as run-time context).
* No ground-truth boxes: accuracy 1 if there are no predictions, else 0. A ground truth that does not parse cannot
  be scored (None).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from stages.rewards.base import GROUND_TRUTH, RESPONSE, Rows, Score, outputs
from stages.rewards.registry import REWARD_WORKERS
from stages.rewards.text import strip_special_tokens

COCO_THRESHOLDS = np.round(np.arange(0.5, 0.951, 0.05), 2)
COUNT_PENALTY_BASE = 0.6
ACCURACY_KINDS = ("max_iou", "label", "map", "map50", "map75")


def parse_boxes(value: Any) -> tuple[np.ndarray, list[str]] | None:
    """JSON (string or list) → ``(boxes (K, 4) float64, labels)``; None if it is not a list of valid boxes."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, list):
        return None
    boxes, labels = [], []
    for item in value:
        box, label = (item.get("bbox_2d"), str(item.get("label", ""))) if isinstance(item, dict) else (item, "")
        if not isinstance(box, list) or len(box) != 4 or not all(isinstance(v, (int, float)) for v in box):
            return None
        x1, y1, x2, y2 = map(float, box)
        if not (np.isfinite([x1, y1, x2, y2]).all() and x2 >= x1 and y2 >= y1):
            return None
        boxes.append([x1, y1, x2, y2])
        labels.append(label)
    return np.asarray(boxes, np.float64).reshape(-1, 4), labels


def answer_block(response: str) -> str | None:
    """Content of the answer block when the format holds (one ``\\n</answer>``, a ``\\n<answer>\\n`` before it)."""
    if response.count("\n</answer>") != 1:
        return None
    end = response.index("\n</answer>")
    start = response.rfind("\n<answer>\n", 0, end)
    return None if start < 0 else response[start + len("\n<answer>\n"):end]


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of ``a (P, 4)`` and ``b (G, 4)`` boxes ``[x1, y1, x2, y2]`` → ``(P, G)``; empty boxes give 0."""
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=-1)
    area = lambda x: np.prod(x[:, 2:] - x[:, :2], axis=-1)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def greedy_matches(iou: np.ndarray) -> list[tuple[int, int, float]]:
    """One-to-one matching taking the highest remaining IoU first → ``[(pred, gt, iou)]`` with iou > 0."""
    pairs = sorted(((iou[p, g], p, g) for p in range(iou.shape[0]) for g in range(iou.shape[1]) if iou[p, g] > 0),
                   reverse=True)
    used_p, used_g, matches = set(), set(), []
    for value, p, g in pairs:
        if p not in used_p and g not in used_g:
            used_p.add(p)
            used_g.add(g)
            matches.append((p, g, float(value)))
    return matches


def matched_fraction(iou: np.ndarray, thresholds: np.ndarray) -> float:
    """Mean over thresholds of (#greedy matches with IoU ≥ t) / #gt."""
    values = np.array([v for _, _, v in greedy_matches(iou)])
    return float(np.mean([(values >= t).sum() / iou.shape[1] for t in thresholds]))


def label_matched_fraction(pred: np.ndarray, pred_labels: list[str], gt: np.ndarray, gt_labels: list[str],
                           thresholds: np.ndarray) -> float:
    """As :func:`matched_fraction`, matching only boxes with the same label."""
    iou = iou_matrix(pred, gt)
    same = np.equal.outer(np.asarray(pred_labels, dtype=object), np.asarray(gt_labels, dtype=object))
    return matched_fraction(np.where(same, iou, 0.0), thresholds)


def average_precision(iou: np.ndarray, threshold: float) -> float:
    """AP at one IoU threshold with predictions ranked in listed order (COCO 101-point interpolation)."""
    num_gt = iou.shape[1]
    taken = np.zeros(num_gt, bool)
    hits = np.zeros(iou.shape[0])
    for p in range(iou.shape[0]):  # COCO: each prediction takes the best still-free gt above the threshold
        candidates = np.where(~taken & (iou[p] >= threshold), iou[p], -1.0)
        if candidates.size and candidates.max() >= 0:
            taken[int(candidates.argmax())] = True
            hits[p] = 1
    tp = np.cumsum(hits)
    recall = tp / num_gt
    precision = tp / np.arange(1, len(hits) + 1)
    precision = np.maximum.accumulate(precision[::-1])[::-1] if len(precision) else precision
    points = np.linspace(0, 1, 101)
    index = np.searchsorted(recall, points, side="left")
    return float(np.mean(np.where(index < len(precision), precision[np.minimum(index, len(precision) - 1)], 0.0)))


class IoUThreshold:
    """The matching threshold(s): fixed, ``average`` (COCO thresholds) or ``dynamic`` (by training progress)."""

    def __init__(self, spec: float | str, training_progress: float = 0.0) -> None:
        if spec == "average":
            self.values = COCO_THRESHOLDS
        elif spec == "dynamic":
            self.values = np.array([0.5 + 0.45 * min(1.0, max(0.0, float(training_progress)))])
        elif isinstance(spec, (int, float)) and 0 < float(spec) <= 1:
            self.values = np.array([float(spec)])
        else:
            raise ValueError(f"detection iou_threshold {spec!r} must be a number in (0, 1], 'average' or 'dynamic'")


@REWARD_WORKERS.register("detection")
class DetectionWorker:
    """Columns: ``response``, ``ground_truth`` (boxes). Kwargs: ``accuracy_ratio`` (1.0), ``format_ratio`` (0.1),
    ``accuracy_weights`` (kind → weight over :data:`ACCURACY_KINDS`), ``iou_threshold``, ``training_progress``
    (run-time context: the RLVR training flow's reward stage passes step / max_steps; offline scoring leaves 0)."""

    columns = (RESPONSE, GROUND_TRUTH)
    context = ("training_progress",)

    def __init__(self, accuracy_ratio: float = 1.0, format_ratio: float = 0.1,
                 accuracy_weights: Mapping[str, float] | None = None, iou_threshold: float | str = 0.5,
                 training_progress: float = 0.0) -> None:
        weights = dict(accuracy_weights or {"max_iou": 0.25, "label": 0.25, "map": 0.5})
        unknown = set(weights) - set(ACCURACY_KINDS)
        if unknown or sum(weights.values()) <= 0 or accuracy_ratio + format_ratio <= 0:
            raise ValueError(f"detection accuracy_weights {weights} must use {ACCURACY_KINDS} with a positive sum, "
                             "and accuracy_ratio + format_ratio must be positive")
        self.accuracy_ratio, self.format_ratio = float(accuracy_ratio), float(format_ratio)
        self.weights = weights
        self.threshold = IoUThreshold(iou_threshold, training_progress)

    def accuracy(self, pred: np.ndarray, pred_labels: list[str], gt: np.ndarray, gt_labels: list[str]) -> float:
        if len(gt) == 0:
            return 1.0 if len(pred) == 0 else 0.0
        if len(pred) == 0:
            return 0.0
        iou = iou_matrix(pred, gt)
        parts = {
            "max_iou": lambda: matched_fraction(iou, self.threshold.values),
            "label": lambda: label_matched_fraction(pred, pred_labels, gt, gt_labels, self.threshold.values),
            "map": lambda: float(np.mean([average_precision(iou, t) for t in COCO_THRESHOLDS])),
            "map50": lambda: average_precision(iou, 0.5),
            "map75": lambda: average_precision(iou, 0.75),
        }
        mix = sum(w * parts[k]() for k, w in self.weights.items()) / sum(self.weights.values())
        return mix * COUNT_PENALTY_BASE ** abs(len(pred) - len(gt))

    def score_one(self, response: str, ground_truth: Any) -> Score:
        gold = parse_boxes(ground_truth)
        if gold is None:
            return None
        block = answer_block(strip_special_tokens(response))
        predicted = parse_boxes(block) if block is not None else None
        fmt = 1.0 if predicted is not None else 0.0
        acc = self.accuracy(*predicted, *gold) if predicted is not None else 0.0
        return (acc * self.accuracy_ratio + fmt * self.format_ratio) / (self.accuracy_ratio + self.format_ratio)

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]:
        return outputs([self.score_one(str(r), g) for r, g in zip(rows[RESPONSE], rows[GROUND_TRUTH])])
