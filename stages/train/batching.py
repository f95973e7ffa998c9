"""Ragged rows → padded micro-batches by a token budget, and the deterministic plan of a PPO training step.

Pure numpy/torch (no Ray, no DeepSpeed). Rows are the table's rows (docs/CONTRIBUTING.md "Ragged token data"):
``input_ids`` and ``response_mask`` have ``L`` entries, next-token columns ``L - 1``. A micro-batch pads its rows on
the right to the longest one; its cost is ``rows x padded length`` tokens, which the budget bounds.

The plan of a step (spec §6.2): every epoch shuffles the rows with a seed, cuts them into mini-batches (one
optimizer step each), deals each mini-batch's rows to the data-parallel ranks, and splits each rank's share into
micro-batches. All ranks compute the same plan from the same table, so the global normalisers (tokens and rows with a
token over the whole mini-batch) need no communication, and every rank runs the same number of micro-batches
(empty ones are padding steps with zero loss) — ZeRO-2 reduces gradients on every backward, so counts must agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pyarrow as pa
import torch

from schemas.errors import InvariantError, SchemaError
from schemas.train_config import WorkerTrainConfig
from stages.algos.ragged import Ragged
from stages.losses import entropy_from_logits, fused_output_layer_log_probs_entropy, token_log_probs

ROW_COLUMNS = ("difficulty",)  # one number per row the loss reads (RLVR's difficulty_loss_weight, spec §6.5)
NEXT_TOKEN_COLUMNS = ("old_log_probs", "ref_log_probs", "infer_logprobs", "advantages", "returns", "values",
                      "train_infer_is_weight", "final_response_mask")


def take(r: Ragged, rows: np.ndarray) -> Ragged:
    """The rows ``rows`` (int indices, any order) of ``r`` as a new Ragged, without a Python loop per row."""
    rows = np.asarray(rows, dtype=np.int64)
    lengths = r.lengths[rows]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.repeat(r.offsets[:-1][rows] - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    return Ragged(r.values[flat], offsets)


@dataclass(frozen=True)
class TokenRows:
    """``B`` ragged rows: ``input_ids`` and ``response_mask`` (L each), next-token float columns (L - 1 each) and
    per-row columns (``(B,)`` each, :data:`ROW_COLUMNS`, as stored: the loss checks and converts them)."""

    input_ids: Ragged
    response_mask: Ragged
    next_token: dict[str, Ragged] = field(default_factory=dict)
    row_ids: np.ndarray | None = None
    per_row: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def from_arrow(cls, table: pa.Table, where: str, columns: tuple[str, ...] = NEXT_TOKEN_COLUMNS) -> "TokenRows":
        """The token columns of ``table`` (the others are ignored); checks the L / L-1 lengths of every row."""
        for name in ("input_ids", "response_mask"):
            if name not in table.column_names:
                raise SchemaError(f"table at {where}: missing column '{name}'; training and log-probs need the "
                                  "token ids and the response mask of every row")
        ids = Ragged.from_arrow(table.column("input_ids"), np.int64)
        mask = Ragged.from_arrow(table.column("response_mask"), np.int64)
        rid = table.column("row_id").to_numpy(zero_copy_only=False) if "row_id" in table.column_names else None
        per_row = {c: table.column(c).to_numpy(zero_copy_only=False) for c in ROW_COLUMNS if c in table.column_names}
        rows = cls(ids, mask, {c: Ragged.from_arrow(table.column(c), np.float32) for c in columns
                               if c in table.column_names}, rid, per_row)
        rows.check(where)
        return rows

    def check(self, where: str) -> None:
        """Raise InvariantError naming the first row whose column lengths break the L / L-1 layout."""
        want = {"response_mask": self.lengths}
        want.update({c: np.maximum(self.lengths - 1, 0) for c in self.next_token})
        for name, expected in want.items():
            got = self.column(name).lengths
            bad = np.flatnonzero(got != expected)
            if bad.size:
                i = int(bad[0])
                rid = f" (row_id {self.row_ids[i]})" if self.row_ids is not None else ""
                raise InvariantError(f"table at {where}: row {i}{rid} has {got[i]} entries in '{name}' but "
                                     f"{self.lengths[i]} tokens; expected {expected[i]}. Fix the producer of '{name}'.")
        if len(self.input_ids.values) and self.input_ids.values.min() < 0:
            raise InvariantError(f"table at {where}: 'input_ids' holds a negative token id; token ids must be >= 0")

    def column(self, name: str) -> Ragged:
        if name == "input_ids":
            return self.input_ids
        if name == "response_mask":
            return self.response_mask
        return self.next_token[name]

    @property
    def num_rows(self) -> int:
        return self.input_ids.num_rows

    @property
    def lengths(self) -> np.ndarray:
        """``(B,)`` tokens per row (L)."""
        return self.input_ids.lengths

    def loss_tokens(self) -> np.ndarray:
        """``(B,)`` tokens of each row's loss mask ``response_mask[1:]`` (spec §0.1)."""
        m = self.response_mask
        first = np.zeros(len(m.values), dtype=bool)
        first[m.offsets[:-1][m.lengths > 0]] = True
        return np.bincount(m.row_index()[~first], weights=(m.values[~first] > 0).astype(np.float64),
                           minlength=self.num_rows).astype(np.int64)

    def final_tokens(self) -> np.ndarray | None:
        """``(B,)`` tokens of RLVR's ``final_response_mask`` (L - 1 entries) per row, or None without that column."""
        if "final_response_mask" not in self.next_token:
            return None
        f = self.next_token["final_response_mask"]
        return np.bincount(f.row_index(), weights=(f.values > 0).astype(np.float64),
                           minlength=self.num_rows).astype(np.int64)

    def take(self, rows: np.ndarray) -> "TokenRows":
        return TokenRows(take(self.input_ids, rows), take(self.response_mask, rows),
                         {k: take(v, rows) for k, v in self.next_token.items()},
                         None if self.row_ids is None else self.row_ids[np.asarray(rows, dtype=np.int64)],
                         {k: v[np.asarray(rows, dtype=np.int64)] for k, v in self.per_row.items()})

    def with_next_token(self, name: str, column: Ragged) -> "TokenRows":
        return TokenRows(self.input_ids, self.response_mask, {**self.next_token, name: column}, self.row_ids,
                         self.per_row)

    def with_response_mask(self, mask: Ragged) -> "TokenRows":
        return TokenRows(self.input_ids, mask, self.next_token, self.row_ids, self.per_row)


# ---- micro-batches --------------------------------------------------------------------------------------------

def split_by_token_budget(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """``(B,)`` row lengths → groups of row indices with ``rows x longest <= max_tokens``.

    Rows are taken longest first (stable), so each group pads little; a row longer than the budget forms a group
    alone. Deterministic; every row appears exactly once."""
    if max_tokens <= 0:
        raise InvariantError(f"token budget {max_tokens} must be > 0")
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    groups: list[list[int]] = []
    width = 0
    for i in order:
        n = int(lengths[i])
        if groups and (len(groups[-1]) + 1) * max(width, n) <= max_tokens:
            groups[-1].append(int(i))
            width = max(width, n)
        else:
            groups.append([int(i)])
            width = n
    return [np.array(g, dtype=np.int64) for g in groups]


def split_by_real_tokens(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """``(B,)`` row lengths → groups of row indices with ``Σ length <= max_tokens`` (packed micro-batches: no
    padding counts against the budget). Rows in table order; a row longer than the budget forms a group alone."""
    if max_tokens <= 0:
        raise InvariantError(f"token budget {max_tokens} must be > 0")
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(np.asarray(lengths, dtype=np.int64)):
        if groups and used + int(n) <= max_tokens:
            groups[-1].append(i)
            used += int(n)
        else:
            groups.append([i])
            used = int(n)
    return [np.array(g, dtype=np.int64) for g in groups]


def split_by_rows(num_rows: int, rows_per_micro_batch: int) -> list[np.ndarray]:
    """``num_rows`` → consecutive groups of ``rows_per_micro_batch`` (the last may be smaller)."""
    return [np.arange(s, min(s + rows_per_micro_batch, num_rows), dtype=np.int64)
            for s in range(0, num_rows, rows_per_micro_batch)]


@dataclass
class MicroBatch:
    """One padded micro-batch of ``b`` rows, ``S`` = longest row: ``(b, S)`` int64 ``input_ids``,
    ``attention_mask``, ``position_ids``, ``response_mask``; ``(b, S-1)`` float32 next-token columns; ``lengths``
    ``(b,)``. ``padding_step``: a stand-in with no real row (its loss is multiplied by 0). ``per_row``: the rows'
    per-row columns, ``(b,)`` each (:data:`ROW_COLUMNS`; host arrays)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    next_token: dict[str, torch.Tensor]
    lengths: np.ndarray
    padding_step: bool = False
    per_row: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return 0 if self.padding_step else int(self.input_ids.shape[0])

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return 0 if self.padding_step else int(self.lengths.sum())

    @property
    def loss_mask(self) -> torch.Tensor:
        """``(b, S-1)`` token mask ``response_mask[:, 1:]``."""
        return self.response_mask[:, 1:]

    def to(self, device: torch.device | str) -> "MicroBatch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(move(self.input_ids), move(self.attention_mask), move(self.position_ids),
                          move(self.response_mask), {k: move(v) for k, v in self.next_token.items()}, self.lengths,
                          self.padding_step, self.per_row)


def pad_micro_batch(rows: TokenRows, index: np.ndarray, pad_token_id: int = 0) -> MicroBatch:
    """Rows ``index`` of ``rows`` → a right-padded :class:`MicroBatch`; an empty ``index`` gives a padding step
    (one row of two pad tokens, all masks 0)."""
    index = np.asarray(index, dtype=np.int64)
    if index.size == 0:
        ids = torch.full((1, 2), pad_token_id, dtype=torch.int64)
        zeros = torch.zeros_like(ids)
        return MicroBatch(ids, torch.ones_like(ids), torch.arange(2).unsqueeze(0), zeros,
                          {k: torch.zeros((1, 1)) for k in rows.next_token}, np.array([2]), padding_step=True)
    sub = rows.take(index)
    lengths = sub.lengths
    width = max(int(lengths.max()), 2)
    ids = torch.from_numpy(sub.input_ids.to_padded(width, fill=pad_token_id))
    attention = torch.from_numpy((np.arange(width)[None, :] < lengths[:, None]).astype(np.int64))
    # 0..S-1 on every row: real tokens get 0..L-1 and the right padding (invisible to them under causal attention)
    # continues the count. Positions that restart or repeat would read as packed sequences to Hugging Face's mask
    # builder, which then materialises a (b, 1, S, S) mask and leaves SDPA's fused causal kernels.
    positions = torch.arange(width, dtype=torch.int64).expand(len(lengths), width).contiguous()
    response = torch.from_numpy(sub.response_mask.to_padded(width, fill=0).astype(np.int64))
    next_token = {k: torch.from_numpy(v.to_padded(width - 1, fill=0.0).astype(np.float32))
                  for k, v in sub.next_token.items()}
    return MicroBatch(ids, attention, positions, response, next_token, lengths, per_row=sub.per_row)


def real_tokens(mb: MicroBatch) -> torch.Tensor:
    """``(b, S)`` bool: True at each row's real tokens, False at its right padding."""
    width = mb.input_ids.shape[1]
    lengths = torch.as_tensor(mb.lengths, device=mb.input_ids.device)
    return torch.arange(width, device=mb.input_ids.device)[None, :] < lengths[:, None]


def forward_packed(call, mb: MicroBatch) -> torch.Tensor:
    """The model's per-token outputs ``(b, S, ...)`` for a right-padded micro-batch, computed once over its rows packed
    into a single row without padding: ``call(input_ids (1, T), position_ids (1, T)) -> (1, T, ...)`` with
    ``T = Σ lengths`` and positions restarting at 0 for every row, which Hugging Face's attention reads as packed
    sequences (each attends to itself only). Padding positions of the result are 0."""
    width = mb.input_ids.shape[1]
    real = real_tokens(mb)
    out = call(mb.input_ids[real][None], mb.position_ids[real][None])
    full = out.new_zeros((mb.input_ids.shape[0], width) + tuple(out.shape[2:]))
    full[real] = out[0]
    return full


class LossEntries:
    """Per-entry values of a micro-batch's loss tokens, entry ``n`` at ``(rows[n], cols[n])`` of the ``(b, S-1)``
    next-token layout ``shape`` (the fields of :class:`TokenLogits` and :class:`TokenHidden`)."""

    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(N,) values of the entries → ``(b, S-1)`` float32, 0 elsewhere (differentiable)."""
        return x.new_zeros(self.shape, dtype=torch.float32).index_put((self.rows, self.cols), x.float())


@dataclass
class TokenLogits(LossEntries):
    """A micro-batch's next-token logits at its loss tokens only: ``values[n]`` (N, V) predicts token ``cols[n] + 1``
    of row ``rows[n]``, i.e. belongs at ``(rows[n], cols[n])`` of the ``(b, S-1)`` next-token layout. A small model
    spends a large share of a token's work in the vocabulary projection and its softmax; only response tokens need
    them (log-probs, entropy and the loss are 0 elsewhere, spec §1.8), so the model projects only those positions.
    ``shape``: ``(b, S-1)``."""

    values: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_dense(cls, logits: torch.Tensor, mb: MicroBatch) -> "TokenLogits":
        """Full ``(b, S, V)`` logits → the entries at the loss tokens (all of them for a padding step)."""
        mask = torch.ones_like(mb.loss_mask) if mb.padding_step else mb.loss_mask
        rows, cols = (mask > 0).nonzero(as_tuple=True)
        return cls(logits[:, :-1][rows, cols], rows, cols, tuple(mb.loss_mask.shape))

    def log_probs(self, mb: MicroBatch) -> torch.Tensor:
        """``(b, S-1)`` float32 log-probs of ``mb``'s next tokens, 0 off the loss mask: ROLL's
        ``op_compute_log_probs`` (spec §1.8) evaluated at the entries only."""
        labels, on = mb.input_ids[self.rows, self.cols + 1], mb.response_mask[self.rows, self.cols + 1]
        return self.scatter(token_log_probs(self.values, labels, on))

    def entropy(self) -> torch.Tensor:
        """``(b, S-1)`` float32 entropy at the entries, 0 elsewhere (``op_compute_entropy`` at the loss tokens)."""
        return self.scatter(entropy_from_logits(self.values))


def output_layer(model) -> torch.nn.Module:
    """The vocabulary projection of a Hugging Face causal LM, also under a DeepSpeed engine or a PEFT wrapper."""
    return getattr(model, "module", model).get_output_embeddings()


def causal_lm_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     keep: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """A Hugging Face causal LM's logits: ``(b, S, V)`` at every position for ``keep`` None, else ``(N, V)`` at the
    ``N`` positions ``keep = (rows, cols)`` only. The decoder runs over every position; the output layer sees only the
    kept rows of the hidden states (a pre-hook on it selects them), and whatever the model applies after it (a logit
    scale, soft-capping) applies to those. Hugging Face's own ``logits_to_keep`` keeps the same positions in every row,
    which for right-padded rows of different lengths is the union of their loss positions: several times more."""
    if keep is None:
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    rows, cols = keep

    def select(module, args):
        return (args[0][rows, cols], *args[1:])

    handle = output_layer(model).register_forward_pre_hook(select)
    try:
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    finally:
        handle.remove()


def _loss_positions(mb: MicroBatch, packed: bool):
    """``(input_ids, position_ids, keep, rows, cols)``: the model's input for ``mb`` (its rows packed into one row
    with ``packed``), the positions ``keep`` of that input whose output-layer results are wanted (``mb``'s loss
    tokens) and where each belongs in the ``(b, S-1)`` layout."""
    mask = mb.loss_mask > 0
    if not packed:
        rows, cols = mask.nonzero(as_tuple=True)
        return mb.input_ids, mb.position_ids, (rows, cols), rows, cols
    real = real_tokens(mb)
    rows, cols = real.nonzero(as_tuple=True)  # packed position p is (rows[p], cols[p]), row-major
    on = torch.zeros_like(cols, dtype=torch.bool)
    inside = cols < mask.shape[1]
    on[inside] = mask[rows[inside], cols[inside]]
    keep = on.nonzero(as_tuple=True)[0]
    return mb.input_ids[real][None], mb.position_ids[real][None], (torch.zeros_like(keep), keep), rows[keep], cols[keep]


def select_logits(call, mb: MicroBatch, packed: bool = False) -> TokenLogits:
    """The model's logits at ``mb``'s loss tokens. ``call(input_ids, position_ids, keep) -> (N, V)`` is the model with
    the output layer at the positions ``keep = (rows, cols)`` of its input (:func:`causal_lm_logits`). ``packed`` runs
    the rows as one row without padding (:func:`forward_packed`). A padding step projects every position (its zero
    loss must still reach every weight)."""
    if mb.padding_step:
        return TokenLogits.from_dense(call(mb.input_ids, mb.position_ids, None), mb)
    input_ids, position_ids, keep, rows, cols = _loss_positions(mb, packed)
    return TokenLogits(call(input_ids, position_ids, keep), rows, cols, tuple(mb.loss_mask.shape))


@dataclass
class TokenHidden(LossEntries):
    """A micro-batch's last hidden states at its loss tokens, ``hidden`` (N, H), with the output layer ``layer``: the
    same entries as :class:`TokenLogits` (``rows``, ``cols``, ``shape``), whose log-probs and entropy come from
    :func:`fused_output_layer_log_probs_entropy`, so the (N, V) logits are never held. ``labels`` (N,): the next
    tokens (0 off the response mask, as ROLL does), ``on`` (N,): the response mask there. Both columns are computed
    together on first use (``chunk_tokens`` positions at a time) and kept; without ``with_entropy`` (a log-prob pass
    that writes no entropy) the log-probs alone."""

    hidden: torch.Tensor
    layer: torch.nn.Module
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]
    labels: torch.Tensor
    on: torch.Tensor
    chunk_tokens: int | None = None
    with_entropy: bool = True
    _out: tuple[torch.Tensor, torch.Tensor | None] | None = field(default=None, repr=False)

    def _fused(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._out is None:
            self._out = fused_output_layer_log_probs_entropy(self.layer, self.hidden, self.labels, self.chunk_tokens,
                                                             self.with_entropy)
        return self._out

    def log_probs(self, mb: MicroBatch) -> torch.Tensor:
        """``(b, S-1)`` float32 log-probs of ``mb``'s next tokens, 0 off the loss mask (as TokenLogits.log_probs)."""
        return self.scatter(self._fused()[0] * self.on.float())

    def entropy(self) -> torch.Tensor:
        """``(b, S-1)`` float32 entropy at the entries, 0 elsewhere (as TokenLogits.entropy)."""
        if not self.with_entropy:
            raise InvariantError("TokenHidden.entropy: made with with_entropy=False; select_hidden(..., "
                                 "with_entropy=True) computes it")
        return self.scatter(self._fused()[1])


def causal_lm_hidden(model, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     keep: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.nn.Module]:
    """A Hugging Face causal LM's last hidden states ``(N, H)`` at the positions ``keep = (rows, cols)``, as its
    output layer would receive them, and that layer; the layer itself is given no position (a pre-hook keeps the
    inputs and hands it an empty slice), so no logits are formed."""
    layer = output_layer(model)
    rows, cols = keep
    kept: list[torch.Tensor] = []

    def capture(module, args):
        kept.append(args[0][rows, cols])
        return (args[0][..., :0, :], *args[1:])

    handle = layer.register_forward_pre_hook(capture)
    try:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    return kept[0], layer


def select_hidden(model, mb: MicroBatch, packed: bool = False, chunk_tokens: int | None = None,
                  with_entropy: bool = True) -> TokenHidden | TokenLogits:
    """:func:`select_logits` for the fused output layer: ``mb``'s loss tokens as :class:`TokenHidden` (its entropy
    computed only ``with_entropy``). A padding step projects every position as select_logits does
    (:class:`TokenLogits`)."""
    if mb.padding_step:
        return select_logits(partial(causal_lm_logits, model), mb, packed)
    input_ids, position_ids, keep, rows, cols = _loss_positions(mb, packed)
    hidden, layer = causal_lm_hidden(model, input_ids, position_ids, keep)
    on = mb.response_mask[rows, cols + 1]
    labels = torch.where(on > 0, mb.input_ids[rows, cols + 1], torch.zeros_like(rows))
    return TokenHidden(hidden, layer, rows, cols, tuple(mb.loss_mask.shape), labels, on, chunk_tokens, with_entropy)


def unpad_next_token(padded: torch.Tensor, lengths: np.ndarray) -> Ragged:
    """``(b, S-1)`` next-token values → Ragged rows of ``L - 1`` entries each (float32)."""
    values = padded.detach().to("cpu", torch.float32).numpy()
    return Ragged.from_padded(values, np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0))


# ---- the plan of one training step ------------------------------------------------------------------------------

@dataclass(frozen=True)
class MiniBatchPlan:
    """One optimizer step on one rank: its micro-batches (row indices into the table; an empty array is a padding
    step) and the global normalisers of the whole mini-batch (all ranks): ``num_tokens`` = Σ loss mask (>= 1),
    ``num_seqs`` = rows with a loss token (>= 1), ``num_rows`` = rows (>= 1; the critic's mean over rows);
    ``final_*`` the same for RLVR's ``final_response_mask`` when the table has one."""

    micro_batches: tuple[np.ndarray, ...]
    num_tokens: float
    num_seqs: float
    num_rows: float
    final_num_tokens: float | None = None
    final_num_seqs: float | None = None


@dataclass(frozen=True)
class BatchingPolicy:
    """How a rank's share of a mini-batch becomes micro-batches: by ``max_tokens`` (dynamic batching) or by
    ``rows_per_micro_batch``; ``mini_batch_rows`` rows per rank per optimizer step. ``packed``: the micro-batches
    run packed into one row (:func:`forward_packed`), so ``max_tokens`` counts real tokens, not padded ones."""

    mini_batch_rows: int
    max_tokens: int | None = None
    rows_per_micro_batch: int | None = None
    packed: bool = False

    def split(self, lengths: np.ndarray) -> list[np.ndarray]:
        if self.max_tokens is not None:
            split = split_by_real_tokens if self.packed else split_by_token_budget
            return split(lengths, self.max_tokens)
        return split_by_rows(len(lengths), self.rows_per_micro_batch or len(lengths) or 1)


def batching_policy(worker: WorkerTrainConfig) -> BatchingPolicy:
    """The policy of a training step under ``worker``'s options: ``per_device_train_batch_size`` x
    ``gradient_accumulation_steps`` rows per rank per optimizer step, in micro-batches by token budget
    (``use_dynamic_batching_in_train``) or of ``per_device_train_batch_size`` rows, packed with
    ``use_sequence_packing``."""
    t = worker.training_args
    rows = t.per_device_train_batch_size * t.gradient_accumulation_steps
    if worker.use_dynamic_batching_in_train:
        return BatchingPolicy(rows, max_tokens=worker.max_tokens_per_microbatch_in_train,
                              packed=worker.use_sequence_packing)
    return BatchingPolicy(rows, rows_per_micro_batch=t.per_device_train_batch_size, packed=worker.use_sequence_packing)


def epoch_order(num_rows: int, seed: int, step: int, epoch: int) -> np.ndarray:
    """The seeded shuffle of the rows for (training step, epoch): reproducible across processes and resumes."""
    return np.random.default_rng([seed, step, epoch]).permutation(num_rows)


def deal_to_ranks(rows: np.ndarray, lengths: np.ndarray, world_size: int) -> list[np.ndarray]:
    """A mini-batch's row indices → one share per rank: longest first, dealt round-robin (balances tokens)."""
    order = rows[np.argsort(-lengths[rows], kind="stable")]
    return [order[r::world_size] for r in range(world_size)]


def _counts(tokens: np.ndarray | None, rows: np.ndarray) -> tuple[float | None, float | None]:
    """(Σ tokens, rows with a token) over ``rows``, each at least 1 (spec §6.2); (None, None) without counts."""
    if tokens is None:
        return None, None
    return max(float(tokens[rows].sum()), 1.0), max(float((tokens[rows] > 0).sum()), 1.0)


def plan_step(lengths: np.ndarray, loss_tokens: np.ndarray, *, policy: BatchingPolicy, world_size: int, rank: int,
              ppo_epochs: int, seed: int, step: int, final_tokens: np.ndarray | None = None) -> list[MiniBatchPlan]:
    """The optimizer steps of one training step for ``rank`` (spec §6.2), in order, all epochs.

    lengths, loss_tokens (final_tokens): ``(B,)`` tokens and loss-mask (final-mask) tokens per row of the table."""
    if not 0 <= rank < world_size:
        raise InvariantError(f"rank {rank} is outside world size {world_size}")
    lengths = np.asarray(lengths, dtype=np.int64)
    loss_tokens = np.asarray(loss_tokens, dtype=np.int64)
    global_rows = policy.mini_batch_rows * world_size
    plans = []
    for epoch in range(ppo_epochs):
        order = epoch_order(len(lengths), seed, step, epoch)
        for start in range(0, len(order), global_rows):
            rows = order[start:start + global_rows]
            shares = deal_to_ranks(rows, lengths, world_size)
            splits = [[share[g] for g in policy.split(lengths[share])] if share.size else [] for share in shares]
            count = max(len(s) for s in splits)
            mine = splits[rank] + [np.zeros(0, dtype=np.int64)] * (count - len(splits[rank]))
            num_tokens, num_seqs = _counts(loss_tokens, rows)
            plans.append(MiniBatchPlan(tuple(mine), num_tokens, num_seqs, float(max(len(rows), 1)),
                                       *_counts(final_tokens, rows)))
    return plans
