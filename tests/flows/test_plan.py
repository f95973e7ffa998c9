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
from flows.runkit import check_plan, run_plan
from schemas.config import load_config_data, validate_config
from schemas.errors import RollflowError
from stages.plan import (DEFAULT_MODEL_SHAPE, PHASES, parameter_count, training_bytes_per_parameter)

REPO = Path(__file__).resolve().parents[2]
TRAINING_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if "train" in p.stem)
GPU_CONFIGS = [p for p in TRAINING_CONFIGS if p.stem.endswith("_h100")]


def load(path: Path | str, **overrides):
    data = load_config_data(path, overrides)
    return validate_config(pipeline_of(data, str(path)).config_model(), data, str(path))


def test_the_shipped_training_configs_are_found():
    names = {p.name for p in TRAINING_CONFIGS}
    assert {"train_frozenlake_quickstart.yaml", "rlvr_train_math.yaml", "train_frozenlake_grpo_h100.yaml",
            "train_sokoban_gigpo_h100.yaml"} <= names
    assert len(GPU_CONFIGS) == 2


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_training_config_fits_the_resources_it_names(path):
    """CPU configs on this 2-CPU machine (or the CPUs their runtime names); the _h100 configs on a 2-GPU machine
    with the CPUs of the lent H100 machines (16)."""
    config = load(path)
    gpu = path in GPU_CONFIGS
    resources = {"CPU": 16.0, "GPU": 2.0} if gpu else {"CPU": float(config.runtime.num_cpus or 2), "GPU": 0.0}
    plan = run_plan(config, resources)
    assert plan.fits, "\n".join(plan.lines() + plan.problems)
    check_plan(config, resources)  # what start_run does: no error
    assert plan.gpus_needed() == (2.0 if gpu else 0.0)


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_a_one_gpu_cluster_is_refused_for_a_plan_that_needs_two_with_the_fix(path):
    config = load(path)
    plan = run_plan(config, {"CPU": 16.0, "GPU": 1.0})
    assert not plan.fits
    with pytest.raises(RollflowError) as err:
        check_plan(config, {"CPU": 16.0, "GPU": 1.0})
    text = str(err.value)
    for phrase in ("the run needs 2 GPUs of Ray's 1", "generation engines 1 (1 x 1, whole run)",
                   "training workers (GPUs) 1", "cannot share a GPU between generation and training",
                   "rollout.engine.num_gpus_per_engine: 0", "train.runtime.use_gpu: false",
                   "with 2 GPUs", "rollflow plan --gpus 2"):
        assert phrase in text, text
    # either fix makes it fit
    assert run_plan(load(path, **{"rollout.engine.num_gpus_per_engine": 0}), {"CPU": 16.0, "GPU": 1.0}).fits
    assert run_plan(load(path, **{"train.runtime.use_gpu": False}), {"CPU": 16.0, "GPU": 1.0}).fits


def test_a_training_group_per_step_still_needs_its_gpu_beside_the_engines():
    """keep_workers: false holds the GPU during the training step only, but the engine holds its GPU all along."""
    config = load(GPU_CONFIGS[0], **{"train.runtime.keep_workers": False})
    plan = run_plan(config, {"CPU": 16.0, "GPU": 1.0})
    assert not plan.fits and "training workers 1 (1 x 1, during training step)" in plan.problems[0]
    assert run_plan(config, {"CPU": 16.0, "GPU": 2.0}).fits


def test_gpu_shares_are_packed_as_ray_places_them():
    """Three engines of 0.6 GPU sum to 1.8 but need three GPUs: a fraction must fit in what is left of one GPU."""
    config = load(GPU_CONFIGS[0], **{"rollout.engine.num_engines": 3, "rollout.engine.num_gpus_per_engine": 0.6,
                                     "train.runtime.use_gpu": False})
    plan = run_plan(config, {"CPU": 16.0, "GPU": 2.0})
    assert not plan.fits and "cannot be packed onto 2 GPUs" in plan.problems[0]
    assert run_plan(config, {"CPU": 16.0, "GPU": 3.0}).fits
    halves = load(GPU_CONFIGS[0], **{"rollout.engine.num_engines": 2, "rollout.engine.num_gpus_per_engine": 0.5})
    plan = run_plan(halves, {"CPU": 16.0, "GPU": 2.0})
    assert plan.fits and "GPU 0" in "\n".join(plan.lines())


def test_cuda_forward_workers_and_an_llm_judge_count_as_held_for_the_whole_run():
    config = load(GPU_CONFIGS[0], **{"logprobs.device": "cuda", "logprobs.gpus_per_actor": 0.5})
    assert run_plan(config, {"CPU": 16.0, "GPU": 2.0}).gpus_needed() == 2.5
    judged = load(REPO / "configs/rlvr_train_math.yaml", **{"rewards.routes.math": {"worker": "llm_judge"},
                                                           "judge.engine.num_cpus_per_engine": 1})
    plan = run_plan(judged, {"CPU": 2.0, "GPU": 0.0})
    assert not plan.fits and "engines hold 1 for the whole run" in plan.problems[0]
    assert "LLM judge engines" in "\n".join(plan.lines())


def test_a_cpu_plan_that_does_not_fit_names_the_fix():
    config = load(REPO / "configs/train_frozenlake_quickstart.yaml", **{"logprobs.cpus_per_actor": 2})
    with pytest.raises(RollflowError, match=r"needs 2\.5 CPUs of Ray's 2: .* logprobs\.cpus_per_actor"):
        check_plan(config, {"CPU": 2.0, "GPU": 0.0})


def test_memory_formula():
    assert parameter_count(DEFAULT_MODEL_SHAPE) == 134_515_008  # SmolLM2-135M
    assert training_bytes_per_parameter("bf16", 0, 1, lora=False) == 16  # ZeRO paper: 2 + 2 + 12
    assert training_bytes_per_parameter("fp32", 0, 4, lora=False) == 16  # 4 + 4 + 8
    assert training_bytes_per_parameter("bf16", 2, 2, lora=False) == 2 + 14 / 2
    assert training_bytes_per_parameter("bf16", 1, 2, lora=False) == 2 + 2 + 12 / 2
    assert training_bytes_per_parameter("bf16", 2, 2, lora=True) == 2


def test_pinned_stages_hold_their_custom_resources_in_the_plan():
    """runtime.stage_resources: kept forward and training workers hold theirs for the whole run, the reward and
    advantage tasks during their phase; a cluster without the resource, or with too little, is refused with the fix."""
    from stages.plan import custom_needed

    pins = {"logprobs": {"head_node": 1}, "train_step": {"trainer_node": 1}, "advantages": {"head_node": 0.5}}
    config = load(REPO / "configs/train_frozenlake_quickstart.yaml", **{"runtime.stage_resources": pins,
                                                                       "train.runtime.num_workers": 2})
    plan = run_plan(config, {"CPU": 2.0, "GPU": 0.0, "head_node": 1.5, "trainer_node": 2.0})
    assert plan.fits, plan.problems
    assert custom_needed(plan) == {"head_node": 1.5, "trainer_node": 2.0}  # 1 kept + 0.5 task; 2 workers x 1
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
    fits = runner.invoke(app, ["plan", "--config", h100, "--cpus", "16", "--gpus", "2"])
    assert fits.exit_code == 0, fits.output
    assert "fits: yes" in fits.output and "GPU 0" in fits.output and "GPU 1" in fits.output
    refused = runner.invoke(app, ["plan", "--config", h100, "--cpus", "16", "--gpus", "1"])
    assert refused.exit_code == 2, refused.output
    assert "fits: no" in refused.output and "error: the run needs 2 GPUs of Ray's 1" in refused.output
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


# ---- item 5: the verdict against a real Ray cluster declaring logical GPUs ---------------------------------------

RAY_CHILD = """
import json, sys
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from flows.runkit import run_plan
from stages.plan import PHASES
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
    # the flow's order: what is held for the whole run first, then each stage's share, released after it
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

ray.init(num_cpus=2, num_gpus=2, resources={"trainer_node": 2}, include_dashboard=False, log_to_driver=False)
results = {}
for name, (path, overrides, gpus_taken) in RAY_CASES.items():
    blocker = placement_group([{"GPU": 1}] * gpus_taken) if gpus_taken else None  # a one-GPU cluster from a 2-GPU one
    if blocker is not None:
        ray.get(blocker.ready(), timeout=30)
    resources = dict(ray.cluster_resources())
    resources["GPU"] -= gpus_taken  # what the blocker left (the available view of Ray is updated asynchronously)
    plan = run_plan(load(path, **overrides), resources)
    results[name] = {"plan": plan.fits, "ray": scheduled(plan, 2.0 if not plan.fits else 20.0),
                     "gpus": resources.get("GPU", 0.0), "problems": plan.problems}
    if blocker is not None:
        remove_placement_group(blocker)
print("RESULTS " + json.dumps(results))
ray.shutdown()
"""

_SMALL_CPU = {"rollout.engine.num_cpus_per_engine": 0, "train.runtime.cpus_per_worker": 1}
RAY_CASES = {  # name -> (config, overrides, GPUs taken away first), on a cluster of 2 CPUs and 2 logical GPUs
    "h100-on-2-gpus": (str(REPO / "configs/train_frozenlake_grpo_h100.yaml"), _SMALL_CPU, 0),
    "sokoban-h100-on-2-gpus": (str(REPO / "configs/train_sokoban_gigpo_h100.yaml"), _SMALL_CPU, 0),
    "h100-on-1-gpu": (str(REPO / "configs/train_sokoban_gigpo_h100.yaml"), _SMALL_CPU, 1),
    "h100-3-engines-on-2-gpus": (str(REPO / "configs/train_sokoban_gigpo_h100.yaml"),
                                 {**_SMALL_CPU, "rollout.engine.num_engines": 2}, 0),
    "fractions-that-do-not-pack": (str(REPO / "configs/train_frozenlake_grpo_h100.yaml"),
                                   {**_SMALL_CPU, "rollout.engine.num_engines": 3,
                                    "rollout.engine.num_gpus_per_engine": 0.6, "train.runtime.use_gpu": False}, 0),
    "quickstart-cpu": (str(REPO / "configs/train_frozenlake_quickstart.yaml"), {}, 0),
    "quickstart-too-many-cpus": (str(REPO / "configs/train_frozenlake_quickstart.yaml"),
                                 {"logprobs.cpus_per_actor": 2}, 0),
    # runtime.stage_resources on a cluster declaring 2 trainer_node: kept workers hold theirs for the whole run
    "pinned-training": (str(REPO / "configs/train_frozenlake_quickstart.yaml"),
                        {"runtime.stage_resources": {"train_step": {"trainer_node": 1}, "advantages":
                                                     {"trainer_node": 1}}}, 0),
    "pinned-beyond-the-resource": (str(REPO / "configs/train_frozenlake_quickstart.yaml"),
                                   {"runtime.stage_resources": {"train_step": {"trainer_node": 1},
                                                                "logprobs": {"trainer_node": 1},
                                                                "advantages": {"trainer_node": 0.5}}}, 0),
    "pinned-to-a-missing-resource": (str(REPO / "configs/train_frozenlake_quickstart.yaml"),
                                     {"runtime.stage_resources": {"train_step": {"gpu_node": 1}}}, 0),
}
EXPECTED = {"h100-on-2-gpus": True, "sokoban-h100-on-2-gpus": True, "h100-on-1-gpu": False,
            "h100-3-engines-on-2-gpus": False, "fractions-that-do-not-pack": False, "quickstart-cpu": True, "quickstart-too-many-cpus": False,
            "pinned-training": True, "pinned-beyond-the-resource": False, "pinned-to-a-missing-resource": False}


def test_the_plans_verdict_is_what_a_ray_cluster_with_logical_gpus_can_schedule(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", RAY_CHILD], env=env, capture_output=True, text=True,
                          timeout=150, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULTS "):])
    assert results["h100-on-1-gpu"]["gpus"] == 1.0
    for name, want in EXPECTED.items():
        got = results[name]
        assert got["plan"] == want, (name, got)
        assert got["ray"] == got["plan"], (name, got)
    assert "rollflow plan --gpus 2" in results["h100-on-1-gpu"]["problems"][0]
    assert set(PHASES) == {"generation", "log-probs / values", "rewards / advantages", "training step"}
    assert "'gpu_node', which no node of the cluster declares" in results["pinned-to-a-missing-resource"]["problems"][0]
