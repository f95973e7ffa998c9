"""The log-prob and values stages on the run's actor group (issue 44): the training workers compute the columns on
the DeepSpeed engines they hold, and the stage's output equals that of the separate forward pass it replaces.

One rank: the same batching as a separate pass over the table in one batch (a model loaded in this process,
:func:`stages.train.forward.forward_batch`), so the columns are equal bit for bit. Two ranks: each rank runs its half
of the rows as its own batch, so a row's micro-batch (its padding, the rows beside it) differs from the single
pass's, and the columns are equal within float32 rounding (atol 2e-5, the stage tests' tolerance for a different
batching)."""

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from schemas.train_config import ForwardConfig, PassOptions, TrainStepConfig
from stages.losses import fused_output
from stages.partials import read_partials, sum_partials
from stages.storage import Location, read_manifest
from stages.train.actor_forward import evaluating, forward_on_rank, held_engine, rank_rows, why_not_held
from stages.train.batching import TokenRows
from stages.train.engine import Engine
from stages.train.forward import ForwardModels, forward_batch, forward_rows, load_forward_model
from stages.train.group import TrainerGroup
from stages.train.models import load_actor_model
from stages.train.resume import HeldEngines
from stages.train.stage import (LOGPROBS, ForwardJob, forward_group, run_logprobs, run_train_step, run_values,
                                train_section)
from tests.train.tables import advantaged_rows, read_folder, write_table
from tests.train.test_core import section
from tests.train.test_forward import CHUNK, VocabRows, fused_tolerance
from tests.train.test_stage import direct

pytestmark = pytest.mark.usefixtures("ray_cluster")
# one batch of the whole table: a separate pass over the table and the group of one rank batch the rows alike
ONE_BATCH = ForwardConfig(max_tokens_per_microbatch_in_infer=64, rows_per_batch=64, num_actors=1, cpus_per_actor=0.5,
                          compute_entropy=True)


def train_config(workers: int, **extra) -> TrainStepConfig:
    """test_core's training section on ``workers`` ranks of one CPU each."""
    return section(**{"runtime.num_workers": workers, "runtime.cpus_per_worker": 1.0, **extra})


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    table = advantaged_rows(10, lengths=(6, 30), seed=7, multi_turn=True, empty_row=True)
    return write_table(table, tmp_path_factory.mktemp("actor_forward") / "samples", parts=3)


def group_of(cfg: TrainStepConfig) -> TrainerGroup:
    return TrainerGroup(cfg.runtime, section=train_section(cfg).model_dump(mode="json"))


def test_rows_are_split_into_contiguous_slices_in_rank_order():
    for n in (0, 1, 9, 10):
        for world in (1, 2, 3):
            slices = [rank_rows(n, r, world) for r in range(world)]
            assert slices[0][0] == 0 and slices[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))


@pytest.mark.parametrize("dtype, other", [("fp32", "bf16"), ("bf16", "fp32")])
def test_a_held_engine_serves_a_pass_only_as_the_model_loaded_for_it(dist, tiny_model, samples, tmp_path, dtype,
                                                                     other, monkeypatch):
    """In this process (a DeepSpeed world of one): the held actor engine serves a log-prob pass of its checkpoint in
    its dtype, as a plain model (no LoRA), in eval mode and back to train mode after, and gives the log-probs of the
    model a forward worker loads for it, bit for bit; another checkpoint, dtype or role is not served. In bf16 too:
    DeepSpeed casts the parameters only (the rotary ``inv_freq`` buffer stays float32), and so does the forward
    worker's load (a ``model.to(bf16)`` differed by up to 2.5e-3 here, 0.22 nats on SmolLM2-135M).

    With logprobs.fused_output_layer (the request's ``fused``), a rank's pass on the held engine and on a model loaded
    beside it is the same fused pass (the log-prob section decides, not actor_train's option): equal bit for bit, no
    tensor wider than CHUNK positions by the vocabulary on either, and equal to the logits path within float32
    rounding (fp32: test_forward.fused_tolerance; bf16: the logits are bf16 on both paths, and the fused side's
    matmul over CHUNK rows may round a logit by one bf16 ulp of its magnitude; measured 9.5e-7 in fp32, 0 in
    bf16)."""
    cfg = train_config(1, **{"actor_train.model_args.disable_gradient_checkpointing": False,
                             "actor_train.model_args.dtype": dtype})
    engine = Engine(load_actor_model(str(tiny_model), None), cfg.actor_train, dist, "actor")
    job = ForwardJob("log_probs", str(tiny_model), "old_log_probs", checkpoint=str(tiny_model))
    held = HeldEngines(engine, None, os.path.realpath(tiny_model), {})
    assert held_engine(held, job) is engine and why_not_held(engine, job, dtype) is None
    assert held_engine(held, replace(job, kind="values")) is None  # no critic held
    assert held_engine(held, replace(job, checkpoint=str(tmp_path))) is None and why_not_held(None, job, dtype)
    assert f"the pass asks {other}" in why_not_held(engine, job, other)
    assert "LoRA" in why_not_held(engine, replace(job, adapter=str(tmp_path)), dtype)
    rows = TokenRows.from_arrow(read_folder(samples), "samples", columns=())
    assert engine.module.training
    with evaluating([engine.module]):
        assert not engine.module.training
        got = forward_rows(engine.module, rows, 64, entropy=True)
    assert engine.module.training
    want = forward_rows(load_forward_model(str(tiny_model), "log_probs", dtype), rows, 64, entropy=True)
    for name in ("log_probs", "entropy"):
        assert np.array_equal(got.columns[name].values, want.columns[name].values), name

    monkeypatch.setattr(fused_output, "FUSED_CHUNK_ELEMENTS", CHUNK * 49152)  # the tiny model's vocabulary
    fused_job = replace(job, entropy=True)
    parts = {}
    for where, engines in (("held", held), ("beside", None)):
        out = Location.of(str(tmp_path / f"out-{where}"))
        request = {"samples": Location.of(str(samples)), "jobs": [fused_job], "dtype": dtype, "max_tokens": 64,
                   "rows_per_batch": 64, "options": PassOptions(fused=True), "output": out,
                   "parts": Location.of(str(tmp_path / f"parts-{where}")), "spec": LOGPROBS, "where": "samples",
                   "section": None}
        with VocabRows(49152) as seen:
            assert forward_on_rank(request, dist, engines, ForwardModels()) is engines
        assert seen.rows == CHUNK, where
        counters = sum_partials(read_partials(out))
        assert counters["jobs_on_held_engines"] == (where == "held") and counters["fused_micro_batches"] >= 1
        parts[where] = read_folder(tmp_path / f"parts-{where}")
    assert engine.module.training
    assert parts["held"].equals(parts["beside"])
    for column, name in (("old_log_probs", "log_probs"), ("entropy", "entropy")):
        fused = np.concatenate([np.asarray(r, np.float32) for r in parts["held"].column(column).to_pylist()])
        plain = got.columns[name].values
        scale = float(np.abs(plain).max()) + np.log(49152)
        tol = fused_tolerance(plain, 49152) if dtype == "fp32" else float(torch.finfo(torch.bfloat16).eps) * scale
        np.testing.assert_allclose(fused, plain, rtol=0, atol=tol, err_msg=column)


def separate_pass(samples: Path, checkpoint: str, counters: Path) -> pa.Table:
    """The log-prob table of ONE_BATCH by a separate forward pass in this process: the checkpoint loaded as a
    forward worker loads it (fp32) and the whole table run as one batch under the token budget (the reference, the
    checkpoint itself, is its copy), on one torch thread as the rank (cpus_per_worker 1); the batch's counters go
    to ``counters``."""
    job = ForwardJob("log_probs", checkpoint, "old_log_probs", ("ref_log_probs",), entropy=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return forward_batch([load_forward_model(checkpoint, "log_probs", "fp32")], [job], read_folder(samples),
                             ONE_BATCH.max_tokens_per_microbatch_in_infer, Location.of(str(counters)), LOGPROBS,
                             "samples")
    finally:
        torch.set_num_threads(threads)


def test_actor_group_of_one_rank_equals_a_separate_pass_bit_for_bit_and_trains_on_the_same_engines(
        tiny_model, samples, tmp_path):
    """Old log-probs and entropy on the group (it builds the engines of the checkpoint for the pass, and the
    training step then trains them: ``train/engines_kept``), then on the trained checkpoint's held engine: the same
    table as a separate forward pass in this process (:func:`separate_pass`), bit for bit; the output's fingerprint
    does not depend on where the pass ran, so the stage run on its own (which starts a group of its own) finds it up
    to date (resume)."""
    cfg = train_config(1)
    group = group_of(cfg)
    try:
        on_group = run_logprobs(str(samples), str(tiny_model), ONE_BATCH, str(tmp_path / "g0"), group=group)
        step = run_train_step(str(samples), str(tiny_model), cfg, str(tmp_path / "ck1"), trainer=group)
        trained = run_logprobs(str(samples), str(tmp_path / "ck1"), ONE_BATCH, str(tmp_path / "g1"), group=group)
        fused = run_logprobs(str(samples), str(tmp_path / "ck1"), ONE_BATCH.model_copy(
            update={"fused_output_layer": True}), str(tmp_path / "g1f"), group=group)
    finally:
        group.close()
    assert step.metrics["train/engines_kept"] == 1.0  # the engines the log-prob pass built were trained
    for result in (on_group, trained):  # on the held engine, no model loaded beside it
        assert result.metrics["logprobs/jobs_on_held_engines"] == 1 and result.metrics["logprobs/jobs_on_loaded_models"] == 0
    for got, checkpoint in ((tmp_path / "g0", str(tiny_model)), (tmp_path / "g1", str(tmp_path / "ck1"))):
        a, b = read_folder(got), separate_pass(samples, checkpoint, tmp_path / f"counters-{got.name}")
        assert a.column_names == b.column_names and a.equals(b), got.name
    assert read_folder(tmp_path / "g0").column("old_log_probs") != read_folder(tmp_path / "g1").column("old_log_probs")
    # logprobs.fused_output_layer reaches the ranks: the held engine's pass fused, equal within float32 rounding
    assert fused.metrics["logprobs/fused_micro_batches"] >= 1 and fused.metrics["logprobs/jobs_on_held_engines"] == 1
    assert fused.fingerprint == trained.fingerprint and "logprobs/fused_micro_batches" not in trained.metrics
    for column in ("old_log_probs", "entropy"):
        plain = np.concatenate(read_folder(tmp_path / "g1").column(column).to_pylist())
        got = np.concatenate(read_folder(tmp_path / "g1f").column(column).to_pylist())
        np.testing.assert_allclose(got, plain, rtol=0, atol=fused_tolerance(plain, 49152), err_msg=column)
    for result, checkpoint, name in ((on_group, str(tiny_model), "g0"), (trained, str(tmp_path / "ck1"), "g1")):
        alone = run_logprobs(str(samples), checkpoint, ONE_BATCH, str(tmp_path / name))
        assert alone.skipped and alone.fingerprint == result.fingerprint, name
    tokens = sum_partials(read_partials(Location.of(str(tmp_path / "counters-g0"))))["tokens"]
    assert read_manifest(Location.of(str(tmp_path / "g0")))["metrics"]["logprobs/tokens"] == tokens
    assert not (tmp_path / "g0" / "_partials").exists()
    # one block a rank's part: one write task, one output file (not Ray Data's split of a part into 4 blocks)
    assert [p.name for p in (tmp_path / "g0").glob("*.parquet")] == ["part-00000.parquet"]


@pytest.mark.slow
def test_actor_group_of_two_ranks_gives_lora_reference_and_critic_values_of_the_separate_pass(
        tiny_model, samples, tmp_path):
    """Two data-parallel ranks, LoRA on the actor, a critic (gae): after one training step the group computes the
    old log-probs on its held LoRA engine, the reference with the adapter off (the base model's log-probs) and the
    values on its held critic; equal to the separate pass within float32 rounding (the batching differs, module
    docstring). The separate log-prob and values passes share one forward group of one rank (models loaded beside,
    no engines: a training run's with keep_workers: false), not a group started for each stage run on its own: one
    process that imports torch and loads the models, not two."""
    cfg = train_config(2, **{"adv_estimator": "gae", "actor_train.model_args.lora_rank": 4,
                             "critic_train.training_args.learning_rate": 1e-3,
                             "critic_train.training_args.per_device_train_batch_size": 8})
    fwd = ONE_BATCH.model_copy(update={"enable_reference": True})
    group = group_of(cfg)
    ck = str(tmp_path / "ck1")
    try:
        run_train_step(str(samples), str(tiny_model), cfg, ck, trainer=group)
        logprobs = run_logprobs(str(samples), ck, fwd, str(tmp_path / "g"), reference=str(tiny_model), group=group)
        values = run_values(str(samples), ck, fwd, str(tmp_path / "gv"), group=group)
    finally:
        group.close()
    for result, name in ((logprobs, "logprobs"), (values, "values")):  # one job, on each rank's held engine
        assert result.metrics[f"{name}/jobs_on_held_engines"] == 2 and result.metrics[f"{name}/jobs_on_loaded_models"] == 0
    with forward_group(fwd, kept=True) as beside:  # the separate passes: one group loads the models beside
        separate = (run_logprobs(str(samples), ck, fwd, str(tmp_path / "p"), reference=str(tiny_model), group=beside),
                    run_values(str(samples), ck, fwd, str(tmp_path / "pv"), group=beside))
    for result, name in zip(separate, ("logprobs", "values")):  # on models loaded beside, no engine held
        metrics = result.metrics
        assert (metrics[f"{name}/jobs_on_held_engines"], metrics[f"{name}/jobs_on_loaded_models"]) == (0, 1), name
    table = read_folder(samples)
    base = direct(load_actor_model(str(tiny_model)), table)
    got, want = read_folder(tmp_path / "g"), read_folder(tmp_path / "p")
    assert got.column("row_id") == table.column("row_id") == want.column("row_id")
    for name in ("old_log_probs", "entropy", "ref_log_probs"):
        for b, (x, y) in enumerate(zip(got.column(name).to_pylist(), want.column(name).to_pylist())):
            np.testing.assert_allclose(x, y, atol=2e-5, err_msg=f"{name} row {b}")
    for b, r in enumerate(got.column("ref_log_probs").to_pylist()):
        np.testing.assert_allclose(r, base.row(b), atol=2e-5)
    assert got.column("old_log_probs") != got.column("ref_log_probs")  # the adapter was trained
    for x, y in zip(read_folder(tmp_path / "gv").column("values").to_pylist(),
                    read_folder(tmp_path / "pv").column("values").to_pylist()):
        np.testing.assert_allclose(x, y, atol=2e-5)
