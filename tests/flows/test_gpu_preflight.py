"""The GPU pre-flight (stages/gpu_preflight.py): each way a fresh GPU host fails a first run is one problem with the
fix, found before anything starts. The host is given as data (a faked driver, capability, free memory, nvcc), the
run's needs come from the shipped H100 config and its real resource plan."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.pipelines import pipeline_of
from flows.runkit import run_plan
from schemas.config import load_config_data, validate_config
from stages.gpu_preflight import Gpu, GpuNeeds, HostProbe, check_run, needs_of, parse_nvidia_smi, problems
from stages.plan import PlanError, make_plan

REPO = Path(__file__).resolve().parents[2]
H100_CONFIG = REPO / "configs/train_frozenlake_grpo_h100.yaml"
H100 = Gpu(0, "NVIDIA H100 80GB HBM3", (9, 0), 79.6, 79.1)
GOOD = HostProbe(driver="580.65.06", gpus=(H100,), torch_cuda="13.0", torch_sees_cuda=True, nvcc=None,
                 compile_missing=None, fused_adam_built=False)
NEEDS = GpuNeeds(gpus=1, memory_gib=4.0, bf16_fields=("actor_train.model_args.dtype",))


def load(path, **overrides):
    data = load_config_data(path, overrides)
    return validate_config(pipeline_of(data, str(path)).config_model(), data, str(path))


def test_a_good_host_has_no_problem():
    assert problems(GOOD, NEEDS) == []


def test_a_driver_older_than_torchs_cuda_is_named_with_the_version_needed():
    found = problems(replace(GOOD, driver="570.86.15", torch_sees_cuda=False), NEEDS)
    assert len(found) == 1 and "CUDA 13.0" in found[0] and "570.86.15" in found[0] and ">= 580" in found[0]


def test_a_cpu_torch_on_a_gpu_host_points_at_the_gpu_install():
    found = problems(replace(GOOD, torch_cuda=None, torch_sees_cuda=False), NEEDS)
    assert len(found) == 1 and "CPU build" in found[0] and "make setup-gpu" in found[0]


def test_a_gpu_torch_does_not_see_is_named_even_with_a_new_driver():
    found = problems(replace(GOOD, torch_sees_cuda=False), NEEDS)
    assert len(found) == 1 and "CUDA_VISIBLE_DEVICES" in found[0]


def test_bf16_on_a_gpu_before_ampere_is_refused_with_the_fields():
    t4 = Gpu(0, "Tesla T4", (7, 5), 15.0, 14.6)
    found = problems(replace(GOOD, gpus=(t4,)), NEEDS)
    assert len(found) == 1 and "7.5" in found[0] and "actor_train.model_args.dtype" in found[0]
    assert problems(replace(GOOD, gpus=(t4,)), replace(NEEDS, bf16_fields=())) == []


def test_memory_held_by_another_process_is_named():
    busy = replace(H100, free_gib=2.5)
    found = problems(replace(GOOD, gpus=(busy,)), NEEDS)
    assert len(found) == 1 and "~4.0 GiB" in found[0] and "2.5 GiB free" in found[0] and "other processes" in found[0]


def test_fused_adam_needs_a_matching_nvcc_or_a_built_kernel():
    needs = replace(NEEDS, fused_adam_fields=("actor_train.strategy_args.optimizer",))
    assert "no nvcc" in problems(GOOD, needs)[0]
    assert "CUDA 12.4" in problems(replace(GOOD, nvcc="12.4"), needs)[0]
    assert problems(replace(GOOD, nvcc="13.0"), needs) == []
    assert problems(replace(GOOD, fused_adam_built=True), needs) == []


def test_torch_compile_needs_a_compiler():
    needs = replace(NEEDS, compile_fields=("actor_train.strategy_args.torch_compile",))
    found = problems(replace(GOOD, compile_missing="no C compiler (cc, gcc or clang on PATH, or $CC)"), needs)
    assert len(found) == 1 and "torch_compile: false" in found[0]


def test_a_host_without_gpus_or_a_run_without_them_is_not_checked():
    assert problems(replace(GOOD, gpus=(), torch_sees_cuda=False, torch_cuda=None), NEEDS) == []
    assert problems(replace(GOOD, driver="470.1", torch_sees_cuda=False), replace(NEEDS, gpus=0)) == []


def test_nvidia_smi_answer_is_parsed():
    driver, gpus = parse_nvidia_smi("0, NVIDIA H200, 570.124.06, 9.0, 143771, 143000\n1, Tesla T4, 570.124.06, 7.5, "
                                    "15360, 1024\n")
    assert driver == "570.124.06" and gpus[0].capability == (9, 0) and gpus[1].capability == (7, 5)
    assert gpus[1].free_gib == pytest.approx(1.0)


def test_the_h100_config_on_an_old_driver_is_refused_by_its_plan():
    """What ``rollflow plan`` and ``start_run`` do: the problems join the plan's, whose check raises (exit 2)."""
    config = load(H100_CONFIG)
    plan = make_plan(config, {"CPU": 16.0, "GPU": 1.0})
    needs = needs_of(config, plan)
    assert needs.gpus == pytest.approx(1, abs=1e-3) and needs.memory_gib > 1
    assert "train.actor_train.model_args.dtype" in needs.bf16_fields and "rollout.engine.dtype" in needs.bf16_fields
    assert needs.sleep_fields == ("rollout.engine.sleep_level 2",)
    assert plan.fits
    check_run(config, plan, replace(GOOD, driver="550.54.15", torch_sees_cuda=False))
    with pytest.raises(PlanError, match="GPU pre-flight: torch is built for CUDA 13.0.*>= 580"):
        plan.check()


def test_a_cpu_host_plans_gpu_runs_as_a_what_if():
    """No nvidia-smi and no CUDA here: ``rollflow plan --gpus 1`` of a GPU config still plans (nothing to probe)."""
    config = load(H100_CONFIG)
    assert run_plan(config, {"CPU": 16.0, "GPU": 1.0}).fits


def test_expandable_segments_with_sleeping_engines_is_refused():
    needs = replace(NEEDS, sleep_fields=("rollout.engine.sleep_level 2",))
    found = problems(replace(GOOD, alloc_conf="expandable_segments:True"), needs)
    assert len(found) == 1 and "sleep allocator" in found[0] and "rollout.engine.sleep_level 2" in found[0]
    assert problems(replace(GOOD, alloc_conf="expandable_segments:True"), NEEDS) == []
    assert problems(replace(GOOD, alloc_conf="max_split_size_mb:512"), needs) == []


def test_rollflow_plan_on_a_host_whose_torch_cannot_use_the_listed_gpu_exits_2(tmp_path, monkeypatch):
    """The command itself, on this host with a faked ``nvidia-smi`` (an H100 on driver 580): torch here is a CPU
    build, so the plan that fits is refused with one pre-flight line and the fix, exit 2."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H100 80GB HBM3, 580.65.06, 9.0, 81559, 80994'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    result = CliRunner().invoke(app, ["plan", "--config", str(H100_CONFIG), "--cpus", "16", "--gpus", "1"])
    assert result.exit_code == 2, result.output
    assert "GPU pre-flight: the run needs a GPU and nvidia-smi lists 1, but this torch is a CPU build" in result.output
    assert "make setup-gpu" in result.output
