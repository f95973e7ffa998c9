"""Token-budget micro-batching, padding and the plan of a training step (pure numpy/torch)."""

import numpy as np
import pytest
import torch

from schemas.errors import InvariantError, SchemaError
from stages.algos.ragged import Ragged
from stages.train.batching import (BatchingPolicy, TokenRows, epoch_order, pad_micro_batch, plan_step,
                                   split_by_rows, split_by_token_budget, take, unpad_next_token)
from tests.train.tables import advantaged_rows


def rows_of(n=10, seed=0, **kw) -> TokenRows:
    return TokenRows.from_arrow(advantaged_rows(n, seed=seed, **kw), "test")


def test_take_equals_a_loop_over_rows():
    r = Ragged.from_rows([[1, 2, 3], [], [4], [5, 6]], np.int64)
    picked = take(r, np.array([3, 0, 1, 3]))
    expected = [r.row(i).tolist() for i in (3, 0, 1, 3)]
    assert [picked.row(i).tolist() for i in range(4)] == expected


@pytest.mark.parametrize("budget", [1, 40, 64, 100, 1000])
def test_token_budget_groups_cover_every_row_once_within_budget(budget):
    lengths = np.random.default_rng(3).integers(1, 50, 37)
    groups = split_by_token_budget(lengths, budget)
    assert sorted(np.concatenate(groups).tolist()) == list(range(37))
    for g in groups:
        cost = len(g) * lengths[g].max()
        assert cost <= budget or len(g) == 1  # a single longer row gets its own micro-batch
    assert split_by_token_budget(lengths, budget)[0].tolist() == groups[0].tolist()  # deterministic


def test_token_budget_takes_longest_rows_first_and_packs_greedily():
    groups = split_by_token_budget(np.array([3, 10, 4, 10, 2]), 20)
    assert [g.tolist() for g in groups] == [[1, 3], [2, 0, 4]]  # 2x10 = 20; then 3x4 = 12


def test_split_by_rows():
    assert [g.tolist() for g in split_by_rows(5, 2)] == [[0, 1], [2, 3], [4]]


def test_token_rows_reads_the_table_and_counts_loss_tokens_like_a_loop():
    table = advantaged_rows(6, multi_turn=True, empty_row=True, with_values=True)
    rows = TokenRows.from_arrow(table, "t")
    masks = table.column("response_mask").to_pylist()
    assert rows.loss_tokens().tolist() == [int(sum(m[1:])) for m in masks]
    assert rows.loss_tokens()[-1] == 0
    assert set(rows.next_token) == {"advantages", "returns", "values"}


def test_token_rows_rejects_misaligned_columns_and_missing_tokens():
    import pyarrow as pa

    table = advantaged_rows(3)
    bad = table.set_column(table.schema.get_field_index("advantages"), "advantages",
                           pa.array([[0.0]] * 3, pa.list_(pa.float32())))
    with pytest.raises(InvariantError, match="row 0 .*'advantages'.*expected"):
        TokenRows.from_arrow(bad, "the table")
    with pytest.raises(SchemaError, match="missing column 'input_ids'"):
        TokenRows.from_arrow(table.drop_columns(["input_ids"]), "the table")


def test_padding_round_trip_and_layout():
    rows = rows_of(5)
    index = np.array([4, 1, 2])
    mb = pad_micro_batch(rows, index, pad_token_id=7)
    width = int(rows.lengths[index].max())
    assert mb.input_ids.shape == (3, width) and mb.next_token["advantages"].shape == (3, width - 1)
    for i, r in enumerate(index):
        n = rows.lengths[r]
        assert mb.input_ids[i, :n].tolist() == rows.input_ids.row(r).tolist()
        assert (mb.input_ids[i, n:] == 7).all() and (mb.response_mask[i, n:] == 0).all()
        assert mb.position_ids[i, :n].tolist() == list(range(n))
    back = unpad_next_token(mb.next_token["advantages"], mb.lengths)
    for i, r in enumerate(index):
        np.testing.assert_array_equal(back.row(i), rows.next_token["advantages"].row(r))
    assert mb.real_tokens == rows.lengths[index].sum() and mb.padded_tokens == 3 * width


def test_padding_step_has_no_rows_and_no_loss_mask():
    mb = pad_micro_batch(rows_of(2), np.zeros(0, dtype=np.int64))
    assert mb.padding_step and mb.num_rows == 0 and mb.real_tokens == 0
    assert float(mb.loss_mask.sum()) == 0.0


def test_epoch_order_is_seeded():
    a = epoch_order(20, seed=1, step=3, epoch=0)
    assert a.tolist() == epoch_order(20, seed=1, step=3, epoch=0).tolist()
    assert a.tolist() != epoch_order(20, seed=1, step=3, epoch=1).tolist()
    assert a.tolist() != epoch_order(20, seed=1, step=4, epoch=0).tolist()
    assert sorted(a.tolist()) == list(range(20))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("policy", [BatchingPolicy(4, max_tokens=90), BatchingPolicy(3, rows_per_micro_batch=2)])
def test_plan_deals_every_row_once_per_epoch_with_global_counts(world, policy):
    rows = rows_of(23, seed=5, empty_row=True)
    lengths, tokens = rows.lengths, rows.loss_tokens()
    plans = [plan_step(lengths, tokens, policy=policy, world_size=world, rank=r, ppo_epochs=2, seed=0, step=0)
             for r in range(world)]
    steps = len(plans[0])
    assert all(len(p) == steps for p in plans)
    per_epoch = -(-23 // (policy.mini_batch_rows * world))
    assert steps == 2 * per_epoch
    for epoch in range(2):
        seen = []
        for k in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            counts = {len(p[k].micro_batches) for p in plans}
            assert len(counts) == 1  # every rank runs the same number of micro-batches
            members = np.concatenate([mb for p in plans for mb in p[k].micro_batches])
            seen.extend(members.tolist())
            # the global normalisers, counted by a loop over the mini-batch's rows
            assert plans[0][k].num_tokens == max(1, sum(int(tokens[i]) for i in members))
            assert plans[0][k].num_seqs == max(1, sum(1 for i in members if tokens[i] > 0))
            assert all(p[k].num_tokens == plans[0][k].num_tokens for p in plans)
            for p in plans:
                for mb in p[k].micro_batches:
                    if policy.max_tokens and len(mb) > 1:
                        assert len(mb) * lengths[mb].max() <= policy.max_tokens
        assert sorted(seen) == list(range(23))


def test_plan_pads_short_ranks_with_padding_steps():
    lengths = np.array([50, 50, 50])  # rank 0 gets two rows (two micro-batches), rank 1 one row
    plans = [plan_step(lengths, lengths - 1, policy=BatchingPolicy(2, max_tokens=60), world_size=2, rank=r,
                       ppo_epochs=1, seed=0, step=0) for r in range(2)]
    assert [[len(mb) for mb in p[0].micro_batches] for p in plans] == [[1, 1], [1, 0]]


def test_plan_rejects_a_rank_outside_the_world():
    with pytest.raises(InvariantError):
        plan_step(np.array([3]), np.array([1]), policy=BatchingPolicy(1, max_tokens=8), world_size=2, rank=2,
                  ppo_epochs=1, seed=0, step=0)


def test_microbatch_to_device_keeps_values():
    mb = pad_micro_batch(rows_of(3), np.array([0, 2])).to("cpu")
    assert isinstance(mb.input_ids, torch.Tensor) and mb.input_ids.dtype == torch.int64
