"""Forward passes over ragged rows without gradients: log-probs, entropy and critic values. No Ray import.

Rows are grouped into micro-batches by a token budget (longest first, so padding stays small), right-padded,
run through the model, and the next-token results cut back to ``L - 1`` entries per row, in the input row order
(ragged in, ragged out). Log-probs and entropy follow ROLL's strategy ops (spec §1.8): float32, exactly 0 where
``response_mask[1:]`` is 0. Values are the critic's raw outputs ``output[:, :-1, 0]`` at every position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from stages.algos.ragged import Ragged
from stages.train.batching import TokenRows, pad_micro_batch, split_by_token_budget, unpad_next_token


@dataclass
class ForwardResult:
    """Per column, the ragged ``L - 1`` results in input row order; counters for throughput."""

    columns: dict[str, Ragged]
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    micro_batches: int = 0
    extra: dict = field(default_factory=dict)


def _concat_in_order(parts: list[tuple[np.ndarray, Ragged]], num_rows: int) -> Ragged:
    """Micro-batch results (their row indices, their rows) → one Ragged in row order 0..num_rows-1."""
    lengths = np.zeros(num_rows, dtype=np.int64)
    for index, r in parts:
        lengths[index] = r.lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.zeros(offsets[-1], dtype=np.float32)
    for index, r in parts:
        dest = np.repeat(offsets[:-1][index], r.lengths) + r.position()
        values[dest] = r.values
    return Ragged(values, offsets)


@torch.inference_mode()
def forward_rows(model: torch.nn.Module, rows: TokenRows, max_tokens: int, *, kind: str = "log_probs",
                 entropy: bool = False, device: torch.device | str = "cpu", pad_token_id: int = 0) -> ForwardResult:
    """Run ``model`` over ``rows`` in micro-batches of at most ``max_tokens`` padded tokens.

    kind ``log_probs``: column ``log_probs`` (and ``entropy`` if asked) from a causal LM's logits;
    kind ``values``: column ``values`` from a one-label token-classification critic."""
    from stages.losses import entropy_from_logits, op_compute_log_probs

    start = time.perf_counter()
    parts: dict[str, list[tuple[np.ndarray, Ragged]]] = {}
    tokens = padded = count = 0
    for index in split_by_token_budget(rows.lengths, max_tokens):
        mb = pad_micro_batch(rows, index, pad_token_id).to(device)
        # right padding + causal attention: real tokens never see the padding, so no attention mask is needed
        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
        results = {}
        if kind == "values":
            results["values"] = out[:, :-1, 0].float()
        else:
            results["log_probs"] = op_compute_log_probs(out, mb.input_ids, mb.response_mask)
            if entropy:
                mask = mb.loss_mask
                ent = torch.zeros(mask.shape, dtype=torch.float32, device=out.device)
                on = mask > 0
                ent[on] = entropy_from_logits(out[:, :-1][on])
                results["entropy"] = ent
        for name, value in results.items():
            parts.setdefault(name, []).append((index, unpad_next_token(value, mb.lengths)))
        tokens += mb.real_tokens
        padded += mb.padded_tokens
        count += 1
    columns = {name: _concat_in_order(p, rows.num_rows) for name, p in parts.items()}
    if rows.num_rows == 0:
        names = ["values"] if kind == "values" else ["log_probs"] + (["entropy"] if entropy else [])
        columns = {n: Ragged(np.zeros(0, np.float32), np.zeros(1, np.int64)) for n in names}
    return ForwardResult(columns, tokens, padded, time.perf_counter() - start, count)


def load_forward_model(path: str, kind: str, dtype: str = "fp32", *, actor_dir: str | None = None, seed: int = 42,
                       device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model of a forward pass, in eval mode: a causal LM (``log_probs``) or the critic (``values``: the saved
    critic at ``path``, or, when ``path`` holds none yet, a new head on ``actor_dir`` seeded as training does)."""
    from stages.train.core import load_critic_model

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    if kind == "values":
        model = load_critic_model(path if actor_dir is None else None, actor_dir or path, seed)
    else:
        from stages.train.core import load_actor_model

        model = load_actor_model(path)
    return model.to(device=device, dtype=torch_dtype).eval()
