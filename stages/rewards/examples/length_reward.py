"""A custom reward worker, the worked example of docs/custom-reward-worker.md.

Two forms of the same idea, "reward answers close to a target length, and only when they end with a boxed answer":

* :class:`LengthReward`, a class: the config kwargs go to ``__init__``; ``score_batch`` gets the routed rows.
  Config: ``{"worker": "stages.rewards.examples.length_reward:LengthReward", "kwargs": {"target_words": 50}}``.
* :func:`length_reward`, a function: called as ``length_reward(rows, **kwargs)`` on every batch.
  Config: ``{"worker": "stages.rewards.examples.length_reward:length_reward", "kwargs": {"target_words": 50}}``.

Both follow the reward-worker contract (stages/rewards/base.py): columns in, ``scores`` and
``response_level_rewards`` out, one value per row, ``None`` for a row that cannot be scored.
"""

from __future__ import annotations

from stages.rewards.base import RESPONSE, Rows, Score, outputs
from stages.rewards.text import after_last_think, last_boxed


def closeness(num_words: int, target_words: int) -> float:
    """1 at the target length, falling linearly to 0 at 0 words and at twice the target."""
    return max(0.0, 1.0 - abs(num_words - target_words) / target_words)


class LengthReward:
    """Score: 1 if the answer has a ``\\boxed{}`` answer, else 0. Reward: score × closeness of the answer's word
    count to ``target_words``. Empty responses cannot be scored (None)."""

    columns = (RESPONSE,)  # the router checks these before calling

    def __init__(self, target_words: int = 50) -> None:
        if target_words <= 0:
            raise ValueError(f"LengthReward target_words must be positive, got {target_words}")
        self.target_words = target_words

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]:
        scores: list[Score] = []
        rewards: list[Score] = []
        for response in rows[RESPONSE]:
            answer = after_last_think(str(response)).strip()
            if not answer:
                scores.append(None)
                rewards.append(None)
                continue
            score = 1.0 if last_boxed(answer) is not None else 0.0
            scores.append(score)
            rewards.append(score * closeness(len(answer.split()), self.target_words))
        return outputs(scores, rewards)


def length_reward(rows: Rows, target_words: int = 50) -> dict[str, list[Score]]:
    """The function form of :class:`LengthReward`."""
    return LengthReward(target_words).score_batch(rows)
