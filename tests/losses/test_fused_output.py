"""The fused output layer → label log-prob and entropy (stages/losses/fused_output.py) against the unfused path:
``F.linear`` → ``log_probs_from_logits`` / ``entropy_from_logits`` (spec §1.8). Tiny shapes, CPU only."""

import pytest
import torch
import torch.nn.functional as F

from schemas.errors import ConfigError
from stages.losses import entropy_from_logits, log_probs_from_logits
from stages.losses.fused_output import fused_label_log_probs_entropy, fused_output_layer_log_probs_entropy

N, H, V = 13, 8, 37  # 13 positions: chunks of 4 leave a ragged last chunk of 1


def _inputs(dtype=torch.float32, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, H, generator=g) * 2).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    return hidden, weight, b, torch.randint(0, V, (N,), generator=g)


def _unfused(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias)
    return log_probs_from_logits(logits, labels), entropy_from_logits(logits)


def _grad_tol(hidden, weight, w_lp, w_ent, logit_scale):
    """8 float32 ulps of the largest float32 intermediate of a gradient entry: the logits' gradient carries an error
    of ulps of (|g_lp| + |g_ent|·max|z|) per entry (the entropy term is p·(z − Σp·z)), and one gradient entry sums N
    or V of those times the other operand (hidden for the weight, weight for hidden)."""
    dz = 2 * float((w_lp.abs() + w_ent.abs() * logit_scale).max())
    other = max(float(hidden.detach().abs().sum(0).max()), float(weight.detach().abs().sum(0).max()), 1.0)
    return 8 * torch.finfo(torch.float32).eps * dz * other


def _grads(fn, hidden, weight, bias, labels, w_lp, w_ent):
    lp, ent = fn(hidden, weight, bias, labels)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    out = [hidden.grad, weight.grad] + ([bias.grad] if bias is not None else [])
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    return lp.detach(), ent.detach(), out


@pytest.mark.parametrize("chunk", [1, 4, N, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_gradients_equal_the_unfused_path(chunk, bias):
    """float32, any chunking (one position, ragged chunks, one chunk, more than N). Tolerance: values 8 float32 ulps
    of the largest |logit| (both sides upcast the same float32 logits and reduce them with the same expressions, only
    the matmul's blocking can differ with the chunk's row count); gradients 8 ulps of the largest Σ|dz|·|other
    operand| (:func:`_grad_tol`; the fused side forms dz analytically, the unfused side through autograd of
    softmax/logsumexp). Measured: values within 16 float32 eps (logits up to 24), gradients within 260 eps."""
    hidden, weight, b, labels = _inputs(bias=bias)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def fused(h, w, bb, y):
        return fused_label_log_probs_entropy(h, w, y, chunk_tokens=chunk, with_entropy=True, bias=bb)

    lp, ent, grads = _grads(fused, hidden, weight, b, labels, w_lp, w_ent)
    lp_ref, ent_ref, grads_ref = _grads(_unfused, hidden, weight, b, labels, w_lp, w_ent)
    eps = torch.finfo(torch.float32).eps
    scale = float(F.linear(hidden, weight, b).detach().abs().max())
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, atol=8 * eps * scale, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=8 * eps * scale, rtol=0)
    grad_tol = _grad_tol(hidden, weight, w_lp, w_ent, scale)
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, grads_ref):
        torch.testing.assert_close(got, ref, atol=grad_tol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_forward_bit_identical_to_unfused_in_one_chunk():
    """One chunk holding every position: the same float32 logits go through the same expressions, so the values are
    bit-identical (no tolerance)."""
    hidden, weight, _, labels = _inputs()
    with torch.no_grad():
        lp, ent = fused_label_log_probs_entropy(hidden, weight, labels, chunk_tokens=N)
        lp_ref, ent_ref = _unfused(hidden, weight, None, labels)
    assert torch.equal(lp, lp_ref) and torch.equal(ent, ent_ref)


@pytest.mark.parametrize("chunk", [1, 4, N])
def test_bfloat16_as_on_a_gpu(chunk):
    """bf16 hidden states and weight (the GPU training dtype): each chunk's bf16 logits are the unfused path's rows,
    upcast and reduced alike, so the values are bit-identical; the gradients (the logits' gradient rounded to bf16 on
    both sides, then a matmul) agree within 2 bf16 ulps of the largest entry (measured: 1.25)."""
    hidden, weight, _, labels = _inputs(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def fused(h, w, bb, y):
        return fused_label_log_probs_entropy(h, w, y, chunk_tokens=chunk, bias=bb)

    lp, ent, grads = _grads(fused, hidden, weight, None, labels, w_lp, w_ent)
    lp_ref, ent_ref, grads_ref = _grads(_unfused, hidden, weight, None, labels, w_lp, w_ent)
    assert torch.equal(lp, lp_ref) and torch.equal(ent, ent_ref)
    for got, ref in zip(grads, grads_ref):
        assert got.dtype == torch.bfloat16
        tol = 2 * torch.finfo(torch.bfloat16).eps * float(ref.float().abs().max())
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_gradcheck_float64(with_entropy):
    """torch.autograd.gradcheck (finite differences, float64) for hidden, weight and bias, entropy included."""
    hidden, weight, b, labels = _inputs(torch.float64, bias=True)

    def fn(h, w, bb):
        lp, ent = fused_label_log_probs_entropy(h, w, labels, chunk_tokens=4, with_entropy=with_entropy, bias=bb)
        return (lp, ent) if with_entropy else lp

    assert (fused_label_log_probs_entropy(hidden, weight, labels, with_entropy=with_entropy)[1] is None) \
        == (not with_entropy)
    assert torch.autograd.gradcheck(fn, (hidden, weight, b), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_entropy_gradient_alone_equals_the_unfused_path():
    """Only the entropy feeds the loss (the log-prob's incoming gradient is zero): the entropy term of the backward
    alone must match. Tolerance as in the float32 comparison above."""
    hidden, weight, _, labels = _inputs(seed=3)
    _, ent = fused_label_log_probs_entropy(hidden, weight, labels, chunk_tokens=4)
    gh, gw = torch.autograd.grad(ent.sum(), (hidden, weight))
    ref_h, ref_w = torch.autograd.grad(entropy_from_logits(F.linear(hidden, weight)).sum(), (hidden, weight))
    tol = _grad_tol(hidden, weight, torch.zeros(N), torch.ones(N), float(F.linear(hidden, weight).detach().abs().max()))
    torch.testing.assert_close(gh, ref_h, atol=tol, rtol=0)
    torch.testing.assert_close(gw, ref_w, atol=tol, rtol=0)


def test_tied_embedding_gradients_accumulate_into_the_one_parameter():
    """SmolLM2 ties the output layer's weight to the input embedding: the gradient through the lookup and through the
    fused output layer add up in the same parameter, as with the unfused path."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(V, H)
    head = torch.nn.Linear(H, V, bias=False)
    head.weight = embed.weight
    ids = torch.randint(0, V, (N + 1,))

    def loss(fused: bool):
        hidden = torch.tanh(embed(ids[:-1]))
        if fused:
            lp, ent = fused_output_layer_log_probs_entropy(head, hidden, ids[1:], chunk_tokens=4)
        else:
            lp, ent = _unfused(hidden, head.weight, None, ids[1:])
        return -(lp.sum() + 0.1 * ent.sum())

    loss(True).backward()
    fused_grad = embed.weight.grad.clone()
    embed.weight.grad = None
    loss(False).backward()
    assert head.weight is embed.weight
    assert float((fused_grad - embed.weight.grad).abs().max()) < 1e-5
    only_head = embed.weight.grad.clone()
    embed.weight.grad = None
    hidden = torch.tanh(embed(ids[:-1])).detach()  # the lookup's share removed: the gradient must differ
    fused_output_layer_log_probs_entropy(head, hidden, ids[1:], chunk_tokens=4)[0].sum().neg().backward()
    assert float((only_head - embed.weight.grad).abs().max()) > 1e-3


def test_saved_tensors_hold_no_position_by_vocabulary_tensor():
    """Memory without wall-clock: every tensor autograd saves for the backward pass, recorded through
    saved_tensors_hooks. The unfused path saves the (N, V) logits; the fused one only (N, H), (V, H) and (N,)
    tensors, and its forward keeps at most chunk_tokens × V logits alive at once."""
    hidden, weight, _, labels = _inputs()

    def saved_numels(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, ent = fn()
            (lp.sum() + ent.sum()).backward()
        return sizes

    fused = saved_numels(lambda: fused_label_log_probs_entropy(hidden, weight, labels, chunk_tokens=4))
    unfused = saved_numels(lambda: _unfused(hidden, weight, None, labels))
    assert max(unfused) >= N * V  # the check sees the logits where they are kept
    assert fused and max(fused) <= max(N * H, V * H, N)


def test_refuses_wrong_shapes_and_modules():
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ConfigError, match="same H"):
        fused_label_log_probs_entropy(hidden, weight[:, :-1], labels)
    with pytest.raises(ConfigError, match="one label per hidden state"):
        fused_label_log_probs_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ConfigError, match="positive count"):
        fused_label_log_probs_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ConfigError, match="plain torch.nn.Linear"):
        fused_output_layer_log_probs_entropy(torch.nn.Sequential(torch.nn.Linear(H, V)), hidden, labels)


def test_no_positions():
    hidden, weight, _, _ = _inputs()
    lp, ent = fused_label_log_probs_entropy(hidden[:0], weight, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert float(weight.grad.abs().sum()) == 0.0
