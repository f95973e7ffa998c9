"""§1.1–1.2, §1.8, §2.1, §4.6 primitives: golden conformance, hand cases, loop-vs-vectorised."""

import numpy as np
import pytest
import torch

from schemas.errors import ConfigError, InvariantError
from stages.losses import (approx_kl, entropy_from_logits, log_probs_from_logits, loss_normalisers, masked_mean,
                           masked_sum, op_compute_entropy, op_compute_log_probs, segment_masked_mean,
                           token_entropy, token_log_probs)
from stages.losses.primitives import check_same_shape, segment_ids
from tests.golden import assert_close, family, load, magnitude, mean_scale, softmax_scale, sum_scale
from tests.losses.reference import segment_mean_row

LOG_PROBS = family("roll.utils.functionals.{log_probs_from_logits,entropy_from_logits}")
MASKED_OPS = family("roll.utils.functionals.{masked_mean,masked_sum,masked_var,masked_whiten,masked_normalize,"
                    "response_level_masked_whiten}")
SEGMENT_MEAN = family("roll.pipeline.agentic.utils.compute_segment_masked_mean")
APPROX_KL = family("roll.utils.functionals.compute_approx_kl")


@pytest.mark.parametrize("name", LOG_PROBS)
def test_log_probs_and_entropy_golden(name):
    """Tolerance: a few float32 ulps of the log-sum-exp / largest logit of each position (the entropy cancels
    logsumexp(z) against Σ p·z, so its rounding error scales with them, and differs between CPU kernels)."""
    c = load(name)
    c.check_params(())
    logits, labels = torch.tensor(c.inputs["logits"]), torch.tensor(c.inputs["labels"])
    scale = softmax_scale(c.inputs["logits"])
    assert_close(log_probs_from_logits(logits, labels), c.outputs["log_probs"], scale=scale, what="log_probs")
    assert_close(entropy_from_logits(logits), c.outputs["entropy"], scale=scale, what="entropy")


def test_log_probs_upcast_half_logits():
    logits = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    assert log_probs_from_logits(logits, torch.zeros(2, 3, dtype=torch.long)).dtype == torch.float32
    assert entropy_from_logits(logits).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1 << 28, 3 * 50])  # one chunk; chunks of 3 positions (across rows too)
def test_log_probs_chunked_equal_log_softmax_gather(dtype, chunk, monkeypatch):
    """The lean log-prob (chunks of positions, own backward) against log_softmax + gather on a sliced (B, S-1, V)
    view: values and the gradient reaching the full logits, whose last position gets exactly 0. Tolerance: float32
    ulps of the log-sum-exp (values) and of the softmax (gradient; bf16 gradients: one bf16 ulp)."""
    from stages.losses import primitives

    monkeypatch.setattr(primitives, "CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    base = (torch.randn(3, 9, 50) * 4).to(dtype)
    labels, weights = torch.randint(0, 50, (3, 8)), torch.randn(3, 8)
    ours, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    lean = log_probs_from_logits(ours[:, :-1], labels)
    plain = torch.log_softmax(ref[:, :-1].float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    (lean * weights).sum().backward()
    (plain * weights).sum().backward()
    scale = float(torch.logsumexp(base.float(), -1).abs().max())
    assert_close(lean.detach(), plain.detach().numpy(), scale=scale, what="log_probs")
    grad_tol = 8 * torch.finfo(dtype).eps * float(weights.abs().max())
    assert torch.allclose(ours.grad.float(), ref.grad.float(), atol=grad_tol, rtol=0)
    assert ours.grad.dtype == dtype and bool((ours.grad[:, -1] == 0).all())
    with torch.inference_mode():
        assert_close(log_probs_from_logits(base[:, :-1], labels), plain.detach().numpy(), scale=scale)


def test_entropy_uniform_is_log_vocab():
    assert_close(entropy_from_logits(torch.zeros(1, 7)), [np.log(7)])


def test_op_compute_log_probs_shift_and_mask():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 4)
    ids = torch.tensor([[0, 1, 2, 3, 1], [3, 2, 1, 0, 0]])
    response_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])
    lp = op_compute_log_probs(logits, ids, response_mask)
    ent = op_compute_entropy(logits, response_mask)
    assert lp.shape == ent.shape == (2, 4)
    for b in range(2):
        for t in range(4):
            if response_mask[b, t + 1]:
                assert_close(lp[b, t], torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]])
                assert_close(ent[b, t], entropy_from_logits(logits[b, t]))
            else:
                assert lp[b, t] == 0 and ent[b, t] == 0


def test_token_log_probs_stream_in_chunks():
    torch.manual_seed(1)
    logits = torch.randn(3, 9, 6)
    ids = torch.randint(0, 6, (3, 9))
    response_mask = (torch.rand(3, 9) > 0.3).long()
    whole = op_compute_log_probs(logits, ids, response_mask)
    m = response_mask[:, 1:]
    chunks = [token_log_probs(logits[:, :-1][:, s:s + 3], ids[:, 1:][:, s:s + 3], m[:, s:s + 3]) for s in (0, 3, 6)]
    assert torch.equal(torch.cat(chunks, 1), whole)
    assert torch.equal(token_entropy(logits[:, :-1], m), op_compute_entropy(logits, response_mask))


@pytest.mark.parametrize("name", MASKED_OPS)
def test_masked_ops_golden(name):
    c = load(name)
    c.check_params(())
    xs, ms = c.inputs["values"], c.inputs["mask"]
    x, m = torch.tensor(xs), torch.tensor(ms)
    assert_close(masked_mean(x, m), c.outputs["masked_mean_all"], scale=mean_scale(xs, ms))
    assert_close(masked_mean(x, m, dim=-1), c.outputs["masked_mean_dim_-1"], scale=mean_scale(xs, ms, -1))
    assert_close(masked_sum(x, m), c.outputs["masked_sum_all"], scale=sum_scale(xs, ms))
    assert_close(masked_sum(x, m, dim=-1), c.outputs["masked_sum_dim_-1"], scale=sum_scale(xs, ms, -1))


def test_masked_mean_empty_row_is_zero():
    x = torch.tensor([[5.0, 7.0], [1.0, 3.0]])
    m = torch.tensor([[0, 0], [1, 1]])
    assert masked_mean(x, m, dim=-1).tolist() == [0.0, 2.0]
    assert float(masked_mean(x, torch.zeros_like(m))) == 0.0


@pytest.mark.parametrize("name", SEGMENT_MEAN)
def test_segment_masked_mean_golden(name):
    c = load(name)
    c.check_params(())
    assert_close(segment_masked_mean(torch.tensor(c.inputs["tensor"]), torch.tensor(c.inputs["mask"])),
                 c.outputs["result"], scale=magnitude(c.inputs["tensor"]))


@pytest.mark.parametrize("mask, expected", [
    ([1, 1, 1, 1], [2.5, 2.5, 2.5, 2.5]),           # one segment
    ([1, 1, 0, 1], [1.5, 1.5, 0.0, 4.0]),           # segment at the start and at the end
    ([0, 1, 1, 0], [0.0, 2.5, 2.5, 0.0]),           # segment in the middle
    ([1, 0, 1, 0], [1.0, 0.0, 3.0, 0.0]),           # one-token segments
    ([0, 0, 0, 0], [0.0, 0.0, 0.0, 0.0]),           # no segment
])
def test_segment_masked_mean_hand(mask, expected):
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert_close(segment_masked_mean(x, torch.tensor([mask])), [expected])


def test_segment_masked_mean_vectorised_equals_loop_and_never_crosses_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 13, generator=g, dtype=torch.float64)
    mask = (torch.rand(7, 13, generator=g) > 0.4).long()
    mask[:, -1] = 1
    mask[1:, 0] = 1                                  # a run ending a row and one starting the next stay apart
    loop = torch.stack([segment_mean_row(x[b], mask[b].tolist()) for b in range(7)])
    assert_close(segment_masked_mean(x, mask), loop, atol=1e-12)
    ids = segment_ids(mask)
    for b in range(6):
        assert ids[b, -1] != ids[b + 1, 0]


def test_segment_masked_mean_gradient_reaches_every_token_of_the_run():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    segment_masked_mean(x, torch.tensor([[1, 1, 0, 1]])).sum().backward()
    assert_close(x.grad, [[1.0, 1.0, 0.0, 1.0]], atol=1e-6)


def approx_kl_case(c):
    """(log_probs, log_probs_base, action_mask or None, kl_penalty, scale) of a compute_approx_kl case; the params'
    ``action_mask`` says whether the mask input is passed ("given") or not (null)."""
    p = c.check_params(("kl_penalty", "action_mask"))
    mask = p.get("action_mask", "given" if "action_mask" in c.inputs else None)
    assert mask in (None, "given"), f"{c.name}: action_mask param {mask!r}"
    if mask == "given":
        assert "action_mask" in c.inputs, f"{c.name}: action_mask given but not among the inputs"
    lp, lb = c.inputs["log_probs"], c.inputs["log_probs_base"]
    scale = np.maximum(np.maximum(np.abs(lp), np.abs(lb)), np.exp(np.minimum(lb - lp, 20.0)))  # k3: exp(lb − lp)
    return lp, lb, c.inputs["action_mask"] if mask == "given" else None, p["kl_penalty"], scale


@pytest.mark.parametrize("name", APPROX_KL)
def test_approx_kl_golden(name):
    c = load(name)
    lp, lb, mask, kl_penalty, scale = approx_kl_case(c)
    kl = approx_kl(torch.tensor(lp), torch.tensor(lb), None if mask is None else torch.tensor(mask), kl_penalty)
    assert_close(kl, c.outputs["kl"], scale=scale)


def test_approx_kl_hand_values():
    lp, lb = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert_close(approx_kl(lp, lb, kl_type="mse"), [0.5])
    assert_close(approx_kl(lp, lb, kl_type="k3"), [np.exp(-1.0) + 1.0 - 1.0])
    assert_close(approx_kl(torch.tensor([0.0]), torch.tensor([-50.0]), kl_type="k3"), [10.0])   # clamped


def test_approx_kl_full_is_exact_kl():
    p = torch.log_softmax(torch.tensor([[[0.3, -1.0, 2.0]]]), -1)
    q = torch.log_softmax(torch.tensor([[[1.0, 0.0, -0.5]]]), -1)
    exact = (p.exp() * (p - q)).sum()
    assert_close(approx_kl(p, q, kl_type="full"), [[float(exact)]])


def test_approx_kl_unknown_type():
    with pytest.raises(ConfigError, match="k3"):
        approx_kl(torch.zeros(1), torch.zeros(1), kl_type="k2")


def test_loss_normalisers_count_tokens_and_valid_rows_at_least_one():
    assert loss_normalisers(torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 0]])) == (3.0, 2.0)
    assert loss_normalisers(torch.zeros(2, 3)) == (1.0, 1.0)


def test_check_same_shape_names_the_tensor():
    with pytest.raises(InvariantError, match="'b'"):
        check_same_shape("here", a=torch.zeros(2, 3), b=torch.zeros(2, 4))
