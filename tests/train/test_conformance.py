"""Golden conformance of the training path (spec §6.2): ROLL's actor-loss cases cut into token-budget micro-batches
by our batching, each micro-batch's loss computed by the training objective with the mini-batch's global counts;
the summed losses, the accumulated d loss / d logits and the additive metrics equal ROLL's whole-batch values.

Also: ROLL's log-prob / entropy ops through our padding (golden ``log_probs_and_entropy_from_logits``) and the
critic objective over micro-batches (golden ``critic_loss__value_clip0.2``)."""

import numpy as np
import pytest
import torch

from stages.algos.ragged import Ragged
from stages.losses import loss_normalisers
from stages.train.batching import MiniBatchPlan, TokenRows, pad_micro_batch, split_by_token_budget
from stages.train.objectives import ActorObjective, CriticObjective
from stages.train.step import combine_metrics
from tests.golden import assert_close, family, load, softmax_scale
from tests.losses.golden_adapter import (cache_path, final_mask, global_count, golden_metrics, kind_of, loss_cases,
                                         loss_config, recompute_on)

ACTOR_CASES = loss_cases()
LOG_PROBS = family("roll.utils.functionals.{log_probs_from_logits,entropy_from_logits}")
CRITIC = family("roll.pipeline.base_worker.CriticWorker.loss_func")


def per_micro_batch(case) -> bool:
    """RLVR's length weights are min-max normalised per micro-batch (spec §6.5, as ROLL does): split-invariant only
    unsplit. (Difficulty weights are per row; compat, used here, does not apply them anyway [BUG-8].)"""
    return kind_of(case) == "rlvr" and bool(case.params.get("length_loss_weight"))


def golden_rows(case, names: tuple[str, ...]) -> TokenRows:
    """A padded golden batch as ragged rows of full length S (next-token columns S-1)."""
    i = case.inputs
    batch, width = i["response_mask"].shape
    ids = i.get("input_ids", np.zeros((batch, width), dtype=np.int64))
    full = lambda a: Ragged.from_padded(np.asarray(a), np.full(batch, width))  # noqa: E731
    nxt = lambda a: Ragged.from_padded(np.asarray(a, dtype=np.float32), np.full(batch, width - 1))  # noqa: E731
    return TokenRows(full(ids.astype(np.int64)), full(i["response_mask"].astype(np.int64)),
                     {n: nxt(i[n]) for n in names if n in i})


def run_in_micro_batches(name: str, rows_per_micro_batch: int):
    case = load(name)
    i = case.inputs
    cfg = loss_config(case, roll_compat=True)
    final = final_mask(case) if kind_of(case) == "rlvr" else None
    columns = [] if cache_path(case) else ["old_log_probs"]      # no column: the objective's cache path
    columns += ["ref_log_probs", "infer_logprobs", "advantages"]
    columns += ["train_infer_is_weight"] if recompute_on(case) else []
    columns += [] if final is None else ["final_response_mask"]
    rows = golden_rows(case, tuple(columns))
    batch, width = i["input_ids"].shape
    # the mini-batch's global counts (spec §6.2): the case's, else counted on its whole response mask
    local_tokens, local_seqs = loss_normalisers(torch.tensor(i["response_mask"][:, 1:]))
    num_tokens, num_seqs = global_count(case, "batch_num_tokens"), global_count(case, "global_valid_samples")
    plan = MiniBatchPlan((), local_tokens if num_tokens is None else num_tokens,
                         local_seqs if num_seqs is None else num_seqs, float(batch),
                         None if final is None else max(float(final.sum()), 1.0),
                         None if final is None else max(float((final.sum(-1) > 0).sum()), 1.0))
    objective = ActorObjective(kind_of(case), cfg, entropy_metric=False)
    logits = torch.tensor(i["logits"], requires_grad=True)
    groups = split_by_token_budget(rows.lengths, width * rows_per_micro_batch)
    total, metrics = 0.0, []
    for index in groups:
        mb = pad_micro_batch(rows, index)
        loss, m = objective(logits[torch.from_numpy(index)], mb, index, plan)
        loss.backward()
        total += float(loss.detach())
        metrics.append(m)
    return case, total, combine_metrics([[metrics]])[0], logits.grad.numpy(), len(groups)


@pytest.mark.parametrize("name", ACTOR_CASES)
def test_actor_loss_over_micro_batches_equals_roll(name):
    whole = per_micro_batch(load(name))
    per_mb = load(name).inputs["input_ids"].shape[0] if whole else 3
    case, total, metrics, grad, count = run_in_micro_batches(name, per_mb)
    assert count > 1 or whole or load(name).inputs["input_ids"].shape[0] <= 3
    assert_close(total, float(case.outputs["total_loss"]), atol=1e-4, what="total_loss")
    assert_close(grad, case.outputs["grad_logits"], atol=1e-4, what="grad_logits")
    # metrics that add up over micro-batches (ROLL's @sum/@max/@min); the base loss's plain means do not
    additive = {k: v for k, v in golden_metrics(case).items() if k.rpartition("@")[2] in ("sum", "max", "min")}
    assert additive or kind_of(case) == "base", "the case has metrics to compare"
    for key, value in additive.items():
        assert_close(metrics[key.partition("@")[0]], value, atol=1e-4, what=key)


@pytest.mark.parametrize("name", ACTOR_CASES)
def test_actor_metrics_of_one_micro_batch_equal_roll(name):
    case, total, metrics, grad, count = run_in_micro_batches(name, load(name).inputs["input_ids"].shape[0])
    assert count == 1
    assert_close(total, float(case.outputs["total_loss"]), atol=1e-4, what="total_loss")
    for key, value in golden_metrics(case).items():
        assert_close(metrics[key.partition("@")[0]], value, atol=1e-4, what=key)


def _split_sensitive(name: str) -> bool:
    """An agentic case whose loss depends on the normalisers: seq-mean-token-mean, behaviour log-probs given."""
    c = load(name)
    return (kind_of(c) == "agentic" and c.params.get("loss_agg_mode", "seq-mean-token-mean") == "seq-mean-token-mean"
            and not cache_path(c) and "batch_num_tokens" in c.inputs)


@pytest.mark.parametrize("name", [n for n in loss_cases("agentic") if _split_sensitive(n)][:1])
def test_the_split_really_changes_the_micro_batch_counts(name):
    """The global normalisers matter: with each micro-batch's own counts the split loss differs from ROLL's."""
    case = load(name)
    rows = golden_rows(case, ("old_log_probs", "ref_log_probs", "advantages"))
    objective = ActorObjective("agentic", loss_config(case, roll_compat=True), entropy_metric=False)
    logits = torch.tensor(case.inputs["logits"])
    total = 0.0
    for index in split_by_token_budget(rows.lengths, rows.lengths[0] * 3):
        mb = pad_micro_batch(rows, index)
        local = MiniBatchPlan((), float(mb.loss_mask.sum()), float((mb.loss_mask.sum(-1) > 0).sum()), 3.0)
        total += float(objective(logits[torch.from_numpy(index)], mb, index, local)[0])
    assert abs(total - float(case.outputs["total_loss"])) > 1e-3


@pytest.mark.parametrize("name", LOG_PROBS)
def test_log_probs_and_entropy_through_padding_match_roll(name):
    """Golden log_softmax-gather and entropy, via the padded micro-batch path: rows of different lengths padded
    together give the same values at every real position (tolerance: float32 ulps of each position's log-sum-exp)."""
    from stages.losses import entropy_from_logits, log_probs_from_logits

    case = load(name)
    case.check_params(())
    logits, labels = case.inputs["logits"], case.inputs["labels"]
    batch, width, vocab = logits.shape
    lengths = np.array([[width, width - 2, width - 1, 3][b % 4] for b in range(batch)]).clip(1, width)
    padded = np.zeros_like(logits)
    for b, n in enumerate(lengths):
        padded[b, :n] = logits[b, :n]
    lp = log_probs_from_logits(torch.tensor(padded), torch.tensor(labels)).numpy()
    ent = entropy_from_logits(torch.tensor(padded)).numpy()
    scale = softmax_scale(logits)
    for b, n in enumerate(lengths):
        assert_close(lp[b, :n], case.outputs["log_probs"][b, :n], scale=scale[b, :n], what="log_probs")
        assert_close(ent[b, :n], case.outputs["entropy"][b, :n], scale=scale[b, :n], what="entropy")


@pytest.mark.parametrize("name", CRITIC)
def test_critic_objective_over_micro_batches_equals_roll(name):
    """ROLL's ½·mean over rows of per-row masked means, as micro-batches weighted by their share of rows."""
    case = load(name)
    case.check_params(("value_clip",))
    i = case.inputs
    batch, width, _ = i["output_tensor"].shape
    rows = golden_rows(case, ("values", "returns"))
    output = torch.tensor(i["output_tensor"], requires_grad=True)
    plan = MiniBatchPlan((), 1.0, 1.0, float(batch))
    objective = CriticObjective(value_clip=case.params.get("value_clip"))
    total, metrics = 0.0, []
    groups = split_by_token_budget(rows.lengths, width * max(1, (batch + 2) // 3))
    assert len(groups) > 1 or batch == 1
    for index in groups:
        mb = pad_micro_batch(rows, index)
        loss, m = objective(output[torch.from_numpy(index)], mb, index, plan)
        loss.backward()
        total += float(loss.detach())
        metrics.append(m)
    merged = combine_metrics([[metrics]])[0]
    assert_close(total, float(case.outputs["vf_loss"]), atol=1e-4, what="vf_loss")
    assert_close(output.grad.numpy(), case.outputs["grad_output"], atol=1e-4, what="grad_output")
    for key, value in golden_metrics(case).items():
        assert_close(merged[key], value, atol=1e-4, what=key)
