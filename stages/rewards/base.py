"""The reward-worker contract (ALGORITHMS.md §10; DESIGN.md "rewards are functions of named columns").

A reward worker is any object with::

    score_batch(rows: Mapping[str, Sequence]) -> {"scores": list[float | None],
                                                  "response_level_rewards": list[float | None]}

``rows`` maps a column name to ``B`` values (one per response); both output lists have ``B`` entries. A worker is a
pure function of its input columns: no Ray, no global state between calls. ``None`` means "cannot score" (bad ground
truth, unsupported tag, judge reply without a verdict): such a row is excluded from group statistics and gets zero
advantage. ``token_level_rewards`` are zeros, as ROLL emits them; :func:`token_level_zeros` builds them from the
response lengths. Everything leaves this package as float32 (ROLL uses float16, [Q-1]).

Class attributes a worker may declare (capabilities, read by the router, so no caller branches on a name):

* ``columns``: input columns it needs (checked before it runs, missing → :class:`SchemaError`);
* ``requires``: run-time services it takes as constructor keywords, e.g. ``("generate",)`` for the LLM judge.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from schemas.errors import InvariantError

# ---- column names (ROLL's non-tensor names; ``response`` is the decoded response text) ------------------------------
RESPONSE = "response"
PROMPT = "prompt"
GROUND_TRUTH = "ground_truth"
TAG = "tag"
DOMAIN = "domain"
RESPONSE_LENGTH = "response_length"  # number of generated tokens (int), for length-based rewards

SCORES = "scores"
RESPONSE_LEVEL_REWARDS = "response_level_rewards"
TOKEN_LEVEL_REWARDS = "token_level_rewards"

Score = float | None
Rows = Mapping[str, Sequence[Any]]


class RewardWorker(Protocol):
    """What the router calls. ``columns`` and ``requires`` are optional class attributes (default ``()``)."""

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]: ...


def batch_size(rows: Rows) -> int:
    """Number of rows of a column batch; every column must have the same length."""
    lengths = {name: len(values) for name, values in rows.items()}
    if len(set(lengths.values())) > 1:
        raise InvariantError(f"reward batch: columns have different lengths {lengths}; every column needs one "
                             "value per response")
    return next(iter(lengths.values()), 0)


def json_ground_truth(ground_truth: Any, what: str, error: type[Exception]) -> Any:
    """A row's ``ground_truth`` decoded when it is a JSON string or bytes, as it is otherwise (a list or dict already);
    ``error("<what> not valid JSON (...)")`` when the string is not JSON (``what``: e.g. "tests are")."""
    if not isinstance(ground_truth, (str, bytes)):
        return ground_truth
    try:
        return json.loads(ground_truth)
    except ValueError as decode_error:
        raise error(f"{what} not valid JSON ({decode_error})") from None


def outputs(scores: list[Score], rewards: list[Score] | None = None) -> dict[str, list[Score]]:
    """The output dict of ``score_batch``; rewards default to the scores (most workers reward what they score)."""
    return {SCORES: scores, RESPONSE_LEVEL_REWARDS: list(scores) if rewards is None else rewards}


def _as_score(value: Any, worker: str, column: str, row: int) -> float:
    """A float or NaN (for None); anything else, or a non-finite number, is a worker bug."""
    if value is None:
        return math.nan
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InvariantError(f"reward worker '{worker}': {column}[{row}] = {value!r} is not a number; return a float "
                             "or None ('cannot score')") from None
    if not math.isfinite(number):
        raise InvariantError(f"reward worker '{worker}': {column}[{row}] = {number} is not finite; return a finite "
                             "float, or None when the row cannot be scored")
    return number


def check_outputs(result: Any, num_rows: int, worker: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate one worker's output → ``(scores (B,), rewards (B,))`` float32 with NaN where the worker said None."""
    if not isinstance(result, Mapping) or SCORES not in result:
        raise InvariantError(f"reward worker '{worker}' returned {type(result).__name__}; score_batch must return "
                             f"a dict with '{SCORES}' (and '{RESPONSE_LEVEL_REWARDS}') lists of {num_rows} values")
    columns = {}
    for column in (SCORES, RESPONSE_LEVEL_REWARDS):
        values = result.get(column, result[SCORES])
        if len(values) != num_rows:
            raise InvariantError(f"reward worker '{worker}' returned {len(values)} {column} for {num_rows} rows; "
                                 "return exactly one value per row, in input order")
        columns[column] = np.array([_as_score(v, worker, column, i) for i, v in enumerate(values)], np.float32)
    return columns[SCORES], columns[RESPONSE_LEVEL_REWARDS]


@dataclass(frozen=True)
class RewardOutputs:
    """Reward columns of a batch. ``scores``/``response_level_rewards`` ``(B,)`` float32, NaN = None (cannot score).

    Convert to Arrow with ``pa.array(x, from_pandas=True)`` (NaN → null). ``worker (B,)``: the worker that scored
    each row (for per-worker metrics).
    """

    scores: np.ndarray
    response_level_rewards: np.ndarray
    worker: np.ndarray

    @property
    def scored(self) -> np.ndarray:
        """``(B,)`` bool: rows with a score (not None)."""
        return ~np.isnan(self.scores)

    def score_list(self) -> list[Score]:
        return [None if math.isnan(v) else float(v) for v in self.scores]

    def reward_list(self) -> list[Score]:
        return [None if math.isnan(v) else float(v) for v in self.response_level_rewards]


def token_level_zeros(lengths: Sequence[int] | np.ndarray):
    """``token_level_rewards`` as ROLL emits them: zeros, float32, one per next-token position of each row.

    ``lengths (B,)``: entries per row (``L − 1`` in the project's next-token layout). Returns a ``Ragged``.
    """
    from stages.algos.ragged import Ragged  # pyarrow only where the stage needs it

    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or (lengths < 0).any():
        raise InvariantError(f"token_level_zeros: lengths must be a (B,) array of non-negative ints, got {lengths!r}")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Ragged(np.zeros(int(offsets[-1]), np.float32), offsets)


class FunctionWorker:
    """Adapter that runs a plain function as a worker: ``fn(rows, **kwargs)`` returns the output dict, or a list of
    scores (then rewards = scores). Service parameters (``generate``) named in its signature are passed through."""

    def __init__(self, fn: Callable[..., Any], name: str, kwargs: Mapping[str, Any] | None = None,
                 columns: Sequence[str] = ()) -> None:
        self.fn = fn
        self.name = name
        self.kwargs = dict(kwargs or {})
        self.columns = tuple(getattr(fn, "columns", columns))

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]:
        result = self.fn(rows, **self.kwargs)
        if isinstance(result, Mapping):
            return dict(result)
        return outputs(list(result))
