"""Issue 4's acceptance on CPU: training steps with 2 Ray Train workers on the real DeepSpeed engine and the default
model (SmolLM2-135M-Instruct). On a fixed batch the loss decreases over a few optimizer steps and the parameters
change; two workers compute the gradient one process computes; resuming from a checkpoint reproduces the next
step's loss. The old log-probs come from the log-prob stage (Ray Data actor pool) under the same model."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from schemas.config import validate_config
from schemas.train_config import ForwardConfig, TrainStepConfig
from stages.train.batching import pad_micro_batch
from stages.train.core import ActorObjective, load_actor_model, rows_of_table
from stages.train.stage import run_logprobs, run_train_step
from tests.train.tables import advantaged_rows, read_folder, write_table

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
def batch(default_model, tmp_path_factory) -> Path:
    """4 rows of distinct lengths (so each worker's share is the same whatever the epoch's shuffle) with the
    model's own old log-probs from the log-prob stage."""
    root = tmp_path_factory.mktemp("done")
    table = advantaged_rows(4, lengths=(20, 32), seed=11, vocab=49152)
    lengths = [len(r) for r in table.column("input_ids").to_pylist()]
    assert len(set(lengths)) == 4
    write_table(table, root / "adv")
    forward = ForwardConfig(enable_reference=False, num_actors=1, cpus_per_actor=1)
    run_logprobs(str(root / "adv"), str(default_model), forward, str(root / "adv_lp"))
    return root / "adv_lp"


@pytest.fixture
def trainer(tmp_path):
    """One kept group of the two workers for the test's three steps (a training flow's way), so the workers start
    once; each step loads its checkpoint (their sections differ)."""
    from stages.train.group import TrainerGroup

    with TrainerGroup(config(1).runtime, storage=str(tmp_path)) as group:
        yield group


def test_two_workers_train_the_default_model_and_resume_exactly(default_model, batch, tmp_path, trainer):
    a = run_train_step(str(batch), str(default_model), config(3), str(tmp_path / "a"), trainer=trainer)
    steps_a = per_step(tmp_path / "a")
    losses = [s["actor/pg_loss"] for s in steps_a]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0], losses
    assert a.state["world_size"] == 2 and steps_a[0]["actor/ratio_max"] == pytest.approx(1.0, abs=1e-4)

    before = load_file(str(default_model / "model.safetensors"))
    after = load_file(str(tmp_path / "a" / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > 0.9 * len(before)

    # two ranks x (loss x world size) with DeepSpeed's averaging = the gradient of the whole mini-batch
    table = read_folder(batch)
    rows = rows_of_table(table, "t")
    model = load_actor_model(str(default_model))
    from stages.train.batching import MiniBatchPlan

    index = np.arange(rows.num_rows)
    tokens = rows.loss_tokens()
    plan = MiniBatchPlan((index,), float(tokens.sum()), float((tokens > 0).sum()), float(rows.num_rows))
    mb = pad_micro_batch(rows, index)
    logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
    loss, _ = ActorObjective.from_section(config(1))(logits, mb, index, plan)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    assert steps_a[0]["actor/grad_norm"] == pytest.approx(float(norm), rel=1e-3)
    assert steps_a[0]["actor/pg_loss"] == pytest.approx(float(loss.detach()), abs=1e-5)

    # resume: 2 epochs, checkpoint, then 1 more epoch from the checkpoint = the 3rd optimizer step of run a
    run_train_step(str(batch), str(default_model), config(2), str(tmp_path / "b"), trainer=trainer)
    assert [s["actor/pg_loss"] for s in per_step(tmp_path / "b")] == pytest.approx(losses[:2], rel=1e-6)
    c = run_train_step(str(batch), str(tmp_path / "b"), config(1), str(tmp_path / "c"), trainer=trainer)
    (resumed,) = per_step(tmp_path / "c")
    assert resumed["actor/pg_loss"] == pytest.approx(losses[2], rel=1e-5, abs=1e-7)
    assert resumed["actor/grad_norm"] == pytest.approx(steps_a[2]["actor/grad_norm"], rel=1e-4)
    assert c.state["global_step"] == 2 and c.state["optimizer_steps"] == 3
    assert c.metrics["train/engines_kept"] == 0.0  # another section than the step that wrote b: loaded from b
