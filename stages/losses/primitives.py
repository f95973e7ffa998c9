"""Masked reductions, log-probs / entropy from logits and the KL estimators, in torch (spec §1, §2.1, §4.6).

Layout (spec §0.1): ``(B, T)`` tensors are next-token aligned, ``T = S - 1``; position ``t`` refers to token
``t + 1``. ``mask`` is 0/1 of the same shape (any dtype; it is cast to the value dtype).
"""

from __future__ import annotations

import torch

from schemas.errors import ConfigError, InvariantError

EPS = 1e-8
KL_TYPES = ("kl", "abs", "mse", "k3", "full")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·mask over everything (scalar) or along ``dim`` (spec §1.2)."""
    xm = x * mask.to(x.dtype)
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·mask / (Σ mask + 1e-8); along ``dim`` a slice with no selected element gives exactly 0 (spec §1.1)."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / (m.sum() + EPS)
    count = m.sum(dim=dim)
    mean = (x * m).sum(dim=dim) / (count + EPS)
    return torch.where(count > 0, mean, torch.zeros_like(mean))


def segment_ids(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask → (B, T) int64 id of the maximal run of 1s each position belongs to (global over the batch,
    starting at 0), and -1 outside every run. Runs never cross rows."""
    on = mask > 0
    prev = torch.zeros_like(on)
    prev[:, 1:] = on[:, :-1]
    starts = (on & ~prev).reshape(-1)
    ids = torch.cumsum(starts.to(torch.int64), dim=0) - 1
    return torch.where(on.reshape(-1), ids, torch.full_like(ids, -1)).reshape(mask.shape)


def segment_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) → (B, T): each maximal run of 1s in ``mask`` (one turn) gets Σ_run x / (n_run + 1e-8) at its positions,
    0 elsewhere (spec §4.6). Differentiable: the gradient reaches every token of the run."""
    ids = segment_ids(mask).reshape(-1)
    inside = ids >= 0
    n_segments = int(ids.max().item()) + 1 if bool(inside.any()) else 0
    safe_ids = ids.clamp(min=0)
    flat = torch.where(inside, x.reshape(-1), torch.zeros_like(x.reshape(-1)))
    sums = torch.zeros(n_segments, dtype=x.dtype, device=x.device).index_add(0, safe_ids[inside], flat[inside])
    counts = torch.bincount(safe_ids[inside], minlength=n_segments).to(x.dtype)
    means = sums / (counts + EPS)
    out = torch.where(inside, means[safe_ids] if n_segments else flat, torch.zeros_like(flat))
    return out.reshape(x.shape)


CHUNK_ELEMENTS = 1 << 28  # float32 temporaries of one chunk of positions: at most 1 GiB


def _position_chunks(x: torch.Tensor, vocab: int):
    """Views ``(n, k)`` covering the positions of ``(..., k)`` in order, ``n * vocab`` at most CHUNK_ELEMENTS (the
    same cut for the logits and their per-position companions): a ``(B, T, k)`` slice such as ``logits[:, :-1]``
    is walked row by row, so no copy of it is made."""
    rows = max(1, CHUNK_ELEMENTS // max(1, vocab))
    blocks = list(x) if x.dim() == 3 else [x.reshape(-1, x.shape[-1])]
    for block in blocks:
        yield from block.split(rows)


def _chunk_log_probs(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, V) logits, (n, 1) labels → float32 log p(label) and log-sum-exp, (n,) each."""
    z = z.float()
    s = torch.logsumexp(z, dim=-1)
    return z.gather(-1, y.long()).squeeze(-1) - s, s


def _chunk_grad(z: torch.Tensor, y: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d(g · log p(y)) / dz = g (onehot(y) − softmax(z)) for (n, V) logits, in the logits' dtype."""
    dz = torch.exp(z.float() - s) * -g.float()
    return dz.scatter_add(-1, y.long(), g.float()).to(z.dtype)


_COMPILED: dict = {}


def _kernel(fn, device: torch.device):
    """``fn`` itself on CPU; on a GPU, ``fn`` through torch.compile (one fused pass over the chunk instead of one
    kernel per operation; dynamic shapes, compiled once per process)."""
    if device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def _label_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., V), (...) → float32 log p(label) and log-sum-exp, both (...), computed a chunk of positions at a time."""
    lp, lse = [], []
    v = logits.shape[-1]
    chunk = _kernel(_chunk_log_probs, logits.device)
    for z, y in zip(_position_chunks(logits, v), _position_chunks(labels.unsqueeze(-1), v)):
        p, s = chunk(z, y)
        lp.append(p)
        lse.append(s)
    shape = labels.shape
    if not lp:  # no positions at all
        empty = torch.zeros(shape, dtype=torch.float32, device=logits.device)
        return empty, empty.clone()
    return torch.cat(lp).reshape(shape), torch.cat(lse).reshape(shape)


class _LogProbsFromLogits(torch.autograd.Function):
    """log p(label) with a lean backward: only the logits (in their own dtype) and the log-sum-exp are kept, and the
    gradient ``g * (onehot(label) - softmax(z))`` is formed a chunk of positions at a time in float32, then written
    in the logits' dtype. Equal to log_softmax + gather (spec §1.8) up to float32 rounding, without the float32 copy,
    log-distribution and scatter buffers of the vocabulary that autograd would otherwise hold."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lp, lse = _label_log_probs(logits, labels)
        ctx.save_for_backward(logits, labels, lse)
        return lp

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        v = logits.shape[-1]
        chunks = zip(*(_position_chunks(x, v) for x in (logits, out, labels.unsqueeze(-1), lse.unsqueeze(-1),
                                                         grad.unsqueeze(-1))))
        chunk = _kernel(_chunk_grad, logits.device)
        for z, o, y, s, g in chunks:
            o.copy_(chunk(z, y, s, g))
        return out, None


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(..., V) logits, (...) labels → (...) float32 log p(label) = z_label − logsumexp(z) in float32 (spec §1.8:
    ROLL's log_softmax + gather), a chunk of positions at a time."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogProbsFromLogits.apply(logits, labels)
    return _label_log_probs(logits, labels)[0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) → (...) float32 entropy logsumexp(z) − Σ softmax(z)·z (spec §1.8)."""
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def token_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) response mask → (B, T = S-1) token mask ``M = response_mask[:, 1:]`` (spec §0.1)."""
    return response_mask[:, 1:]


def token_log_probs(next_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked log-probs from already-shifted logits: next_logits (B,T,V) (= logits[:, :-1]), labels (B,T)
    (= input_ids[:, 1:]), mask (B,T) → (B,T), exactly 0 off the mask (labels there are replaced by 0, as ROLL does).
    Works on any slice of T, so a training stage can stream the vocabulary projection in chunks."""
    safe_labels = torch.where(mask > 0, labels, torch.zeros_like(labels))
    return log_probs_from_logits(next_logits, safe_labels) * mask.float()


def token_entropy(next_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked entropy from already-shifted logits (B,T,V), mask (B,T) → (B,T), 0 off the mask."""
    return entropy_from_logits(next_logits) * mask.float()


def op_compute_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """ROLL's strategy op (spec §1.8): logits (B,S,V), input_ids (B,S), response_mask (B,S) → (B,S-1) log-probs of
    ``input_ids[:, 1:]`` under ``logits[:, :-1]``, exactly 0 where ``response_mask[:, 1:] = 0``."""
    return token_log_probs(logits[:, :-1], input_ids[:, 1:], token_mask(response_mask))


def op_compute_entropy(logits: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """ROLL's strategy op (spec §1.8): logits (B,S,V), response_mask (B,S) → (B,S-1) entropy, 0 off the mask."""
    return token_entropy(logits[:, :-1], token_mask(response_mask))


def approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, mask: torch.Tensor | None = None,
              kl_type: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of π against a base policy (spec §2.1). (B,T) → (B,T), times ``mask`` if given.

    ``kl``: lp − lb; ``abs``: |lp − lb|; ``mse``: ½(lp − lb)²; ``k3``: clamp(e^k − k − 1, −10, 10) with k = lb − lp;
    ``full``: inputs are (B,T,V) log-distributions, Σ_v e^{lp_v}(lp_v − lb_v).
    """
    diff = log_probs - log_probs_base
    if kl_type == "kl":
        kl = diff
    elif kl_type == "abs":
        kl = diff.abs()
    elif kl_type == "mse":
        kl = 0.5 * diff.square()
    elif kl_type == "k3":
        k = -diff
        kl = (torch.exp(k) - k - 1).clamp(min=-10, max=10)
    elif kl_type == "full":
        kl = (torch.exp(log_probs) * diff).sum(dim=-1)
    else:
        raise ConfigError(f"kl type '{kl_type}' is unknown; use one of {', '.join(KL_TYPES)}")
    return kl if mask is None else kl * mask.to(kl.dtype)


def loss_normalisers(mask: torch.Tensor) -> tuple[float, float]:
    """(B, T) loss mask → (num_tokens, num_seqs) = (Σ mask, #rows with a token), each at least 1 (spec §6.2).

    Compute these over the WHOLE mini-batch (all micro-batches, all ranks, after the train/infer filter) and pass
    them to every micro-batch's loss: the sum of the micro-batch losses then equals the mini-batch loss."""
    m = mask > 0
    return max(float(m.sum().item()), 1.0), max(float(m.any(dim=-1).sum().item()), 1.0)


def check_same_shape(where: str, **tensors: torch.Tensor | None) -> None:
    """Raise InvariantError naming the first tensor whose shape differs from the first one given."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if not shapes:
        return
    first_name, first_shape = next(iter(shapes.items()))
    for name, shape in shapes.items():
        if shape != first_shape:
            raise InvariantError(
                f"{where}: '{name}' has shape {shape} but '{first_name}' has {first_shape}; all next-token "
                f"tensors of one micro-batch must be padded to the same (B, T) — pad them together")
