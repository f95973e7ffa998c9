"""The Ray side: log-prob and values stages (via the runner: on a kept forward group, or on an actor group started
for a stage run on its own, as ``rollflow logprobs`` runs it) and the training step on its worker group (2 workers,
tiny model) through the CLI, its checkpoints on a local S3 server: skip on re-run, keep the newest K, worker errors
reach the user."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import typer
import yaml
from typer.testing import CliRunner

from schemas.errors import SchemaError
from schemas.train_config import ForwardConfig
from stages.plan import PlanError
from stages.train.batching import TokenRows
from stages.train.forward import forward_batch, forward_rows, load_forward_model
from stages.train.models import load_actor_model, load_critic_model
from stages.train.stage import LOGPROBS, ForwardJob, forward_group, run_logprobs, run_values
from stages.storage import Location, read_manifest
from tests.objstore import BUCKET, objects, s3  # noqa: F401  (s3: a local S3 server for this module, a fixture)
from tests.train.tables import advantaged_rows, read_folder, write_table

pytestmark = pytest.mark.usefixtures("ray_cluster")
FORWARD = ForwardConfig(max_tokens_per_microbatch_in_infer=64, rows_per_batch=4, num_actors=2, cpus_per_actor=0.5)
# the tests of what a pass computes (packing, the reference, the critic's values) share one kept group of one rank
# (a training run's way with keep_workers: false, fixture ``kept``): each rank is a process that imports torch,
# transformers and DeepSpeed. A group started for the stage (a stage run on its own: rollflow logprobs, a re-run)
# runs in the command's test (two ranks)
ONE_ACTOR = FORWARD.model_copy(update={"num_actors": 1})


@pytest.fixture(scope="module")
def kept():
    """One kept forward group (one rank) for the module's tests of what a pass computes: it loads each model they
    name (fresh, in place or kept, as in a training run) and is closed at the end."""
    with forward_group(ONE_ACTOR, kept=True) as group:
        yield group


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    table = advantaged_rows(10, lengths=(6, 30), seed=7, multi_turn=True, empty_row=True)
    return write_table(table, tmp_path_factory.mktemp("stage") / "samples", parts=3)


def direct(model, table: pa.Table, kind="log_probs"):
    rows = TokenRows.from_arrow(table, "t", columns=())
    return forward_rows(model.eval(), rows, 10000, kind=kind).columns["values" if kind == "values" else "log_probs"]


def perturbed_copy(source: Path, target: Path, seed: int = 0) -> Path:
    model = load_actor_model(str(source))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=generator))
    model.save_pretrained(target)
    from stages.train.checkpoint import copy_tokenizer

    copy_tokenizer(str(source), str(target))
    return target


def test_packed_log_prob_stage_equals_the_padded_one(tiny_model, samples, tmp_path, kept):
    """use_sequence_packing runs each micro-batch's rows as one row without padding: the same log-probs (within
    float32 rounding) and no padded token in the stage's counters; with attn_implementation fa2 (the packed
    attention, on CPU causal SDPA per row: tests/train/test_forward.py) too."""
    padded = run_logprobs(str(samples), str(tiny_model), ONE_ACTOR, str(tmp_path / "padded"), group=kept)
    packed = run_logprobs(str(samples), str(tiny_model), ONE_ACTOR.model_copy(update={"use_sequence_packing": True}),
                          str(tmp_path / "packed"), group=kept)
    run_logprobs(str(samples), str(tiny_model), ONE_ACTOR.model_copy(update={"use_sequence_packing": True,
                                                                             "attn_implementation": "fa2"}),
                 str(tmp_path / "varlen"), group=kept)
    fused = run_logprobs(str(samples), str(tiny_model), ONE_ACTOR.model_copy(
        update={"use_sequence_packing": True, "fused_output_layer": True}), str(tmp_path / "fused"), group=kept)
    a, b, c = (read_folder(tmp_path / name) for name in ("padded", "packed", "varlen"))
    assert a.column("row_id").to_pylist() == b.column("row_id").to_pylist() == c.column("row_id").to_pylist()
    for x, y, z in zip(*(t.column("old_log_probs").to_pylist() for t in (a, b, c))):
        np.testing.assert_allclose(y, x, atol=2e-5)
        np.testing.assert_allclose(z, x, atol=2e-5)
    assert packed.metrics["logprobs/padded_tokens"] == packed.metrics["logprobs/tokens"]
    assert padded.metrics["logprobs/padded_tokens"] > padded.metrics["logprobs/tokens"]
    # logprobs.fused_output_layer reaches the kept group: every micro-batch fused (the values: test_forward.py)
    assert fused.metrics["logprobs/fused_micro_batches"] >= 1 and "logprobs/fused_micro_batches" not in packed.metrics
    assert fused.fingerprint == packed.fingerprint  # the same values up to float32 rounding: not in the fingerprint
    for x, y in zip(b.column("old_log_probs").to_pylist(), read_folder(tmp_path / "fused").column("old_log_probs")
                    .to_pylist()):
        np.testing.assert_allclose(y, x, atol=2e-5)


def one_rank(checkpoint: Path, table: pa.Table, cfg: ForwardConfig, counters: Path) -> pa.Table:
    """What ONE rank of ``rollflow logprobs`` writes (stages/train/actor_forward.py forward_on_rank), computed in this
    process: the checkpoint loaded as a worker loads it, the rows in batches of ``rows_per_batch`` from the first,
    each through :func:`stages.train.forward.forward_batch`, on the rank's torch threads."""
    job = ForwardJob("log_probs", str(checkpoint), "old_log_probs", ("ref_log_probs",), entropy=cfg.compute_entropy)
    model = load_forward_model(str(checkpoint), "log_probs", cfg.dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.torch_threads())
    try:
        return pa.concat_tables([forward_batch([model], [job], table.slice(i, cfg.rows_per_batch),
                                               cfg.max_tokens_per_microbatch_in_infer, Location.of(str(counters)),
                                               LOGPROBS, "t") for i in range(0, table.num_rows, cfg.rows_per_batch)])
    finally:
        torch.set_num_threads(threads)


def test_logprobs_command_on_two_ranks_adds_ragged_columns_in_row_order_equal_to_one_rank_and_skips_when_done(
        tiny_model, samples, tmp_path):
    """``rollflow logprobs`` with num_actors: 2 (an actor group of two ranks, started for the command): the columns
    in row order, equal to a single pass, and to the table of ONE rank (:func:`one_rank`) within float32 rounding
    (atol 2e-5: a rank batches its own slice of the rows, so a row's micro-batch can differ) and bit for bit on the
    rows whose batch is the same on both (rank 0's first batch); the same command again is up to date."""
    cfg = FORWARD.model_copy(update={"compute_entropy": True})
    config = tmp_path / "forward.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    args = ["logprobs", "--samples", str(samples), "--checkpoint", str(tiny_model), "--config", str(config),
            "--output", str(tmp_path / "lp")]
    done = CliRunner().invoke(cli(), args)
    assert done.exit_code == 0, done.output
    out = read_folder(tmp_path / "lp")
    table = read_folder(samples)
    assert out.column("row_id").to_pylist() == table.column("row_id").to_pylist()
    assert set(table.column_names) < set(out.column_names)
    want = direct(load_actor_model(str(tiny_model)), table)
    old = out.column("old_log_probs").to_pylist()
    for b in range(table.num_rows):
        np.testing.assert_allclose(old[b], want.row(b), atol=2e-5)
    assert out.column("ref_log_probs").to_pylist() == old  # reference = checkpoint: computed once, copied
    lengths = np.array([len(r) for r in table.column("input_ids").to_pylist()])
    assert [len(e) for e in out.column("entropy").to_pylist()] == (lengths - 1).tolist()
    single = one_rank(tiny_model, table, cfg, tmp_path / "one-rank")
    assert single.column_names == out.column_names
    for name in ("old_log_probs", "entropy"):
        for b, (x, y) in enumerate(zip(out.column(name).to_pylist(), single.column(name).to_pylist())):
            np.testing.assert_allclose(x, y, atol=2e-5, err_msg=f"{name} row {b}")
    same_batch = cfg.rows_per_batch  # rank 0's first batch is one rank's first batch too
    assert out.slice(0, same_batch).equals(single.slice(0, same_batch))
    assert read_manifest(Location.of(str(tmp_path / "lp")))["metrics"]["logprobs/tokens"] == lengths.sum()
    again = CliRunner().invoke(cli(), args)
    assert again.exit_code == 0 and "up to date, skipped" in again.output, again.output
    # a group the cluster cannot place even when idle is refused before it starts (not after placement_timeout_s)
    big = CliRunner().invoke(cli(), [*args[:-1], str(tmp_path / "lp-big"), "--set", "num_actors=64"])
    assert big.exit_code == 2 and "num_actors=64 workers of cpus_per_actor=0.5 CPUs need 32 CPUs" in big.output, \
        big.output
    assert not (tmp_path / "lp-big").exists()
    # where the passes run is not part of the output: with the same oversized group, the output is up to date
    done = CliRunner().invoke(cli(), [*args, "--set", "num_actors=64"])
    assert done.exit_code == 0 and "up to date, skipped" in done.output, done.output


def test_reference_model_is_run_separately(tiny_model, samples, tmp_path, kept):
    reference = perturbed_copy(tiny_model, tmp_path / "ref")
    run_logprobs(str(samples), str(tiny_model), ONE_ACTOR, str(tmp_path / "lp"), reference=str(reference),
                 group=kept)
    out = read_folder(tmp_path / "lp")
    want = direct(load_actor_model(str(reference)), read_folder(samples))
    refs = out.column("ref_log_probs").to_pylist()
    assert refs != out.column("old_log_probs").to_pylist()
    for b, r in enumerate(refs):
        np.testing.assert_allclose(r, want.row(b), atol=2e-5)
    no_ref = ONE_ACTOR.model_copy(update={"enable_reference": False})
    run_logprobs(str(samples), str(tiny_model), no_ref, str(tmp_path / "lp2"), group=kept)
    assert "ref_log_probs" not in pq.read_schema(next((tmp_path / "lp2").glob("*.parquet"))).names


def test_bad_input_fails_before_writing(tiny_model, samples, tmp_path):
    bad = write_table(read_folder(samples).drop_columns(["response_mask"]), tmp_path / "bad")
    with pytest.raises(SchemaError, match="response_mask"):
        run_logprobs(str(bad), str(tiny_model), FORWARD, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(SchemaError, match="not a Hugging Face model folder"):
        run_logprobs(str(samples), str(tmp_path), FORWARD, str(tmp_path / "out"))
    # two ranks of 2 CPUs each, on the test cluster's 2 CPUs: refused before any starts, with the fix
    with pytest.raises(PlanError, match=r"num_actors=2 workers of cpus_per_actor=2 CPUs need 4 CPUs and the "
                                        r"cluster has 2, .*lower num_actors or cpus_per_actor \(to at most 1 each\)"):
        run_logprobs(str(samples), str(tiny_model), FORWARD.model_copy(update={"cpus_per_actor": 2.0}),
                     str(tmp_path / "out"))
    with pytest.raises(PlanError, match=r"num_actors=2 workers of 1 GPU each do not fit the cluster's 0 GPU\(s\), .*"
                                        r"set device=cpu"):
        run_logprobs(str(samples), str(tiny_model), FORWARD.model_copy(update={"device": "cuda"}),
                     str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# The log-prob stage's group of device: cuda ranks on a Ray cluster that declares a logical GPU (placed, then a clear
# error without CUDA) is checked on the one-GPU cluster of tests/flows/test_plan.py, which starts one anyway.


def test_values_stage_uses_a_seeded_new_critic_before_training(tiny_model, samples, tmp_path, kept):
    result = run_values(str(samples), str(tiny_model), ONE_ACTOR.model_copy(update={"seed": 9}), str(tmp_path / "v"),
                        group=kept)
    out = read_folder(tmp_path / "v")
    want = direct(load_critic_model(None, str(tiny_model), seed=9), read_folder(samples), "values")
    for b, v in enumerate(out.column("values").to_pylist()):
        np.testing.assert_allclose(v, want.row(b), atol=2e-5)
    assert result.rows == 10


def cli() -> typer.Typer:
    from flows.cli import app

    return app


@pytest.mark.slow
def test_train_step_cli_on_two_workers_skips_prunes_and_reports_worker_errors(tiny_model, samples, tmp_path, s3):
    """The checkpoints go to an object store (a local S3 server, tests/objstore.py; docs/object-storage.md): DeepSpeed
    writes into a local staging folder that is uploaded under the manifest, the second step downloads the first
    (weights and DeepSpeed state) to continue from it, and pruning deletes on the store. The failing step runs on
    one worker (``--set runtime.num_workers=1``): the error is a worker's whatever the group's size, and each
    worker the command starts is a process that imports torch and DeepSpeed (~6 CPU-s)."""
    config = tmp_path / "train.yaml"
    config.write_text("adv_estimator: grpo\nppo_epochs: 2\nactor_train:\n  training_args:\n"
                      "    learning_rate: 1.0e-3\n    per_device_train_batch_size: 2\n"
                      "  max_tokens_per_microbatch_in_train: 64\nruntime:\n  num_workers: 2\n")
    runner, app = CliRunner(), cli()
    args = ["train-step", "--samples", str(samples), "--config", str(config)]
    ck = f"s3://{BUCKET}/ck"
    first = runner.invoke(app, args + ["--checkpoint", str(tiny_model), "--output", f"{ck}/s1"])
    assert first.exit_code == 0, first.output
    assert "step 1" in first.output and "actor/pg_loss" in first.output
    manifest = read_manifest(Location.of(f"{ck}/s1"))
    assert manifest["state"]["world_size"] == 2 and manifest["rows"] == 10
    assert sorted(objects(f"{ck}/s1")) == sorted(["manifest.json", *(o["name"] for o in manifest["objects"])])
    assert any("/deepspeed/actor/" in o["name"] for o in manifest["objects"]), "DeepSpeed's state was uploaded"
    again = runner.invoke(app, args + ["--checkpoint", str(tiny_model), "--output", f"{ck}/s1"])
    assert again.exit_code == 0 and "skipped" in again.output

    second = runner.invoke(app, args + ["--checkpoint", f"{ck}/s1", "--output", f"{ck}/s2", "--set",
                                        "max_ckpt_to_keep=1"])
    assert second.exit_code == 0, second.output
    assert "step 2" in second.output  # it continued from s1's downloaded state
    assert read_manifest(Location.of(f"{ck}/s2"))["inputs"]["checkpoint"]["fingerprint"] == manifest["fingerprint"]
    assert {name.split("/")[0] for name in objects(ck)} == {"s2"}  # the older checkpoint was pruned

    table = read_folder(samples)
    broken = table.set_column(table.schema.get_field_index("advantages"), "advantages",
                              pa.array([[0.5]] * table.num_rows, pa.list_(pa.float32())))
    bad = write_table(broken, tmp_path / "broken")
    failed = runner.invoke(app, ["train-step", "--samples", str(bad), "--config", str(config), "--checkpoint",
                                 str(tiny_model), "--output", str(tmp_path / "ck" / "bad"), "--set",
                                 "runtime.num_workers=1"])
    assert failed.exit_code == 2 and "'advantages'" in failed.output, failed.output
    assert not (tmp_path / "ck" / "bad").exists()
    big = runner.invoke(app, args + ["--checkpoint", str(tiny_model), "--output", str(tmp_path / "ck" / "big"),
                                     "--set", "runtime.num_workers=64"])
    assert big.exit_code == 2 and "runtime.num_workers=64 workers of runtime.cpus_per_worker=1 CPUs need 64 " \
        "CPUs" in big.output and "join a larger cluster (RAY_ADDRESS)" in big.output, big.output
    assert not (tmp_path / "ck" / "big").exists()
