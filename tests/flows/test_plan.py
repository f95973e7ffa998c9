"""The resource plan of a training run (stages/plan.py, ``rollflow plan``; issue 13 items 2 and 5).

Pure checks of every shipped training config, the one-GPU refusal with its fix, the GPU packing and the memory
formula; the CLI's exit codes; and, on a real local Ray cluster that declares logical GPUs (in a child process, so
the session's cluster is untouched), that the plan's verdict is what Ray can schedule: the run's reservations taken
in the flow's order (held for the whole run first, then each stage's, released after it) are all placed when the plan
fits, and one of them never is when the plan is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.pipelines import pipeline_of
from flows.runkit import KeptWorkers, check_plan, run_plan
from schemas.config import load_config_data, validate_config
from schemas.errors import ConfigError, RollflowError
from stages.plan import DEFAULT_MODEL_SHAPE, PHASES, gpu_shares, parameter_count, training_bytes_per_parameter

REPO = Path(__file__).resolve().parents[2]
TRAINING_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if "train" in p.stem)
GPU_CONFIGS = [p for p in TRAINING_CONFIGS if p.stem.endswith("_h100")]


def load(path: Path | str, **overrides):
    data = load_config_data(path, overrides)
    return validate_config(pipeline_of(data, str(path)).config_model(), data, str(path))


# the shipped GPU configs without their colocation: each role on GPUs of its own (today's reservations before it)
APART = {"rollout.engine.device_mapping": None, "logprobs.device_mapping": None, "train.runtime.device_mapping": None}


def test_the_shipped_training_configs_are_found():
    names = {p.name for p in TRAINING_CONFIGS}
    assert {"train_frozenlake_quickstart.yaml", "rlvr_train_math.yaml", "train_frozenlake_grpo_h100.yaml",
            "train_sokoban_gigpo_h100.yaml"} <= names
    assert len(GPU_CONFIGS) == 2


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_training_config_passes_its_preflight(path):
    """What ``rollflow train`` checks before Prefect and Ray start (the engines' options among it) passes."""
    data = load_config_data(path, {})
    pipeline = pipeline_of(data, str(path))
    pipeline.preflight(validate_config(pipeline.config_model(), data, str(path)), False)


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_training_config_fits_the_resources_it_names(path):
    """CPU configs on this 2-CPU machine (or the CPUs their runtime names); the _h100 configs on one GPU (the
    engine and training workers colocated: half of GPU 0 each; the training workers compute the log-probs and values,
    issue 44) with the CPUs of the lent H100 machines
    (16), and on two."""
    config = load(path)
    gpu = path in GPU_CONFIGS
    for gpus in (1.0, 2.0) if gpu else (0.0,):
        resources = {"CPU": 16.0 if gpu else float(config.runtime.num_cpus or 2), "GPU": gpus}
        plan = run_plan(config, resources)
        assert plan.fits, "\n".join(plan.lines() + plan.problems)
        check_plan(config, resources)  # what start_run does: no error
    assert plan.gpus_needed() == (1.0 if gpu else 0.0)
    if gpu:
        assert gpu_shares(config) == {"engine": 0.5, "forward": 0.0, "train": 0.5}
        assert "policy copies on the GPUs: 2 (generation engines 1, training workers (GPUs) 1)" in plan.lines()
        assert config.rollout.engine.sleep_level >= 1
        assert set(plan.placement.values()) == {"GPU 0"}, plan.lines()


def test_the_shipped_gpu_configs_reserve_the_same():
    """What lets one stage sequence on a Ray cluster (below) stand for every shipped GPU config: the same shares, and
    the same reservations of every stage."""
    plans = [run_plan(load(path), {"CPU": 16.0, "GPU": 1.0}) for path in GPU_CONFIGS]
    reservations = [[(n.stage, n.count, n.cpus, n.gpus, n.phase) for n in plan.needs] for plan in plans]
    assert all(r == reservations[0] for r in reservations), reservations
    assert len({tuple(sorted(gpu_shares(load(path)).items())) for path in GPU_CONFIGS}) == 1


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_one_gpu_is_refused_without_colocation_with_the_colocation_fix(path):
    config = load(path, **APART)
    plan = run_plan(config, {"CPU": 16.0, "GPU": 1.0})
    assert not plan.fits
    with pytest.raises(RollflowError) as err:
        check_plan(config, {"CPU": 16.0, "GPU": 1.0})
    text = str(err.value)
    for phrase in ("the run needs 2 GPUs of Ray's 1", "generation engines 1 (1 x 1, whole run)",
                   "training workers (GPUs) 1", "share a GPU only when colocated",
                   "rollout.engine.device_mapping: [0] and rollout.engine.sleep_level: 1 and "
                   "train.runtime.device_mapping: [0] (colocation",
                   "rollout.engine.num_gpus_per_engine: 0", "train.runtime.use_gpu: false",
                   "with 2 GPUs", "rollflow plan --gpus 2"):
        assert phrase in text, text
    # the log-probs run on the kept training workers (issue 44): no forward workers, and nothing to set for them
    assert "forward workers" not in text and "logprobs." not in text
    # a pinned stage's section is no engine section: no "runtime.stage_resources...num_gpus_per_engine" fix
    assert text.count("num_gpus_per_engine: 0") == 1, text
    # each fix makes it fit: the colocation it names (the shipped config), or a role off the GPU with the others apart
    assert run_plan(load(path), {"CPU": 16.0, "GPU": 1.0}).fits
    assert run_plan(load(path, **{**APART, "rollout.engine.num_gpus_per_engine": 0}), {"CPU": 16.0, "GPU": 1.0}).fits
    assert run_plan(load(path, **APART), {"CPU": 16.0, "GPU": 2.0}).fits


def test_a_training_group_per_step_still_needs_its_gpu_beside_the_engines_unless_colocated():
    """keep_workers: false holds the GPU during the training step only, but an engine apart holds its GPU all along;
    colocated, the step's share is what the sleeping engine and the forward workers leave of GPU 0."""
    config = load(GPU_CONFIGS[0], **{**APART, "logprobs.device": "cpu", "train.runtime.keep_workers": False})
    plan = run_plan(config, {"CPU": 16.0, "GPU": 1.0})
    assert not plan.fits and "training workers 1 (1 x 1, during training step)" in plan.problems[0]
    assert run_plan(config, {"CPU": 16.0, "GPU": 2.0}).fits
    colocated = run_plan(load(GPU_CONFIGS[0], **{"train.runtime.keep_workers": False}), {"CPU": 16.0, "GPU": 1.0})
    assert colocated.fits and colocated.gpus_needed() == 0.9999


def test_an_asynchronous_run_shows_what_runs_at_the_same_time_and_on_what():
    """async_generation_ratio > 0 (issue 46): the plan names the rollout of k+1 with the engines' devices beside
    iteration k's later stages with theirs, and counts the generation's reservations beside each of those stages;
    in turn (0) it prints no such line and needs what it did."""
    in_turn = run_plan(load(GPU_CONFIGS[0], **APART), {"CPU": 16.0, "GPU": 2.0})
    ahead = run_plan(load(GPU_CONFIGS[0], **APART, async_generation_ratio=1), {"CPU": 16.0, "GPU": 2.0})
    line = ("at the same time (async_generation_ratio 1): rollout k+1 (generation engines: GPU 0, generation tasks "
            "(Ray Data): CPU) \u2016 log-probs / values \u2192 rewards / advantages \u2192 training step of k "
            "(log-probs / values (actor): CPU, Ray Data read/write tasks: CPU, training workers (GPUs): GPU 1, "
            "training workers (CPUs): CPU)")
    assert ahead.overlap_line() == line and line in ahead.lines(), ahead.lines()
    two = run_plan(load(GPU_CONFIGS[0], **APART, async_generation_ratio=1.5), {"CPU": 16.0, "GPU": 2.0})
    assert two.overlap_line().startswith("at the same time (async_generation_ratio 1.5): rollouts k+1 .. k+2, one "
                                         "after the other (generation engines: GPU 0, "), two.overlap_line()
    assert in_turn.overlap_line() is None and not [x for x in in_turn.lines() if "at the same time" in x]
    assert ahead.fits and ahead.cpus_needed() == in_turn.cpus_needed() + 0.25  # generation tasks beside training
    assert [x for x in ahead.lines() if "at the same time" not in x and "needs at once" not in x] == \
        [x for x in in_turn.lines() if "needs at once" not in x]
    # the generation's reservations are checked beside the training step's: 6 CPUs do not hold both
    assert run_plan(load(GPU_CONFIGS[0], **APART), {"CPU": 6.0, "GPU": 2.0}).fits
    tight = run_plan(load(GPU_CONFIGS[0], **APART, async_generation_ratio=1), {"CPU": 6.0, "GPU": 2.0})
    assert not tight.fits and "the run needs 6.25 CPUs" in tight.problems[0], tight.problems


def test_gpu_shares_are_packed_as_ray_places_them():
    """Three engines of 0.6 GPU sum to 1.8 but need three GPUs: a fraction must fit in what is left of one GPU."""
    config = load(GPU_CONFIGS[0], **{**APART, "rollout.engine.num_engines": 3, "rollout.engine.num_gpus_per_engine": 0.6,
                                     "train.runtime.use_gpu": False, "logprobs.device": "cpu"})
    plan = run_plan(config, {"CPU": 16.0, "GPU": 2.0})
    assert not plan.fits and "cannot be packed onto 2 GPUs" in plan.problems[0]
    assert run_plan(config, {"CPU": 16.0, "GPU": 3.0}).fits
    halves = load(GPU_CONFIGS[0], **{**APART, "rollout.engine.num_engines": 2, "rollout.engine.num_gpus_per_engine": 0.5,
                                     "logprobs.device": "cpu"})
    plan = run_plan(halves, {"CPU": 16.0, "GPU": 2.0})
    assert plan.fits and "GPU 0" in "\n".join(plan.lines())


PER_STEP = {"train.runtime.keep_workers": False}  # a group per step: the run keeps forward workers of their own


@pytest.mark.parametrize("overrides, shares, gpus", [
    ({}, {"engine": 0.5, "forward": 0.0, "train": 0.5}, 1),  # the kept training workers compute the log-probs
    ({"logprobs.device_mapping": None}, {"engine": 0.5, "forward": 0.0, "train": 0.5}, 1),
    ({"train.runtime.device_mapping": [1]}, {"engine": 1.0, "forward": 0.0, "train": 1.0}, 2),
    ({**APART, "logprobs.gpus_per_actor": 0.25}, {"engine": 1.0, "forward": 0.0, "train": 1.0}, 2),
    (PER_STEP, {"engine": 0.3333, "forward": 0.3333, "train": 0.3333}, 1),
    ({**PER_STEP, "logprobs.device_mapping": None}, {"engine": 0.5, "forward": 1.0, "train": 0.5}, 2),
    ({**PER_STEP, "logprobs.device_mapping": None, "logprobs.device": "cpu"},
     {"engine": 0.5, "forward": 0.0, "train": 0.5}, 1),
    ({**PER_STEP, "train.runtime.device_mapping": [1]}, {"engine": 0.5, "forward": 0.5, "train": 1.0}, 2),
    ({**PER_STEP, **APART, "logprobs.gpus_per_actor": 0.25}, {"engine": 1.0, "forward": 0.25, "train": 1.0}, 3),
    ({"rollout.engine.num_engines": 2, "rollout.engine.device_mapping": "list(range(0,2))",
      "train.runtime.num_workers": 2, "train.runtime.device_mapping": [1, 0], "logprobs.device_mapping": None,
      "logprobs.device": "cpu"}, {"engine": 0.5, "forward": 0.0, "train": 0.5}, 2),
])
def test_colocated_roles_reserve_equal_shares_of_their_gpus(overrides, shares, gpus):
    """ROLL's device_mapping: equal lists share the GPUs equally (two roles: halves; three, with forward workers of
    their own: thirds); a role apart reserves its own; ROLL's list(range(a,b)) spelling is read as the list. The plan fits on ``gpus`` GPUs, not on
    one fewer."""
    config = load(GPU_CONFIGS[0], **overrides)
    assert gpu_shares(config) == shares
    assert run_plan(config, {"CPU": 16.0, "GPU": float(gpus)}).fits
    assert not run_plan(config, {"CPU": 16.0, "GPU": float(gpus - 1)}).fits


@pytest.mark.parametrize("overrides, words", [
    ({"rollout.engine.sleep_level": 0}, ["sleep_level is 0", "share their GPUs with the forward workers and the "
                                         "training workers", "set rollout.engine.sleep_level: 1"]),
    ({"train.runtime.device_mapping": [0, 1], "train.runtime.num_workers": 2},
     ["overlap in part", "make them equal or disjoint"]),
    ({"train.runtime.device_mapping": [0, 1]}, ["lists 2 GPUs but train.runtime.num_workers is 1",
                                               "set train.runtime.num_workers: 2"]),
    ({"logprobs.device": "cpu"}, ["needs logprobs.device: cuda and gpus_per_actor: 1"]),
    ({"train.runtime.use_gpu": False}, ["needs train.runtime.use_gpu: true"]),
    ({"rollout.engine.num_gpus_per_engine": 2}, ["num_gpus_per_engine is 2", "set num_gpus_per_engine: 1"]),
    ({"rollout.engine.device_mapping": [0, 0]}, ["names a GPU more than once"]),
    ({"rollout.engine.device_mapping": "range(2)"}, ["not a list of GPU indexes", "list(range(0,2))"]),
    ({"rollout.engine.device_mapping": []}, ["device_mapping is empty"]),
])
def test_device_mapping_rules_give_the_rule_and_the_fix(overrides, words):
    with pytest.raises(ConfigError) as err:
        load(GPU_CONFIGS[0], **overrides)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_an_rlvr_run_colocates_by_the_same_rules_and_its_judge_is_never_colocated():
    colocated = {"engine.device_mapping": [0], "engine.num_gpus_per_engine": 1, "engine.sleep_level": 1,
                 "train.runtime.use_gpu": True, "train.runtime.num_workers": 1, "train.runtime.device_mapping": [0]}
    config = load(REPO / "configs/rlvr_train_math.yaml", **colocated)
    assert gpu_shares(config) == {"engine": 0.5, "forward": 0.0, "train": 0.5}
    assert run_plan(config, {"CPU": 2.0, "GPU": 1.0}).fits
    with pytest.raises(ConfigError, match="engine.sleep_level is 0"):
        load(REPO / "configs/rlvr_train_math.yaml", **{**colocated, "engine.sleep_level": 0})
    with pytest.raises(ConfigError, match="judge's engine is not colocated"):
        load(REPO / "configs/rlvr_train_math.yaml", **{"judge.engine.sleep_level": 1})


def test_cuda_forward_workers_and_an_llm_judge_count_as_held_for_the_whole_run():
    config = load(GPU_CONFIGS[0], **{**APART, **PER_STEP, "logprobs.gpus_per_actor": 0.5})
    assert run_plan(config, {"CPU": 16.0, "GPU": 2.0}).gpus_needed() == 2.5
    judged = load(REPO / "configs/rlvr_train_math.yaml", **{"rewards.routes.math": {"worker": "llm_judge"},
                                                           "judge.engine.num_cpus_per_engine": 1, **PER_STEP})
    plan = run_plan(judged, {"CPU": 2.0, "GPU": 0.0})
    assert not plan.fits and "engines hold 1 for the whole run" in plan.problems[0]
    assert "LLM judge engines" in "\n".join(plan.lines())


def test_a_run_without_a_kept_training_group_computes_its_log_probs_on_a_kept_forward_group():
    """keep_workers: false: the log-prob and values stages run on a kept group of logprobs' ranks (no engines: models
    loaded beside), which reserves no CPU and the plan's forward GPU share, under train.runtime's limits; with a
    kept training group they run on it (stages/train/stage.py forward_group, flows/runkit.py KeptWorkers)."""
    config = load(GPU_CONFIGS[0], **{**PER_STEP, "logprobs.num_actors": 1, "train.runtime.step_timeout_s": 60})
    workers = KeptWorkers.of(config)
    forward = workers.forward
    assert workers.forward_kwargs() == {"group": forward} and forward is not workers.trainer
    assert forward.keep and forward.section is None and not workers.trainer.keep
    assert (forward.runtime.num_workers, forward.runtime.step_timeout_s) == (1, 60)
    assert forward.worker_resources() == {"CPU": 0, "memory": 64 * 2**20, "GPU": gpu_shares(config)["forward"]}
    kept = KeptWorkers.of(load(GPU_CONFIGS[0]))
    assert kept.forward is None and kept.forward_kwargs() == {"group": kept.trainer}


def test_a_cpu_plan_that_does_not_fit_names_the_fix():
    config = load(REPO / "configs/train_frozenlake_quickstart.yaml", **{"logprobs.cpus_per_actor": 2, **PER_STEP})
    with pytest.raises(RollflowError, match=r"needs 2\.5 CPUs of Ray's 2: .* logprobs\.cpus_per_actor"):
        check_plan(config, {"CPU": 2.0, "GPU": 0.0})


def test_memory_formula():
    assert parameter_count(DEFAULT_MODEL_SHAPE) == 134_515_008  # SmolLM2-135M
    assert training_bytes_per_parameter("bf16", 0, 1, lora=False) == 16  # ZeRO paper: 2 + 2 + 12
    assert training_bytes_per_parameter("fp32", 0, 4, lora=False) == 16  # 4 + 4 + 8
    assert training_bytes_per_parameter("bf16", 2, 2, lora=False) == 2 + 14 / 2
    assert training_bytes_per_parameter("bf16", 3, 2, lora=False) == 16 / 2  # the weights are sharded too
    assert training_bytes_per_parameter("fp32", 3, 1, lora=False) == 16  # nothing to shard over on one worker
    assert training_bytes_per_parameter("bf16", 1, 2, lora=False) == 2 + 2 + 12 / 2
    assert training_bytes_per_parameter("bf16", 2, 2, lora=True) == 2


def test_pinned_stages_hold_their_custom_resources_in_the_plan():
    """runtime.stage_resources: kept forward and training workers hold theirs for the whole run, the reward and
    advantage tasks during their phase; a cluster without the resource, or with too little, is refused with the fix."""
    from stages.plan import custom_needed

    pins = {"train_step": {"trainer_node": 1}, "advantages": {"head_node": 0.5}}  # logprobs: refused, kept workers
    config = load(REPO / "configs/train_frozenlake_quickstart.yaml", **{"runtime.stage_resources": pins,
                                                                       "train.runtime.num_workers": 2})
    plan = run_plan(config, {"CPU": 2.0, "GPU": 0.0, "head_node": 1.5, "trainer_node": 2.0})
    assert plan.fits, plan.problems
    # 0.5 task (the log-probs run on the kept training workers: no forward workers hold head_node); 2 workers x 1
    assert custom_needed(plan) == {"head_node": 0.5, "trainer_node": 2.0}
    text = "\n".join(plan.lines())
    assert "(pinned, trainer_node 1)" in text and "advantages tasks" in text and "1.5 head_node" in text
    short = run_plan(config, {"CPU": 2.0, "GPU": 0.0, "head_node": 1.5, "trainer_node": 1.0})
    assert not short.fits and ("holds 2 of the custom Ray resource 'trainer_node' at once "
                               "(runtime.stage_resources.train_step") in short.problems[0]
    with pytest.raises(RollflowError, match="'head_node', which no node of the cluster declares"):
        check_plan(config, {"CPU": 2.0, "GPU": 0.0, "trainer_node": 2.0})
    unpinned = run_plan(load(REPO / "configs/train_frozenlake_quickstart.yaml"), {"CPU": 2.0})
    assert not custom_needed(unpinned) and "pinned" not in "\n".join(unpinned.lines())


runner = CliRunner()


def test_cli_exit_codes():
    h100 = str(GPU_CONFIGS[0])
    fits = runner.invoke(app, ["plan", "--config", h100, "--cpus", "16", "--gpus", "1"])
    assert fits.exit_code == 0, fits.output
    assert "fits: yes" in fits.output and "shares GPU 0 with train" in fits.output
    assert "policy copies on the GPUs: 2 (generation engines 1, training workers (GPUs) 1)" in fits.output
    apart = [f"{key}=null" for key in APART]
    refused = runner.invoke(app, ["plan", "--config", h100, "--cpus", "16", "--gpus", "1",
                                  *[arg for kv in apart for arg in ("--set", kv)]])
    assert refused.exit_code == 2, refused.output
    assert "fits: no" in refused.output and "error: the run needs 2 GPUs of Ray's 1" in refused.output
    assert runner.invoke(app, ["plan", "--config", h100, "--cpus", "16", "--gpus", "0"]).exit_code == 2
    quick = runner.invoke(app, ["plan", "--config", str(REPO / "configs/train_frozenlake_quickstart.yaml"),
                                "--cpus", "2", "--gpus", "0", "--set", "train.runtime.num_workers=3"])
    assert quick.exit_code == 2 and "training workers 3" in quick.output, quick.output
    pinned = ["plan", "--config", str(REPO / "configs/train_frozenlake_quickstart.yaml"), "--cpus", "2", "--gpus", "0",
              "--set", "runtime.stage_resources={train_step: {trainer_node: 1}}"]
    assert runner.invoke(app, pinned).exit_code == 2
    what_if = runner.invoke(app, [*pinned, "--resources", '{"trainer_node": 1}'])
    assert what_if.exit_code == 0 and "1 trainer_node" in what_if.output, what_if.output
    bad = runner.invoke(app, [*pinned, "--resources", "trainer_node=1"])
    assert bad.exit_code == 2 and "is not a JSON object" in bad.output, bad.output


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu-machine", "cpu-machine"])
def test_make_run_picks_the_gpu_quickstart_on_a_gpu_machine(tmp_path, gpu):
    """``make run`` (dry run) on a machine whose nvidia-smi lists a GPU: the gpu extra's environment and the colocated
    one-GPU FrozenLake run, which the plan accepts on one GPU; elsewhere the CPU quickstart."""
    if gpu:
        (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
        (tmp_path / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "HAS_GPU"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}" if gpu else "/usr/bin:/bin"  # no nvidia-smi on the CPU machine's PATH
    out = subprocess.run(["make", "-n", "run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    train = [line for line in out.stdout.splitlines() if "rollflow train" in line]
    if not gpu:
        assert train == [".venv/bin/rollflow train --config configs/train_frozenlake_quickstart.yaml"], out.stdout
        return
    assert len(train) == 1 and train[0].startswith(".venv-gpu/bin/rollflow train ")
    assert "pip install -r requirements-gpu.lock" in out.stdout and "-qq" not in out.stdout  # locked, errors shown
    args = train[0].split()[2:]
    config = load(args[args.index("--config") + 1], **dict(a.split("=", 1) for a in args[args.index("--config") + 2:]
                                                           if a != "--set"))
    assert config.run_name == "quickstart_gpu" and run_plan(config, {"CPU": 16.0, "GPU": 1.0}).fits


# ---- item 5: the verdict against a real Ray cluster declaring logical GPUs ---------------------------------------

RAY_CHILD = """
import json, os, sys, threading, time
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from flows.runkit import run_plan
from stages.plan import PHASES, gpu_shares
from tests.flows.test_plan import RAY_CASES, load

def bundles(needs):
    out = []
    for n in needs:
        b = {k: v for k, v in (("CPU", n.cpus), ("GPU", n.gpus), *n.custom.items()) if v > 0}
        out += [b] * n.count if b else []
    return out

def acquire(needs, timeout):
    pg = placement_group(bundles(needs), strategy="PACK") if bundles(needs) else None
    if pg is None:
        return None, True
    try:
        ray.get(pg.ready(), timeout=timeout)
        return pg, True
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        return None, False

def scheduled(plan, timeout):
    # the plan's reservations in the flow's order: what is held for the whole run first, then each stage's share,
    # released after it
    held, ok = acquire(plan.resident(), timeout)
    steps = [ok]
    for phase in PHASES if ok else ():
        pg, ok = acquire(plan.during(phase), timeout)
        steps.append(ok)
        if pg is not None:
            remove_placement_group(pg)
    if held is not None:
        remove_placement_group(held)
    return all(steps)

def stage_sequence(config, model, timeout):
    # a run's GPU stages with the reservations the real classes make (their shares from gpu_shares): the engine pool
    # (an hf engine of the tiny model computing on the CPU while it holds its GPU share) generates, sleeps at the
    # config's level, the training workers' bundles (TrainerGroup's worker_resources, one placement-group bundle per
    # worker; they compute the log-probs too: stages.plan.forward_on_actor, issue 44) are placed and released, the
    # engine wakes with the checkpoint loaded in place and generates the same tokens again
    from stages.generation.engines import GenRequest, SamplingSpec
    from stages.rollout.engine_pool import EnginePool
    from stages.train.group import TrainerGroup

    shares, done = gpu_shares(config), []
    engine = config.generation_engine().model_copy(update={"backend": "hf", "dtype": "float32", "options": {
        "device": "cpu"}, "num_cpus_per_engine": 0, "threads": 1})
    pool = EnginePool(engine, model, 64, gpus_per_engine=shares["engine"])
    request = [GenRequest([1, 2, 3], SamplingSpec(max_new_tokens=4, seed=1))]
    try:
        first = pool.generate(request)[0][0].response_token_ids
        done.append("engine resident")
        slept = pool.sleep()
        done.append("engine asleep")
        group = TrainerGroup(config.train_step_config().runtime, gpus_per_worker=shares["train"])
        pg = placement_group([group.worker_resources()] * group.runtime.num_workers, strategy="PACK")
        ray.get(pg.ready(), timeout=timeout)
        remove_placement_group(pg)
        done.append("training workers")
        pool.use_checkpoint(model)
        again = pool.generate(request)[0][0].response_token_ids
        done.append("engine awake")
        return {"steps": done, "same_tokens": first == again, "slept": slept,
                "transitions": pool.actor_info()[0]["transitions"], "shares": shares}
    finally:
        pool.close()

def no_cuda_error(samples, model, out):
    # the log-prob stage run on its own (its own actor group, not the kept workers) with device: cuda on this
    # cluster: two ranks of half a GPU are placed (no wait for a GPU) and refuse the pass in a process without CUDA,
    # committing nothing
    from schemas.train_config import ForwardConfig
    from stages.ray_errors import unwrap_error
    from stages.train.stage import run_logprobs

    config = ForwardConfig(max_tokens_per_microbatch_in_infer=64, rows_per_batch=4, num_actors=2, cpus_per_actor=0.5,
                           device="cuda", gpus_per_actor=0.5)
    try:
        run_logprobs(samples, model, config, out)
        return "ran"
    except Exception as err:
        err = unwrap_error(err)
        return f"{type(err).__name__} {err}"

def bounded(fn, timeout, *args):
    # fails rather than hangs: a stage that waits for a GPU share past the timeout ends the child with the steps done
    out = {}
    worker = threading.Thread(target=lambda: out.update(result=fn(*args)), daemon=True)
    worker.start()
    worker.join(timeout)
    return out.get("result", {"hung": True})

def free_of(held):
    # the cluster's resources less the GPUs a placement group holds back, without the groups' own resource names
    free = {k: v for k, v in ray.cluster_resources().items() if "_group_" not in k}
    free["GPU"] = free.get("GPU", 0.0) - held
    return free

# one cluster of 2 logical GPUs (a cluster start costs about 10 CPU-s): for the 1-GPU cases a placement group holds
# one GPU back, so Ray can place work on the other alone, and the plan is made for the resources left
model, samples, out, results = sys.argv[1], sys.argv[2], sys.argv[3], {}
ray.init(num_cpus=2, num_gpus=2, resources={"trainer_node": 2}, include_dashboard=False, log_to_driver=False)
for gpus in (1, 2):
    blocker = placement_group([{"GPU": 1.0}]) if gpus == 1 else None
    if blocker is not None:
        ray.get(blocker.ready(), timeout=60)
    for name, (path, overrides, cluster_gpus, sequence) in RAY_CASES.items():
        if cluster_gpus != gpus:
            continue
        config = load(path, **overrides)
        free = free_of(2.0 - gpus)
        plan = run_plan(config, free)
        results[name] = {"plan": plan.fits, "ray": scheduled(plan, 2.0 if not plan.fits else 20.0),
                         "gpus": free["GPU"], "problems": plan.problems}
        if sequence:
            results[name]["sequence"] = bounded(stage_sequence, 120.0, config, model, 60.0)
            if results[name]["sequence"].get("hung"):
                break
    if gpus == 1 and samples:
        results["no-cuda"] = bounded(no_cuda_error, 200.0, samples, model, out)
    if blocker is not None:
        remove_placement_group(blocker)
ray.shutdown()
print("RESULTS " + json.dumps(results))
"""

_SMALL_CPU = {"rollout.engine.num_cpus_per_engine": 0, "train.runtime.cpus_per_worker": 1}
_FROZENLAKE_H100, _SOKOBAN_H100 = (str(REPO / "configs/train_frozenlake_grpo_h100.yaml"),
                                   str(REPO / "configs/train_sokoban_gigpo_h100.yaml"))
_QUICK = str(REPO / "configs/train_frozenlake_quickstart.yaml")
# name -> (config, overrides, logical GPUs of the cluster, whether the stage sequence of the real classes runs); the
# clusters have 2 CPUs. The real sequence runs once, on one GPU (the tight case): the shipped GPU configs reserve the
# same (test_the_shipped_gpu_configs_reserve_the_same), so one sequence stands for both; every case's reservations
# are placed in the flow's order by scheduled().
RAY_CASES = {
    "frozenlake-h100-on-1-gpu": (_FROZENLAKE_H100, _SMALL_CPU, 1, True),
    "sokoban-h100-on-1-gpu": (_SOKOBAN_H100, _SMALL_CPU, 1, False),
    "frozenlake-h100-apart-on-1-gpu": (_FROZENLAKE_H100, {**_SMALL_CPU, **APART}, 1, False),
    "quickstart-cpu": (_QUICK, {}, 1, False),
    "quickstart-too-many-cpus": (_QUICK, {**PER_STEP, "logprobs.cpus_per_actor": 2}, 1, False),
    "frozenlake-h100-on-2-gpus": (_FROZENLAKE_H100, _SMALL_CPU, 2, False),
    "sokoban-h100-on-2-gpus": (_SOKOBAN_H100, _SMALL_CPU, 2, False),
    "sokoban-h100-apart-on-2-gpus": (_SOKOBAN_H100, {**_SMALL_CPU, **APART, **PER_STEP}, 2, False),
    "fractions-that-do-not-pack": (_FROZENLAKE_H100, {**_SMALL_CPU, **APART, "rollout.engine.num_engines": 3,
                                                      "rollout.engine.num_gpus_per_engine": 0.6,
                                                      "train.runtime.use_gpu": False, "logprobs.device": "cpu"}, 2,
                                   False),
    # runtime.stage_resources on a cluster declaring 2 trainer_node: kept workers hold theirs for the whole run
    "pinned-training": (_QUICK, {"runtime.stage_resources": {"train_step": {"trainer_node": 1},
                                                             "advantages": {"trainer_node": 1}}}, 1, False),
    "pinned-beyond-the-resource": (_QUICK, {"runtime.stage_resources": {"train_step": {"trainer_node": 1},
                                                                        "advantages": {"trainer_node": 2}}}, 1, False),
    "pinned-to-a-missing-resource": (_QUICK, {"runtime.stage_resources": {"train_step": {"gpu_node": 1}}}, 1, False),
}
EXPECTED = {"frozenlake-h100-on-1-gpu": True, "sokoban-h100-on-1-gpu": True, "frozenlake-h100-apart-on-1-gpu": False,
            "quickstart-cpu": True, "quickstart-too-many-cpus": False, "frozenlake-h100-on-2-gpus": True,
            "sokoban-h100-on-2-gpus": True, "sokoban-h100-apart-on-2-gpus": False, "fractions-that-do-not-pack": False,
            "pinned-training": True, "pinned-beyond-the-resource": False, "pinned-to-a-missing-resource": False}


def test_the_plans_verdict_is_what_a_ray_cluster_with_logical_gpus_can_schedule(tiny_model, tmp_path):
    """Clusters of 1 and 2 logical GPUs (one cluster of 2; a placement group holds one GPU back for the 1-GPU cases):
    every shipped GPU config fits and its reservations are placed in the flow's order; on one GPU the stage sequence
    with the real classes (the engine resident with its share, asleep while the training workers (which compute the
    log-probs too) take theirs, awake again with the same tokens) runs to the end within the timeout; each refused
    plan is one Ray cannot place either, and says so with the fix. On the same one-GPU cluster (without CUDA) the
    log-prob stage run on its own, a group of two device: cuda ranks of half a GPU, is placed and refuses the pass
    with the fix, committing nothing."""
    import torch

    from tests.train.tables import advantaged_rows, write_table

    samples = "" if torch.cuda.is_available() else str(write_table(advantaged_rows(
        10, lengths=(6, 30), seed=7, multi_turn=True, empty_row=True), tmp_path / "samples", parts=3))
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", RAY_CHILD, str(tiny_model), samples, str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=500, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULTS "):])
    if samples:
        no_cuda = results.pop("no-cuda")
        assert "ConfigError device: cuda, but this process" in no_cuda and "set device: cpu" in no_cuda, no_cuda
        assert not (tmp_path / "out").exists()
    assert set(results) == set(EXPECTED), sorted(results)
    for name, want in EXPECTED.items():
        got = results[name]
        assert got["gpus"] == RAY_CASES[name][2], (name, got)
        assert got["plan"] == want, (name, got)
        assert got["ray"] == got["plan"], (name, got)
    for name in (n for n, case in RAY_CASES.items() if case[3]):
        sequence = results[name]["sequence"]
        assert sequence.get("steps") == ["engine resident", "engine asleep", "training workers", "engine awake"], (
            name, sequence)
        assert sequence["shares"] == {"engine": 0.5, "forward": 0.0, "train": 0.5}
        assert sequence["transitions"] == ["sleep2", "wake"] and sequence["same_tokens"], (name, sequence)
        assert sequence["slept"]["engine/released_gib"] > 0  # level 2 discards the weights, also on the CPU
    assert "rollout.engine.device_mapping: [0]" in results["frozenlake-h100-apart-on-1-gpu"]["problems"][0]
    assert "rollflow plan --gpus 3" in results["sokoban-h100-apart-on-2-gpus"]["problems"][0]
    assert set(PHASES) == {"generation", "log-probs / values", "rewards / advantages", "training step"}
    assert "'gpu_node', which no node of the cluster declares" in results["pinned-to-a-missing-resource"]["problems"][0]


def test_a_commands_worker_group_that_the_cluster_cannot_place_is_named_with_the_fix():
    """stages/plan.py group_fit_problems (rollflow train-step / logprobs / values, before the group starts): CPUs
    summed over the workers, GPU shares packed as Ray places them; a group that fits gives no problem."""
    from stages.plan import group_fit_problems

    fields = ("runtime.num_workers", "runtime.cpus_per_worker", "runtime.use_gpu", "runtime.use_gpu=false")
    assert group_fit_problems(2, 1.0, 0.0, {"CPU": 2.0}, fields) == []
    assert group_fit_problems(2, 0.5, 1.0, {"CPU": 1.0, "GPU": 2.0}, fields) == []
    assert group_fit_problems(3, 0.5, 0.5, {"CPU": 2.0, "GPU": 2.0}, fields) == []  # halves share a GPU
    (cpu,) = group_fit_problems(3, 1.0, 0.0, {"CPU": 2.0}, fields)
    assert "runtime.num_workers=3 workers of runtime.cpus_per_worker=1 CPUs need 3 CPUs and the cluster has 2" in cpu
    assert "lower runtime.num_workers or runtime.cpus_per_worker (to at most 0.666667 each)" in cpu
    (gpu,) = group_fit_problems(2, 1.0, 0.6, {"CPU": 4.0, "GPU": 1.0}, fields)  # 0.6 + 0.6 > one GPU
    assert "2 workers of 0.6 GPU each do not fit the cluster's 1 GPU(s)" in gpu and "set runtime.use_gpu=false" in gpu
    assert len(group_fit_problems(2, 2.0, 1.0, {"CPU": 2.0}, fields)) == 2
