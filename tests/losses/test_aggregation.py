"""§6.1 agg_loss: golden conformance (ROLL with compat, the corrected reference by default: BUG-7 wherever a case puts
non-zero losses off the mask in token-mean), Q-14 constant, weights, bad mode."""

import numpy as np
import pytest
import torch

from schemas.errors import ConfigError
from stages.losses import LOSS_AGG_MODES, agg_loss
from tests.golden import assert_close, family, load
from tests.losses.reference import F64, aggregate

AGG_LOSS = family("roll.utils.functionals.agg_loss")
# params "variant" names what the inputs hold; each is checked against the inputs below
VARIANTS = ("defaults", "weights", "unmasked_lossmat", "global_counts")


def agg_case(c):
    """(loss_mat, loss_mask, mode, batch_num_tokens, global_valid_samples, weights) of a golden agg_loss case."""
    p = c.check_params(("loss_agg_mode", "variant", "batch_num_tokens", "global_valid_samples"))
    loss_mat, mask, w = c.inputs["loss_mat"], c.inputs["loss_mask"], c.inputs.get("weights")
    variant = p.get("variant", "defaults")
    assert variant in VARIANTS, f"{c.name}: unknown variant {variant!r}; known {VARIANTS}"
    assert (w is not None) == (variant == "weights"), f"{c.name}: variant {variant!r} vs weights input"
    if variant == "unmasked_lossmat":
        assert np.any(loss_mat * (1 - mask) != 0), f"{c.name}: variant unmasked_lossmat but the loss is masked"
    if variant == "global_counts":
        assert p.get("batch_num_tokens") is not None or p.get("global_valid_samples") is not None
    return loss_mat, mask, p["loss_agg_mode"], p.get("batch_num_tokens"), p.get("global_valid_samples"), w


def reference_agg(loss_mat, mask, mode, n_tok, n_seq, w, roll: bool) -> float:
    """§6.1 from tests/losses/reference.py: ``roll`` = ROLL's unmasked token-mean numerator [BUG-7]; the defaults
    N_tok = Σ mask, N_seq = B."""
    rows = [torch.tensor(r, dtype=F64) for r in np.asarray(loss_mat, dtype=np.float64)]
    masks = np.asarray(mask).astype(int).tolist()
    n_tok = float(np.sum(mask)) if n_tok is None else float(n_tok)
    n_seq = float(len(masks)) if n_seq is None else float(n_seq)
    return float(aggregate(rows, masks, mode, n_tok, n_seq, None if w is None else list(map(float, w)), roll=roll))


@pytest.mark.parametrize("name", AGG_LOSS)
@pytest.mark.parametrize("roll_compat", [True, False])
def test_agg_loss_golden(name, roll_compat):
    """compat = ROLL; default = the corrected reference (which equals ROLL unless token-mean meets losses off the mask);
    the reference's ROLL mode reproduces the golden value too."""
    c = load(name)
    loss_mat, mask, mode, n_tok, n_seq, w = agg_case(c)
    out = agg_loss(torch.tensor(loss_mat), torch.tensor(mask), mode, n_tok, n_seq,
                   None if w is None else torch.tensor(w), roll_compat=roll_compat)
    assert_close(reference_agg(loss_mat, mask, mode, n_tok, n_seq, w, roll=True), c.outputs["loss"], atol=1e-4,
                 what="reference (ROLL mode)")
    expected = c.outputs["loss"] if roll_compat else reference_agg(loss_mat, mask, mode, n_tok, n_seq, w, roll=False)
    assert_close(out, expected, atol=1e-4)


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
