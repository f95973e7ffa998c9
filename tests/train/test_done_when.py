"""The acceptance of issues 4 and 14 on CPU: training workers (Ray actors) on the real DeepSpeed engine (gloo, CPU
accelerator).

Issue 4, on the default model (SmolLM2-135M-Instruct): on a fixed batch the loss decreases over a few optimizer
steps and the parameters change; resuming from a checkpoint reproduces the next step's loss. The old log-probs come
from the log-prob stage under the same model, computed on the two workers (the actor group, as a training run
computes them; tests/train/test_actor_forward.py: equal to an independent forward pass on a loaded model), whose
engines then take the first step. The uninterrupted reference of the resumed step is the kept engines' next step
(a training run's way from one iteration to the next), which never touched the checkpoint.

Issue 14, items 1-2, on the tiny model: data-parallel training is exact, and ZeRO-3 trains, saves whole weights and
resumes. Two workers train one optimizer step on a global batch that splits unevenly (7 rows: one rank gets 4 rows
and more tokens, the other 3, and fewer micro-batches, so it runs padding steps); the same step in this process as a
world of one is the reference. The loss of every micro-batch is divided by the whole mini-batch's counts (spec
§6.2), so the gradients the ranks sum are the 1-worker gradient, whatever the split. (This replaces issue 4's check
of the first step's gradient norm against one forward and backward pass of the default model in this process.)

AdamW's first step is ``lr * g / (|g| + eps)``: with the default tiny eps that is ``lr * sign(g)``, which would hide a
wrong gradient scale (a per-rank mean, a division by the world size) and turn rounding noise in near-zero gradient
entries into whole steps. These tests set ``adam_epsilon`` above every gradient entry (clipping keeps the norm at
most 1), which makes the update ``~ lr * g / eps``: linear in the gradient, so the weights show the gradient itself, and
float rounding in its sums stays rounding. The tolerance follows from that: summing the same float32 terms in another
order moves the gradient by a few float32 epsilons of the terms, the update by ``lr / eps`` times that, and the
stored weight by a unit in its last place; :func:`tolerance` allows 16 float32 epsilons of the largest weight plus of
the largest update, where a wrong normaliser moves weights by a sizeable fraction of the update.

Every test of the module shares one kept group of two workers (a training flow's way): it starts once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from schemas.config import validate_config
from schemas.train_config import ForwardConfig, TrainStepConfig
from stages.train.batching import batching_policy, plan_step
from stages.train.checkpoint import load_weights
from stages.train.core import train_and_save
from stages.train.stage import run_logprobs, run_train_step, train_section
from stages.train.train_table import rows_of_table
from tests.train.tables import advantaged_rows, read_folder, write_table
from tests.train.test_core import with_model_log_probs

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def config(epochs: int) -> TrainStepConfig:
    """One mini-batch of all 4 rows (2 per worker), constant LR, clipping at 1.0, ZeRO-2, fp32."""
    return validate_config(TrainStepConfig, {
        "adv_estimator": "grpo", "ppo_epochs": epochs,
        "actor_train": {"training_args": {"learning_rate": 2e-5, "per_device_train_batch_size": 2,
                                          "max_grad_norm": 1.0},
                        "strategy_args": {"zero_stage": 2}, "max_tokens_per_microbatch_in_train": 64},
        "runtime": {"num_workers": 2, "cpus_per_worker": 1}})


def per_step(checkpoint: Path) -> list[dict]:
    return json.loads((checkpoint / "train_state.json").read_text())["per_step"]


@pytest.fixture(scope="module")
def group():
    """One kept group of the two workers for every step of the module (a training flow's way), so the workers start
    once; a step whose section or checkpoint differs from the one before loads its checkpoint. It trains under
    ``config(1)``'s section: a log-prob pass builds the engines of its checkpoint under it, for the next step."""
    from stages.train.group import TrainerGroup

    with TrainerGroup(config(1).runtime, section=train_section(config(1)).model_dump(mode="json")) as trainer:
        yield trainer


@pytest.fixture(scope="module")
def batch(default_model, group, tmp_path_factory) -> Path:
    """4 rows of distinct lengths (so each worker's share is the same whatever the epoch's shuffle) with the
    model's own old log-probs from the log-prob stage on the two workers, which then hold the model's engines."""
    root = tmp_path_factory.mktemp("done")
    table = advantaged_rows(4, lengths=(20, 32), seed=11, vocab=49152)
    lengths = [len(r) for r in table.column("input_ids").to_pylist()]
    assert len(set(lengths)) == 4
    write_table(table, root / "adv")
    run_logprobs(str(root / "adv"), str(default_model), ForwardConfig(enable_reference=False), str(root / "adv_lp"),
                 group=group)
    return root / "adv_lp"


def test_two_workers_train_the_default_model_and_resume_exactly(default_model, batch, tmp_path, group):
    """Two one-epoch steps on the engines the workers keep (a -> k2: the loss falls, the weights move), and k2's
    step again on engines loaded from a's DeepSpeed state (l2): the same loss and gradient norm. Only a writes
    DeepSpeed's state (2.1 GB); the others write weights and a replay record. (A third kept step, k2 -> k3, once
    showed the loss falling twice: 15 CPU-s of the module for no other check; the fall over the two steps stays.)"""
    path = {name: str(tmp_path / name) for name in ("a", "k2", "l2")}
    a = run_train_step(str(batch), str(default_model), config(1), path["a"], trainer=group)
    k2 = run_train_step(str(batch), path["a"], config(1), path["k2"], trainer=group, full_state=False)
    steps = [per_step(Path(path[name]))[0] for name in ("a", "k2")]
    losses = [s["actor/pg_loss"] for s in steps]
    assert losses[1] < losses[0], losses
    assert a.state["world_size"] == 2 and steps[0]["actor/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    # the log-prob stage's engines took a's step, a's took k2's
    assert [r.metrics["train/engines_kept"] for r in (a, k2)] == [1.0, 1.0]

    before = load_file(str(default_model / "model.safetensors"))
    after = load_file(str(tmp_path / "k2" / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > 0.9 * len(before)

    # resume: k2's step from a's checkpoint (the group now holds k2's engines: loaded from a)
    resumed = run_train_step(str(batch), path["a"], config(1), path["l2"], trainer=group, full_state=False)
    (step,) = per_step(tmp_path / "l2")
    assert step["actor/pg_loss"] == pytest.approx(losses[1], rel=1e-5, abs=1e-7)
    assert step["actor/grad_norm"] == pytest.approx(steps[1]["actor/grad_norm"], rel=1e-4)
    assert resumed.state["global_step"] == 2 and resumed.state["optimizer_steps"] == 2
    assert resumed.metrics["train/engines_kept"] == 0.0


# ---- issue 14: data-parallel exactness and ZeRO-3, on the tiny model -------------------------------------------

ROWS = 7
LR, ADAM_EPS = 0.05, 1.0
F32 = float(torch.finfo(torch.float32).eps)


def dp_config(*, zero_stage: int = 2, loss_agg_mode: str = "token-mean", epochs: int = 1, workers: int = 2,
              entropy_metric: bool = False) -> TrainStepConfig:
    """One mini-batch of every row (8 rows per rank >= 7), micro-batches of <= 64 padded tokens, clipping at 1."""
    return validate_config(TrainStepConfig, {
        "adv_estimator": "grpo", "loss_agg_mode": loss_agg_mode, "ppo_epochs": epochs,
        "compute_entropy_metric": entropy_metric,
        "actor_train": {"training_args": {"learning_rate": LR, "adam_epsilon": ADAM_EPS,
                                          "per_device_train_batch_size": 8, "max_grad_norm": 1.0},
                        "max_tokens_per_microbatch_in_train": 64, "strategy_args": {"zero_stage": zero_stage}},
        "runtime": {"num_workers": workers, "cpus_per_worker": 1}})


def tolerance(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """16 float32 epsilons of the largest weight plus of the largest update (module docstring)."""
    largest = max(float(v.abs().max()) for v in after.values())
    update = max(float((after[k] - before[k]).abs().max()) for k in after)
    return 16 * F32 * (largest + update)


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def uneven_batch(tiny_model, tmp_path_factory) -> Path:
    """7 rows of distinct lengths (so the deal to the ranks is the same for every shuffle) with the model's own old
    log-probs (ratio 1 at the first step), in two Parquet parts."""
    table = with_model_log_probs(advantaged_rows(ROWS, lengths=(10, 40), seed=7, multi_turn=True), tiny_model)
    lengths = [len(r) for r in table.column("input_ids").to_pylist()]
    assert len(set(lengths)) == ROWS
    return write_table(table, tmp_path_factory.mktemp("dp") / "adv", parts=2)


@pytest.fixture(scope="module")
def zero2_token_mean(uneven_batch, tiny_model, group, tmp_path_factory) -> Path:
    """The 2-worker ZeRO-2 token-mean step (the reference of the ZeRO-3 test too)."""
    out = tmp_path_factory.mktemp("dp-z2") / "ckpt"
    run_train_step(str(uneven_batch), str(tiny_model), dp_config(), str(out), trainer=group)
    return out


def one_worker_step(batch: Path, checkpoint: Path, cfg: TrainStepConfig, output: Path, dist) -> Path:
    """The same step in this process, a DeepSpeed world of one."""
    train_and_save(read_folder(batch), str(batch), str(checkpoint), cfg, str(output), dist)
    return output


def test_the_global_batch_splits_unevenly_over_two_ranks(uneven_batch):
    """Rank 0 gets more rows and tokens than rank 1 and more micro-batches (rank 1 pads with empty steps), while
    both divide by the counts of the whole mini-batch."""
    rows = rows_of_table(read_folder(uneven_batch), "t")
    policy = batching_policy(dp_config().actor_train)
    plans = [plan_step(rows.lengths, rows.loss_tokens(), policy=policy, world_size=2, rank=r, ppo_epochs=1, seed=42,
                       step=0)[0] for r in (0, 1)]
    tokens = [sum(int(rows.lengths[i].sum()) for i in p.micro_batches) for p in plans]
    real = [sum(1 for i in p.micro_batches if i.size) for p in plans]
    assert tokens[0] > tokens[1] and real[0] > real[1], (tokens, real)
    assert len(plans[0].micro_batches) == len(plans[1].micro_batches)
    assert plans[0].num_tokens == plans[1].num_tokens == float(rows.loss_tokens().sum())


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_two_workers_take_the_one_worker_step(loss_agg_mode, uneven_batch, tiny_model, group, zero2_token_mean,
                                              dist, tmp_path):
    if loss_agg_mode == "token-mean":
        two = zero2_token_mean
    else:
        two = tmp_path / "two"
        run_train_step(str(uneven_batch), str(tiny_model), dp_config(loss_agg_mode=loss_agg_mode), str(two),
                       trainer=group)
    one = one_worker_step(uneven_batch, tiny_model, dp_config(loss_agg_mode=loss_agg_mode, workers=1),
                          tmp_path / "one", dist)
    before, w1, w2 = load_weights(str(tiny_model)), load_weights(str(one)), load_weights(str(two))
    tol = tolerance(before, w1)
    diff = largest_difference(w1, w2)
    update = largest_difference(before, w1)
    assert diff <= tol, f"2 workers differ from 1 by {diff:.3g} (tolerance {tol:.3g}, largest update {update:.3g})"
    assert update > 100 * tol  # the step moved the weights far beyond the tolerance
    (s1,), (s2,) = per_step(one), per_step(two)
    assert s2["actor/grad_norm"] > 1.0  # clipping was active: the norm is the global one
    assert s2["actor/grad_norm"] == pytest.approx(s1["actor/grad_norm"], rel=64 * F32)
    assert s2["actor/pg_loss"] == pytest.approx(s1["actor/pg_loss"], rel=64 * F32, abs=F32)
    assert json.loads((two / "train_state.json").read_text())["world_size"] == 2


def test_zero3_saves_the_gathered_weights_of_zero2_and_resumes_exactly(uneven_batch, tiny_model, group,
                                                                        zero2_token_mean, tmp_path):
    from transformers import AutoModelForCausalLM

    z3 = tmp_path / "z3"
    result = run_train_step(str(uneven_batch), str(tiny_model), dp_config(zero_stage=3), str(z3), trainer=group)
    state = json.loads((z3 / "train_state.json").read_text())
    assert (state["zero_stage"], state["world_size"], result.state["optimizer_steps"]) == (3, 2, 1)
    partitions = sorted(p.name for p in (z3 / "deepspeed/actor/state").iterdir())
    assert sum("optim_states" in name for name in partitions) == 2, partitions  # one optimizer partition per rank

    before, w2, w3 = load_weights(str(tiny_model)), load_weights(str(zero2_token_mean)), load_weights(str(z3))
    assert {k: v.shape for k, v in w3.items()} == {k: v.shape for k, v in before.items()}  # whole, not partitions
    diff = largest_difference(w2, w3)
    assert diff <= tolerance(before, w2), diff
    model = AutoModelForCausalLM.from_pretrained(z3)  # what generation and evaluation load
    torch.testing.assert_close(model.get_input_embeddings().weight.detach(), w3["model.embed_tokens.weight"],
                               rtol=0, atol=0)

    # resume from z3's partitioned DeepSpeed state (another section: the kept engines are not reused) = the second
    # optimizer step of an uninterrupted two-epoch step
    resumed = run_train_step(str(uneven_batch), str(z3), dp_config(zero_stage=3, entropy_metric=True),
                             str(tmp_path / "z3b"), trainer=group)
    assert resumed.metrics["train/engines_kept"] == 0.0 and resumed.state["optimizer_steps"] == 2
    run_train_step(str(uneven_batch), str(tiny_model), dp_config(zero_stage=3, epochs=2), str(tmp_path / "whole"),
                   trainer=group)
    assert per_step(tmp_path / "z3b")[0]["actor/pg_loss"] == per_step(tmp_path / "whole")[1]["actor/pg_loss"]
    diff = largest_difference(load_weights(str(tmp_path / "z3b")), load_weights(str(tmp_path / "whole")))
    assert diff == 0.0, diff
