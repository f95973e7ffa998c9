"""Gradient-free forward passes (no Ray): token-budget batches with padding give each row what an unpadded forward
of that row alone gives; results come back ragged (L - 1 per row) in input order."""

import numpy as np
import pytest
import torch

from stages.losses import entropy_from_logits, log_probs_from_logits
from stages.train.batching import TokenRows
from stages.train.forward import forward_rows, load_forward_model
from stages.train.models import load_actor_model, load_critic_model
from tests.train.tables import advantaged_rows


@pytest.fixture(scope="module")
def rows():
    return TokenRows.from_arrow(advantaged_rows(7, lengths=(5, 33), seed=4, multi_turn=True, empty_row=True), "t",
                                columns=())


def one_row_reference(model, rows: TokenRows, b: int):
    """Log-probs and entropy of row b alone (no padding), masked by response_mask[1:] (spec §1.8)."""
    ids = torch.from_numpy(rows.input_ids.row(b)).unsqueeze(0)
    mask = torch.from_numpy(rows.response_mask.row(b))[1:].float()
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    return (log_probs_from_logits(logits, ids[0, 1:]) * mask).numpy(), (entropy_from_logits(logits) * mask).numpy()


@pytest.mark.parametrize("budget", [40, 100000])
def test_log_probs_and_entropy_equal_one_row_at_a_time(tiny_model, rows, budget):
    model = load_actor_model(str(tiny_model)).eval()
    result = forward_rows(model, rows, budget, entropy=True)
    assert result.micro_batches == (1 if budget > 1000 else result.micro_batches) and result.micro_batches >= 1
    lp, ent = result.columns["log_probs"], result.columns["entropy"]
    assert (lp.lengths == rows.lengths - 1).all() and (ent.lengths == rows.lengths - 1).all()
    for b in range(rows.num_rows):
        want_lp, want_ent = one_row_reference(model, rows, b)
        np.testing.assert_allclose(lp.row(b), want_lp, atol=2e-5)
        np.testing.assert_allclose(ent.row(b), want_ent, atol=2e-5)
    assert not lp.row(rows.num_rows - 1).any()  # the row without response tokens: all zero
    assert result.tokens == rows.lengths.sum() and result.padded_tokens >= result.tokens


def test_small_budget_makes_several_micro_batches_with_the_same_result(tiny_model, rows):
    model = load_actor_model(str(tiny_model)).eval()
    small, large = forward_rows(model, rows, 40), forward_rows(model, rows, 100000)
    assert small.micro_batches > 1 and large.micro_batches == 1
    np.testing.assert_allclose(small.columns["log_probs"].values, large.columns["log_probs"].values, atol=2e-5)


def test_values_are_the_critics_raw_outputs_at_every_position(tiny_model, rows):
    critic = load_critic_model(None, str(tiny_model), seed=5).eval()
    values = forward_rows(critic, rows, 64, kind="values").columns["values"]
    for b in range(rows.num_rows):
        ids = torch.from_numpy(rows.input_ids.row(b)).unsqueeze(0)
        with torch.no_grad():
            want = critic(input_ids=ids).logits[0, :-1, 0].numpy()
        np.testing.assert_allclose(values.row(b), want, atol=2e-5)
    seeded = load_forward_model(str(tiny_model), "values", actor_dir=str(tiny_model), seed=5)
    np.testing.assert_allclose(forward_rows(seeded, rows, 64, kind="values").columns["values"].values,
                               values.values, atol=1e-6)


def test_bf16_forward_is_close_to_fp32(tiny_model, rows):
    fp32 = forward_rows(load_forward_model(str(tiny_model), "log_probs"), rows, 256).columns["log_probs"]
    bf16 = forward_rows(load_forward_model(str(tiny_model), "log_probs", "bf16"), rows, 256).columns["log_probs"]
    assert bf16.values.dtype == np.float32
    np.testing.assert_allclose(bf16.values, fp32.values, atol=0.1)


def test_no_rows(tiny_model):
    empty = TokenRows.from_arrow(advantaged_rows(3).slice(0, 0), "t", columns=())
    result = forward_rows(load_actor_model(str(tiny_model)).eval(), empty, 64)
    assert result.columns["log_probs"].num_rows == 0


@pytest.mark.parametrize("budget", [40, 100000])
def test_packed_micro_batches_equal_the_padded_path(tiny_model, rows, budget):
    """Rows packed into one row without padding (positions restarting per row, so each attends to itself only)
    give the padded path's log-probs, entropies and values within float32 rounding, in fewer padded tokens."""
    model = load_actor_model(str(tiny_model)).eval()
    padded = forward_rows(model, rows, budget, entropy=True)
    packed = forward_rows(model, rows, budget, entropy=True, packed=True)
    for name in ("log_probs", "entropy"):
        assert (packed.columns[name].offsets == padded.columns[name].offsets).all()
        np.testing.assert_allclose(packed.columns[name].values, padded.columns[name].values, atol=2e-5)
    assert packed.tokens == padded.tokens == packed.padded_tokens == rows.lengths.sum()
    critic = load_critic_model(None, str(tiny_model), seed=5).eval()
    np.testing.assert_allclose(forward_rows(critic, rows, budget, kind="values", packed=True).columns["values"].values,
                               forward_rows(critic, rows, budget, kind="values").columns["values"].values, atol=2e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_the_output_layer_runs_at_the_loss_positions_only(tiny_model, rows, packed):
    """The vocabulary projection sees exactly the hidden states whose next token is a response token, padded or
    packed: not every position, nor the union of the rows' loss positions. The log-probs still equal a forward of each
    row alone with every position projected (test above)."""
    model = load_actor_model(str(tiny_model)).eval()
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    try:
        result = forward_rows(model, rows, 100000, packed=packed)
    finally:
        hook.remove()
    union = set()
    for b in range(rows.num_rows):
        union |= set(np.flatnonzero(rows.response_mask.row(b)[1:]).tolist())
    loss_tokens = int(rows.loss_tokens().sum())
    assert seen == [(loss_tokens, model.config.hidden_size)]  # one micro-batch
    assert loss_tokens < rows.num_rows * len(union)  # fewer than Hugging Face's logits_to_keep would project
    for b in range(rows.num_rows):
        np.testing.assert_allclose(result.columns["log_probs"].row(b), one_row_reference(model, rows, b)[0],
                                   atol=2e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_fused_output_layer_equals_the_logits_path(tiny_model, rows, packed):
    """fused: the output layer fused with the reduction (TokenHidden) gives the log-probs and entropy of the logits
    path, here bit-identical (float32 on CPU, every micro-batch in one chunk: the same matmul rows and the same
    reduction), and the output layer itself is handed no position (no (N, V) logits are formed)."""
    model = load_actor_model(str(tiny_model)).eval()
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    try:
        fused = forward_rows(model, rows, 40, entropy=True, packed=packed, fused=True)
    finally:
        hook.remove()
    plain = forward_rows(model, rows, 40, entropy=True, packed=packed)
    assert seen and all(0 in shape for shape in seen)
    for name in ("log_probs", "entropy"):
        assert (fused.columns[name].offsets == plain.columns[name].offsets).all()
        np.testing.assert_array_equal(fused.columns[name].values, plain.columns[name].values)
