"""Golden conformance of the actor losses (spec §6.3–6.5): every case of ROLL's agentic, base and RLVR loss_func,
loss, metrics and d loss / d logits.

* ``roll_compat=True`` reproduces ROLL on every case.
* An independent float64 reference (tests/losses/reference.py) in its ``roll`` mode reproduces ROLL on every agentic
  and RLVR case — which validates the reference, including its encoding of the defect conditions of §13.
* Our default (BUG-7/8/9 fixed) equals the reference's corrected mode on every case, and equals ROLL on every
  quantity where the two modes of the reference agree, i.e. where the case's params and inputs meet no defect
  condition. No list of case names: a defect case is whatever case the §13 conditions make differ.
"""

import dataclasses
from functools import cache

import numpy as np
import pytest
import torch

from stages.losses import (LossInputs, agentic_actor_loss, base_actor_loss, op_compute_entropy, op_compute_log_probs,
                           rlvr_actor_loss)
from tests.golden import assert_close, load
from tests.losses.golden_adapter import (cache_path, golden_metrics, kind_of, loss_cases, loss_config, loss_inputs,
                                         reference_args, run_loss)
from tests.losses.reference import reference_actor_loss

ALL = loss_cases()
WITH_REFERENCE = loss_cases("agentic", "rlvr")
LOSS_FN = {"agentic": agentic_actor_loss, "rlvr": rlvr_actor_loss, "base": base_actor_loss}
TOL = 1e-4            # golden README: losses and gradients
RATES = ("ppo_ratio_", "is_weight_clipfrac", "_mask_mean")   # token-mean fractions (actor/clipfrac follows the mode)


def run(name: str, **cfg_overrides):
    return run_case(load(name), **cfg_overrides)


def run_case(c, **cfg_overrides):
    cfg = loss_config(c, **cfg_overrides)
    inputs, logits = loss_inputs(c, cfg)
    return c, run_loss(LOSS_FN[kind_of(c)], inputs, cfg, logits)


@cache
def reference(name: str, roll: bool = False, **overrides):
    """The reference's (total, metrics, grad) for a golden case (params overridden by ``overrides``)."""
    c = load(name)
    inputs, params = reference_args(c)
    return reference_actor_loss(inputs, {**params, **overrides}, kind_of(c), roll=roll)


def _close(a, b) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return bool(np.all(np.abs(a - b) <= TOL + 1e-5 * np.abs(b)))


def defect_free(name: str) -> set[str]:
    """The quantities ('total_loss', 'grad_logits', metric names) on which no §13 defect condition holds for this case:
    the reference's ROLL and corrected modes agree on them. Every quantity for the base loss (no defect touches it)."""
    c = load(name)
    if kind_of(c) == "base":
        return {"total_loss", "grad_logits", *golden_metrics(c)}
    (rt, rm, rg), (ct, cm, cg) = reference(name, roll=True), reference(name)
    free = {k for k in rm if k in cm and _close(rm[k], cm[k])}
    return free | {k for k, a, b in (("total_loss", rt, ct), ("grad_logits", rg, cg)) if _close(a, b)}


def assert_matches(total, metrics, grad, exp_total, exp_metrics, exp_grad, only=None):
    if only is None or "total_loss" in only:
        assert_close(total, exp_total, atol=TOL, what="total_loss")
    if only is None or "grad_logits" in only:
        assert_close(grad, exp_grad, atol=TOL, what="grad_logits")
    for key, value in exp_metrics.items():
        if only is None or key in only:
            assert key in metrics, f"metric {key} missing"
            assert_close(metrics[key], value, atol=TOL, what=key)


@pytest.mark.parametrize("name", ALL)
def test_roll_compat_reproduces_roll(name):
    c, (total, metrics, grad) = run(name, roll_compat=True)
    assert_matches(total, metrics, grad, c.outputs["total_loss"], golden_metrics(c), c.outputs["grad_logits"])


@pytest.mark.parametrize("name", WITH_REFERENCE)
def test_reference_in_roll_mode_reproduces_roll(name):
    c = load(name)
    ref_total, ref_metrics, ref_grad = reference(name, roll=True)
    gm = golden_metrics(c)
    assert set(gm) <= set(ref_metrics), f"reference lacks {sorted(set(gm) - set(ref_metrics))}"
    assert_matches(ref_total, ref_metrics, ref_grad, c.outputs["total_loss"], gm, c.outputs["grad_logits"])


@pytest.mark.parametrize("name", WITH_REFERENCE)
def test_default_matches_corrected_reference(name):
    _, (total, metrics, grad) = run(name)
    assert_matches(total, metrics, grad, *reference(name))


@pytest.mark.parametrize("name", ALL)
def test_default_reproduces_roll_where_no_defect_applies(name):
    c, (total, metrics, grad) = run(name)
    assert_matches(total, metrics, grad, c.outputs["total_loss"], golden_metrics(c), c.outputs["grad_logits"],
                   only=defect_free(name))


@pytest.mark.parametrize("name", ALL)
def test_default_rates_are_fractions(name):
    """Clip fractions and filter pass rates count masked tokens only (BUG-7/9 fixed), so they lie in [0, 1]."""
    _, (_, metrics, _) = run(name)
    for key, value in metrics.items():
        if any(r in key for r in RATES):
            assert 0.0 <= value <= 1.0 + 1e-9, (key, value)


def _in_loss_filter(c) -> bool:
    """Recompute off (the correction runs inside the loss) with at least one enabled filter."""
    filters = (c.params.get("train_infer_correction") or {}).get("filters") or []
    return not c.params.get("enable_old_logprobs_recompute", False) and any(f.get("enabled") for f in filters)


@pytest.mark.parametrize("name", [n for n in WITH_REFERENCE if _in_loss_filter(load(n))])
def test_bug7_token_mean_with_in_loss_filter(name):
    """Any case with an in-loss filter, aggregated token-mean. Fixed: the filtered tokens leave the numerator
    (= corrected reference); ROLL (compat): they stay (= the reference's ROLL mode)."""
    _, (total, metrics, grad) = run(name, loss_agg_mode="token-mean")
    assert_matches(total, metrics, grad, *reference(name, loss_agg_mode="token-mean"))
    _, (compat_total, compat_metrics, compat_grad) = run(name, loss_agg_mode="token-mean", roll_compat=True)
    assert_matches(compat_total, compat_metrics, compat_grad, *reference(name, roll=True, loss_agg_mode="token-mean"))


@pytest.mark.parametrize("name", [n for n in loss_cases("rlvr")
                                  if load(n).params.get("difficulty_loss_weight") and "difficulty" in load(n).inputs])
def test_bug8_difficulty_weights_applied_and_compat_ignores_them(name):
    c = load(name)
    key = "actor/sample_weights_max@max"
    _, (_, metrics, _) = run(name)
    _, (_, compat_metrics, _) = run(name, roll_compat=True)
    _, (_, no_difficulty, _) = run(name, difficulty_loss_weight=False)
    assert_close(metrics[key], reference(name)[1][key])
    assert compat_metrics[key] == pytest.approx(no_difficulty[key])
    if np.ptp(np.asarray(c.inputs["difficulty"], dtype=float).clip(0, 1)) > 0:
        assert metrics[key] != pytest.approx(no_difficulty[key])


def _without_old_log_probs(c):
    """The case as ROLL's cache path sees it: recompute off and no old_log_probs (nor precomputed IS weight)."""
    inputs = {k: v for k, v in c.inputs.items() if k not in ("old_log_probs", "train_infer_is_weight")}
    return dataclasses.replace(c, name=f"{c.name}[no old_log_probs]", inputs=inputs,
                               params={**c.params, "enable_old_logprobs_recompute": False})


@pytest.mark.parametrize("name", [names[0] for names in map(loss_cases, ("agentic", "rlvr", "base")) if names])
def test_cache_path_when_a_case_has_no_old_log_probs(name):
    """A loss case without ``old_log_probs`` (spec §6.3 step 2): old = detach(current log-probs), so every ratio is 1
    and the gradient is that of −A·(log-prob) aggregated; default = corrected reference, compat = ROLL mode."""
    c = _without_old_log_probs(load(name))
    assert cache_path(c)
    _, (total, metrics, grad) = run_case(c)
    suffix = "" if kind_of(c) == "base" else "@sum"
    assert metrics[f"actor/ratio_mean{suffix}"] == pytest.approx(1.0)
    assert metrics[f"actor/approxkl{suffix}"] == 0.0 and metrics[f"actor/ppo_ratio_clipfrac{suffix}"] == 0.0
    if kind_of(c) == "base":
        return
    inputs, params = reference_args(c)
    assert_matches(total, metrics, grad, *reference_actor_loss(inputs, params, kind_of(c)))
    _, compat = run_case(c, roll_compat=True)
    assert_matches(*compat, *reference_actor_loss(inputs, params, kind_of(c), roll=True))


def has_defect(name: str) -> bool:
    """Some quantity on which the reference's ROLL and corrected modes differ for this case."""
    if kind_of(load(name)) == "base":
        return False
    return bool({"total_loss", "grad_logits", *reference(name, roll=True)[1]} - defect_free(name))


def _one_per_kind() -> list[str]:
    """Per kind: its first case, and its first case that meets a defect condition (if any)."""
    out = []
    for kind in ("agentic", "rlvr", "base"):
        names = loss_cases(kind)
        out += names[:1] + [n for n in names[1:] if has_defect(n)][:1]
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", _one_per_kind() if torch.cuda.is_available() else [])
def test_same_result_on_cuda(name):
    c = load(name)
    cfg = loss_config(c)
    cpu_inputs, cpu_logits = loss_inputs(c, cfg)
    cpu = run_loss(LOSS_FN[kind_of(c)], cpu_inputs, cfg, cpu_logits)
    logits = cpu_logits.detach().cuda().requires_grad_()
    inputs, _ = loss_inputs(c, cfg)
    moved = {f.name: getattr(inputs, f.name).cuda() if isinstance(getattr(inputs, f.name), torch.Tensor)
             else getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    rm = torch.tensor(c.inputs["response_mask"]).cuda()
    moved["log_probs"] = op_compute_log_probs(logits, torch.tensor(c.inputs["input_ids"]).cuda(), rm)
    if cfg.entropy_loss_coef > 0:
        moved["entropy"] = op_compute_entropy(logits, rm)
    total, metrics = LOSS_FN[kind_of(c)](LossInputs(**moved), cfg)
    total.backward()
    assert_matches(float(total.detach()), metrics, logits.grad.cpu().numpy(), *cpu)
