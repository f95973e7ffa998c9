"""Golden conformance of the training path (spec §6.2): ROLL's actor-loss cases cut into token-budget micro-batches
by our batching, each micro-batch's loss computed by the training objective with the mini-batch's global counts;
the summed losses, the accumulated d loss / d logits and the additive metrics equal ROLL's whole-batch values.

Also: ROLL's log-prob / entropy ops through our padding (golden ``log_probs_and_entropy_from_logits``) and the
critic objective over micro-batches (golden ``critic_loss__value_clip0.2``)."""

import numpy as np
import pytest
import torch

from stages.algos.ragged import Ragged
from stages.train.batching import MiniBatchPlan, TokenRows, pad_micro_batch, split_by_token_budget
from stages.train.core import ActorObjective, CriticObjective, combine_metrics
from tests.golden import assert_close, case_names, load
from tests.losses.golden_adapter import golden_metrics, loss_config, recompute_on

ACTOR_CASES = case_names("agentic_loss__") + case_names("base_actor_loss__") + case_names("rlvr_loss__")
# RLVR's sample weights are normalised per micro-batch (spec §6.5, as ROLL does): split-invariant only unsplit.
PER_MICRO_BATCH = {n for n in ACTOR_CASES if "weights" in n}


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
    kind = name.split("_")[0]
    cfg = loss_config(case, roll_compat=True)
    columns = ["old_log_probs", "ref_log_probs", "infer_logprobs", "advantages"]
    columns += ["train_infer_is_weight"] if recompute_on(case) else []
    columns += ["final_response_mask"] if "final_response_mask" in i else []
    rows = golden_rows(case, tuple(columns))
    batch, width = i["input_ids"].shape
    final = i.get("final_response_mask")
    plan = MiniBatchPlan((), float(i["batch_num_tokens"]), float(i["global_valid_samples"]), float(batch),
                         None if final is None else max(float(final.sum()), 1.0),
                         None if final is None else max(float((final.sum(-1) > 0).sum()), 1.0))
    objective = ActorObjective(kind, cfg, entropy_metric=False)
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
    per_mb = load(name).inputs["input_ids"].shape[0] if name in PER_MICRO_BATCH else 3
    case, total, metrics, grad, count = run_in_micro_batches(name, per_mb)
    assert count > 1 or name in PER_MICRO_BATCH
    assert_close(total, float(case.outputs["total_loss"]), atol=1e-4, what="total_loss")
    assert_close(grad, case.outputs["grad_logits"], atol=1e-4, what="grad_logits")
    # metrics that add up over micro-batches (ROLL's @sum/@max/@min); the base loss's plain means do not
    additive = {k: v for k, v in golden_metrics(case).items() if k.rpartition("@")[2] in ("sum", "max", "min")}
    assert additive or name.startswith("base"), "the case has metrics to compare"
    for key, value in additive.items():
        assert_close(metrics[key.partition("@")[0]], value, atol=1e-4, what=key)


@pytest.mark.parametrize("name", ACTOR_CASES)
def test_actor_metrics_of_one_micro_batch_equal_roll(name):
    case, total, metrics, grad, count = run_in_micro_batches(name, load(name).inputs["input_ids"].shape[0])
    assert count == 1
    assert_close(total, float(case.outputs["total_loss"]), atol=1e-4, what="total_loss")
    for key, value in golden_metrics(case).items():
        assert_close(metrics[key.partition("@")[0]], value, atol=1e-4, what=key)


def test_the_split_really_changes_the_micro_batch_counts():
    """The global normalisers matter: with each micro-batch's own counts the split loss differs from ROLL's."""
    name = "agentic_loss__token__sym__dualFalse__seq-mean-token-mean"
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


def test_log_probs_and_entropy_through_padding_match_roll():
    """Golden log_softmax-gather and entropy, via the padded micro-batch path: rows of different lengths padded
    together give the same values at every real position."""
    from stages.losses import entropy_from_logits, log_probs_from_logits

    case = load("log_probs_and_entropy_from_logits")
    logits, labels = case.inputs["logits"], case.inputs["labels"]
    batch, width, vocab = logits.shape
    lengths = np.array([width, width - 2, width - 1, 3])
    padded = np.zeros_like(logits)
    for b, n in enumerate(lengths):
        padded[b, :n] = logits[b, :n]
    lp = log_probs_from_logits(torch.tensor(padded), torch.tensor(labels)).numpy()
    ent = entropy_from_logits(torch.tensor(padded)).numpy()
    for b, n in enumerate(lengths):
        assert_close(lp[b, :n], case.outputs["log_probs"][b, :n], what="log_probs")
        assert_close(ent[b, :n], case.outputs["entropy"][b, :n], what="entropy")


def test_critic_objective_over_micro_batches_equals_roll():
    """ROLL's ½·mean over rows of per-row masked means, as micro-batches weighted by their share of rows."""
    case = load("critic_loss__value_clip0.2")
    i = case.inputs
    batch, width, _ = i["output_tensor"].shape
    rows = golden_rows(case, ("values", "returns"))
    output = torch.tensor(i["output_tensor"], requires_grad=True)
    plan = MiniBatchPlan((), 1.0, 1.0, float(batch))
    objective = CriticObjective(value_clip=case.params["value_clip"])
    total, metrics = 0.0, []
    groups = split_by_token_budget(rows.lengths, width * 4)
    assert len(groups) == 3
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
