"""§6.1 agg_loss: golden conformance, BUG-7 fixed with compat, Q-14 constant, weights, bad mode."""

import pytest
import torch

from schemas.errors import ConfigError
from stages.losses import LOSS_AGG_MODES, agg_loss
from tests.golden import assert_close, case_names, load


@pytest.mark.parametrize("name", case_names("agg_loss__"))
@pytest.mark.parametrize("roll_compat", [True, False])
def test_agg_loss_golden(name, roll_compat):
    """No golden agg_loss case puts non-zero losses off the mask in token-mean, so both modes agree with ROLL."""
    c = load(name)
    w = c.inputs.get("weights")
    out = agg_loss(torch.tensor(c.inputs["loss_mat"]), torch.tensor(c.inputs["loss_mask"]),
                   c.params["loss_agg_mode"], c.params["batch_num_tokens"], c.params["global_valid_samples"],
                   None if w is None else torch.tensor(w), roll_compat=roll_compat)
    assert_close(out, c.outputs["loss"], atol=1e-4)


LOSS = torch.tensor([[1.0, 2.0, 9.0], [4.0, 8.0, 16.0], [5.0, 5.0, 5.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


def test_token_mean_bug7_fixed_and_compat():
    # fixed: only masked entries (1 + 2 + 4) over 3 tokens; ROLL sums the whole matrix [BUG-7]
    assert_close(agg_loss(LOSS, MASK, "token-mean"), 7.0 / 3)
    assert_close(agg_loss(LOSS, MASK, "token-mean", roll_compat=True), float(LOSS.sum()) / 3)


def test_seq_modes_hand_values():
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum"), (3.0 + 4.0) / (3 + 1e-8))       # N_seq = B = 3
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-mean", num_seqs=2), (1.5 + 4.0) / 2)
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm"), (3.0 + 4.0) / 3)          # T = 3
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", sum_norm_constant=10), 0.7)


def test_sum_norm_depends_on_padding_unless_constant():
    padded_loss = torch.cat([LOSS, torch.zeros(3, 2)], 1)
    padded_mask = torch.cat([MASK, torch.zeros(3, 2, dtype=MASK.dtype)], 1)
    assert float(agg_loss(padded_loss, padded_mask, "seq-mean-token-sum-norm")) != \
        pytest.approx(float(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm")))
    assert_close(agg_loss(padded_loss, padded_mask, "seq-mean-token-sum-norm", sum_norm_constant=8),
                 agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", sum_norm_constant=8))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_weights_scale_rows(mode):
    w = torch.tensor([2.0, 0.5, 3.0])
    scaled = LOSS * w.unsqueeze(-1)
    assert_close(agg_loss(LOSS, MASK, mode, weights=w), agg_loss(scaled, MASK, mode))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_global_counts_make_microbatches_add_up(mode):
    n_tok, n_seq = float(MASK.sum()), 2.0
    whole = agg_loss(LOSS, MASK, mode, n_tok, n_seq, sum_norm_constant=5)
    parts = sum(agg_loss(LOSS[rows], MASK[rows], mode, n_tok, n_seq, sum_norm_constant=5)
                for rows in (slice(0, 1), slice(1, 3)))
    assert_close(parts, whole)


def test_unknown_mode():
    with pytest.raises(ConfigError, match="seq-mean-token-mean"):
        agg_loss(LOSS, MASK, "token-sum")
