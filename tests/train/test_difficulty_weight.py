"""difficulty_loss_weight with the rlvr policy loss (issue 48): the training step hands the loss each row's
``difficulty`` (spec §6.5, ROLL's sample weights w = 0.5 + 1.5·clip(difficulty, 0, 1), with BUG-8 fixed). Before,
stages/train/core.py built the loss inputs without it and every step raised "difficulty_loss_weight is on but no
'difficulty' column was given". The path here is the training step's own: the advantaged table's Parquet files read
with the training columns (read_train_table), rows in row_id order (rows_of_table), padded micro-batches of rows in
any order, and the actor objective; logits are random (no model, no DeepSpeed)."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from schemas.config import validate_config
from schemas.train_config import TrainStepConfig
from stages.losses import LossInputs, policy_loss
from stages.storage import Location
from stages.train.batching import MiniBatchPlan, pad_micro_batch
from stages.train.objectives import ActorObjective
from stages.train.train_table import read_train_table, rows_of_table
from tests.train.tables import advantaged_rows

VOCAB = 32


def section(**options) -> TrainStepConfig:
    return validate_config(TrainStepConfig, {"adv_estimator": "grpo", "policy_loss": "rlvr",
                                             "compute_entropy_metric": False, **options})


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """8 rows whose difficulty is 0.0, 0.25, ... by row_id, stored shuffled in two Parquet files."""
    table = advantaged_rows(8, lengths=(8, 16), seed=3, vocab=VOCAB)
    table = table.append_column("difficulty", pa.array([i / 4 for i in range(8)], pa.float64()))
    folder = tmp_path_factory.mktemp("advantaged")
    order = np.random.default_rng(0).permutation(8)
    pq.write_table(table.take(order[:5]), folder / "part-00000.parquet")
    pq.write_table(table.take(order[5:]), folder / "part-00001.parquet")
    loc = Location.of(str(folder))
    return rows_of_table(read_train_table(loc, table.column_names), str(folder))


def _loss(rows, cfg, index):
    """The objective's loss on rows ``index`` (one micro-batch = the whole mini-batch) with fixed random logits."""
    mb = pad_micro_batch(rows, index).to("cpu")  # as the engine moves it to its device
    logits = torch.randn((len(index), mb.input_ids.shape[1], VOCAB), generator=torch.Generator().manual_seed(5))
    plan = MiniBatchPlan((index,), float(mb.loss_mask.sum()), float(len(index)), float(len(index)))
    loss, metrics = ActorObjective.from_section(cfg)(logits, mb, index, plan)
    return loss, metrics, mb, logits, plan


def test_the_training_step_hands_the_loss_each_rows_difficulty(rows):
    cfg = section(difficulty_loss_weight=True)
    index = np.array([6, 1, 4, 0, 7])  # any order: the difficulty follows its row
    assert list(rows.row_ids) == [f"r{i:04d}" for i in range(8)]
    loss, metrics, mb, logits, plan = _loss(rows, cfg, index)
    np.testing.assert_allclose(mb.per_row["difficulty"], index / 4)
    log_probs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    expected, _ = policy_loss("rlvr")(LossInputs(log_probs=log_probs * mb.loss_mask, mask=mb.loss_mask,
                                                 advantages=mb.next_token["advantages"], old_log_probs=None,
                                                 num_tokens=plan.num_tokens, num_seqs=plan.num_seqs,
                                                 difficulty=index / 4), cfg.loss_config())
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    weights = 0.5 + 1.5 * np.clip(index / 4, 0, 1)
    weights = weights * len(index) / weights.sum()
    assert metrics["actor/sample_weights_min@min"] == pytest.approx(weights.min(), rel=1e-5)
    assert metrics["actor/sample_weights_max@max"] == pytest.approx(weights.max(), rel=1e-5)
    unweighted, *_ = _loss(rows, section(difficulty_loss_weight=False), index)
    assert float(unweighted) != pytest.approx(float(loss), rel=1e-3), "the weights change the loss"


def test_the_pre_flight_needs_the_column_only_when_the_weights_apply():
    assert "difficulty" in section(difficulty_loss_weight=True).table_needs
    assert "difficulty" not in section().table_needs
    assert "difficulty" not in section(difficulty_loss_weight=True, roll_compat=True).table_needs  # ROLL's BUG-8


@pytest.mark.parametrize("path", ["configs/train_frozenlake_quickstart.yaml", "configs/rlvr_train_math.yaml"])
def test_a_training_run_refuses_it_at_load_time(path):
    """No stage of a run writes a difficulty column: refused before anything starts, not by the first step."""
    from flows.pipelines import pipeline_of
    from schemas.config import load_config_data
    from schemas.errors import ConfigError
    from tests.spine.helpers import REPO

    data = load_config_data(str(REPO / path), {"train.policy_loss": "rlvr", "train.difficulty_loss_weight": True})
    with pytest.raises(ConfigError, match="no stage of a training run writes that column"):
        validate_config(pipeline_of(data, path).config_model(), data, path)
