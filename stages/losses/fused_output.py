"""The output layer fused with the log-prob of the label and the entropy (spec §1.8), a chunk of tokens at a time.

``log_probs_from_logits(hidden @ weight.T + bias, labels)`` and ``entropy_from_logits(...)`` first form the whole
``(N, V)`` logits, and autograd keeps them for the backward pass. Here each chunk of ``chunk_tokens`` positions is
projected, reduced in float32 exactly as primitives.py does (``_chunk_log_probs``; entropy as
``entropy_from_logits``), and dropped; the backward pass projects the chunk again and forms its logits' gradient in
float32 from the saved log-sum-exp (and entropy), then writes the gradients of the hidden states, the weight and the
bias. Only ``(N, H)``-sized and ``(N,)``-sized tensors are saved; the extra memory of a pass is
``O(chunk_tokens × V)``. The weight may be shared with the input embedding (tied embeddings): its gradient is
returned to autograd, which accumulates it into that one parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from schemas.errors import ConfigError
from stages.losses.primitives import CHUNK_ELEMENTS, _kernel

FUSED_CHUNK_ELEMENTS = 1 << 26  # default chunk: at most 64 Mi logits (256 MiB in float32) per chunk of positions


def default_chunk_tokens(vocab: int) -> int:
    """Positions per chunk for a vocabulary of ``vocab``: FUSED_CHUNK_ELEMENTS logits at most, at least 1."""
    return max(1, min(CHUNK_ELEMENTS, FUSED_CHUNK_ELEMENTS) // max(1, vocab))


def _upcast(z: torch.Tensor) -> torch.Tensor:
    """The reduction dtype: float32 as primitives.py's ``z.float()`` for float32 and narrower logits; float64 logits
    stay float64 (so that gradcheck can check the backward in float64)."""
    return z.to(torch.promote_types(z.dtype, torch.float32))


def _chunk_log_probs(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, V) logits, (n, 1) labels → log p(label) and log-sum-exp, (n,) each: primitives.py's ``_chunk_log_probs``
    (the same expressions) with :func:`_upcast`."""
    z = _upcast(z)
    s = torch.logsumexp(z, dim=-1)
    return z.gather(-1, y.long()).squeeze(-1) - s, s


def _chunk_entropy(z: torch.Tensor) -> torch.Tensor:
    """(n, V) logits → (n,) entropy, the same expression as ``entropy_from_logits``, with :func:`_upcast`."""
    z = _upcast(z)
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _chunk_logits_grad(z: torch.Tensor, y: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
                       g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> torch.Tensor:
    """(n, V) logits, (n,) labels, log-sum-exp, entropy and upstream gradients → (n, V) float32 gradient of
    ``Σ g_lp · log p(y) + g_ent · H``: ``g_lp (onehot(y) − p) − g_ent · p (z − (lse − H))`` (``Σ p·z = lse − H``)."""
    zf = _upcast(z)
    p = torch.exp(zf - lse[:, None])
    dz = torch.zeros_like(zf)
    if g_lp is not None:
        dz = dz - p * g_lp.to(zf.dtype)[:, None]
        dz = dz.scatter_add(-1, y.long()[:, None], g_lp.to(zf.dtype)[:, None])
    if g_ent is not None:
        dz = dz - g_ent.to(zf.dtype)[:, None] * p * (zf - (lse - ent)[:, None])
    return dz


class _FusedLabelLogProbsEntropy(torch.autograd.Function):
    """Forward and backward of :func:`fused_label_log_probs_entropy`; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens: int, with_entropy: bool):
        lps, lses, ents = [], [], []
        log_prob_chunk = _kernel(_chunk_log_probs, hidden.device)
        entropy_chunk = _kernel(_chunk_entropy, hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            z = F.linear(hidden[start:start + chunk_tokens], weight, bias)
            lp, lse = log_prob_chunk(z, labels[start:start + chunk_tokens, None])
            lps.append(lp)
            lses.append(lse)
            if with_entropy:
                ents.append(entropy_chunk(z))
            del z
        empty = hidden.new_zeros((0,), dtype=torch.promote_types(hidden.dtype, torch.float32))
        log_probs = torch.cat(lps) if lps else empty
        lse = torch.cat(lses) if lses else empty.clone()
        entropy = (torch.cat(ents) if ents else empty.clone()) if with_entropy else None
        ctx.chunk_tokens, ctx.with_entropy = chunk_tokens, with_entropy
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: its backward term is skipped
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)  # the weight's gradient summed over chunks in float32
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        n, grad_chunk = ctx.chunk_tokens, _kernel(_chunk_logits_grad, hidden.device)
        for start in range(0, hidden.shape[0], n):
            h = hidden[start:start + n]
            part = slice(start, start + n)
            z = F.linear(h, weight, bias)
            ent, g_e = (entropy[part], g_ent[part]) if ctx.with_entropy and g_ent is not None else (None, None)
            dz = grad_chunk(z, labels[part], lse[part], ent, None if g_lp is None else g_lp[part], g_e)
            del z
            dz_low = dz.to(weight.dtype)  # the unfused path's logits gradient is in the logits' dtype
            if need_h:
                grad_h[part] = dz_low @ weight
            if need_w:
                grad_w += (dz_low.t() @ h).to(acc)
            if need_b:
                grad_b += dz_low.to(acc).sum(dim=0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


def fused_label_log_probs_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                  chunk_tokens: int | None = None, with_entropy: bool = True,
                                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden (N, H), weight (V, H), labels (N,) int in [0, V), optional bias (V,) → float32 log p(label) (N,) and,
    if ``with_entropy``, float32 entropy (N,) (else None; both float64 for float64 inputs) of
    ``logits = hidden @ weight.T + bias``, equal to ``log_probs_from_logits`` / ``entropy_from_logits`` of those
    logits up to float32 rounding, without ever holding the (N, V) logits: ``chunk_tokens`` positions at a time
    (None: :func:`default_chunk_tokens`), the backward pass recomputing each chunk's logits. Differentiable in hidden,
    weight and bias."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ConfigError(f"fused_label_log_probs_entropy: hidden {tuple(hidden.shape)} and weight "
                          f"{tuple(weight.shape)} must be (N, H) and (V, H) with the same H; flatten the positions "
                          f"to N first")
    if labels.shape != hidden.shape[:1]:
        raise ConfigError(f"fused_label_log_probs_entropy: labels {tuple(labels.shape)} must be (N,) = "
                          f"({hidden.shape[0]},), one label per hidden state")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ConfigError(f"fused_label_log_probs_entropy: bias {tuple(bias.shape)} must be (V,) = "
                          f"({weight.shape[0]},), the output layer's bias")
    chunk = default_chunk_tokens(weight.shape[0]) if chunk_tokens is None else int(chunk_tokens)
    if chunk < 1:
        raise ConfigError(f"fused_label_log_probs_entropy: chunk_tokens is {chunk_tokens}; use a positive count")
    log_probs, entropy = _FusedLabelLogProbsEntropy.apply(hidden, weight, bias, labels, chunk, with_entropy)
    return log_probs, entropy


def fused_output_layer_log_probs_entropy(layer: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                                         chunk_tokens: int | None = None,
                                         with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`fused_label_log_probs_entropy` for an output layer module: a plain ``torch.nn.Linear`` (with or
    without bias; its weight may be tied to the input embedding). Any other module (a LoRA-wrapped or quantised
    layer, a logit scale or soft-capping after it) is refused, since its output is not ``hidden @ weight.T + b``."""
    if type(layer) is not torch.nn.Linear:
        raise ConfigError(f"the fused output layer needs a plain torch.nn.Linear output layer, got "
                          f"{type(layer).__name__}; turn the fused output layer off for this model")
    return fused_label_log_probs_entropy(hidden, layer.weight, labels, chunk_tokens, with_entropy, layer.bias)
