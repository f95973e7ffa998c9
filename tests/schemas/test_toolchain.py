"""Options that would compile code on first use are resolved from what the host has, and the config records it.

The probes look at what they are given (a PATH, an include folder, a package folder), so an absent compiler or
kernel is a folder without it, not a mock; the decisions are pure functions of the probes' answers.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from schemas import precision, toolchain
from schemas.precision import Hardware
from schemas.rollout_config import EngineConfig
from schemas.train_config import StrategyArgs, TrainStepConfig, WorkerTrainConfig
from stages.train.engine_config import deepspeed_config

H100 = Hardware("cuda", "GPU NVIDIA H100, bf16 supported", True)


@pytest.fixture
def gpu_host(monkeypatch, tmp_path):
    """This host seen as a GPU machine with nothing prebuilt (an empty torch extensions folder)."""
    monkeypatch.setattr(precision, "detect", lambda: H100)
    monkeypatch.setattr(toolchain, "_chosen", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    return tmp_path


def _executable(folder: Path, name: str, text: str = "#!/bin/sh\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# ---- the optimizer ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, device, prebuilt, chosen", [
    ("auto", "cpu", True, "torch_adamw"), ("auto", "cuda", False, "torch_adamw"),
    ("auto", "cuda", True, "fused_adam"), ("fused_adam", "cuda", False, "fused_adam"),
    ("torch_adamw", "cuda", True, "torch_adamw"),
])
def test_auto_optimizer_builds_nothing(value, device, prebuilt, chosen):
    assert toolchain.choose_optimizer(value, device, prebuilt)[0] == chosen


def test_a_prebuilt_fused_adam_is_found_installed_or_in_the_extensions_folder(tmp_path):
    ds, ext = tmp_path / "deepspeed", tmp_path / "ext"
    assert not toolchain.deepspeed_op_built("fused_adam", ds, ext)
    (ext / "py311_cu130" / "fused_adam").mkdir(parents=True)
    (ext / "py311_cu130" / "fused_adam" / "fused_adam.so").write_bytes(b"")
    assert toolchain.deepspeed_op_built("fused_adam", ds, ext)
    assert not toolchain.deepspeed_op_built("cpu_adam", ds, ext)
    (ds / "ops" / "adam").mkdir(parents=True)
    (ds / "ops" / "adam" / "cpu_adam_op.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert toolchain.deepspeed_op_built("cpu_adam", ds, tmp_path / "none")


def test_the_config_records_the_optimizer_chosen_on_a_gpu_host(gpu_host, caplog):
    with caplog.at_level(logging.INFO, "rollflow.toolchain"):
        strategy = StrategyArgs(optimizer="auto")
        StrategyArgs(optimizer="auto")
    assert strategy.optimizer == "torch_adamw"
    assert [r.message for r in caplog.records].count(toolchain.choices_line()) == 1  # said once per process
    assert "optimizer auto -> torch_adamw" in toolchain.choices_line()
    built = gpu_host / "extensions" / "fused_adam"
    built.mkdir(parents=True)
    (built / "fused_adam.so").write_bytes(b"")
    chosen = StrategyArgs(optimizer="auto")
    assert chosen.optimizer == "fused_adam" and chosen.model_dump()["optimizer"] == "fused_adam"
    assert StrategyArgs.model_validate(chosen.model_dump()) == chosen  # a resumed run keeps it


def test_a_run_started_without_the_kernel_resumes_with_torch_adamw_after_it_is_built(gpu_host):
    """auto chose torch_adamw on a GPU host without DeepSpeed's kernel; the run's config.json leaves it out (as a CPU
    run's). Once the kernel has been built on the host, the resumed run reads its config.json back, and the sections
    its workers validate again: torch_adamw still, not a new choice of fused_adam."""
    started = TrainStepConfig.model_validate({"actor_train": {"strategy_args": {"optimizer": "auto"}},
                                              "critic_train": {"strategy_args": {"optimizer": "auto"}}})
    frozen = json.loads(json.dumps(started.model_dump(mode="json")))
    assert "optimizer" not in frozen["actor_train"]["strategy_args"]
    built = gpu_host / "extensions" / "fused_adam"
    built.mkdir(parents=True)
    (built / "fused_adam.so").write_bytes(b"")
    assert StrategyArgs(optimizer="auto").optimizer == "fused_adam"  # a new run on this host would take it
    resumed = TrainStepConfig.model_validate(frozen)
    assert resumed.actor_train.strategy_args.optimizer == resumed.critic_train.strategy_args.optimizer == "torch_adamw"
    assert resumed == started and resumed.model_dump(mode="json") == frozen


def test_torch_adamw_leaves_the_dump_as_before_the_option():
    """Configs that use torch's AdamW (every CPU run) dump, and fingerprint, exactly as before the option existed."""
    assert "optimizer" not in StrategyArgs().model_dump()


def test_deepspeed_runs_torch_adamw_fused_on_cuda_and_fused_adam_only_when_chosen():
    worker = WorkerTrainConfig()
    params = deepspeed_config(worker, on_gpu=True)["optimizer"]["params"]
    assert params["torch_adam"] is True and params["adam_w_mode"] is True and params["fused"] is True
    cpu = deepspeed_config(worker, on_gpu=False)["optimizer"]["params"]
    assert cpu["torch_adam"] is True and "fused" not in cpu
    fused = WorkerTrainConfig(strategy_args={"optimizer": "fused_adam"})
    assert deepspeed_config(fused, on_gpu=True)["optimizer"]["params"]["torch_adam"] is False
    assert deepspeed_config(fused, on_gpu=False)["optimizer"]["params"]["torch_adam"] is True
    offload = WorkerTrainConfig(strategy_args={"deepspeed_config": {"zero_optimization": {
        "offload_optimizer": {"device": "cpu"}}}})
    config = deepspeed_config(offload, on_gpu=True)
    assert config["zero_force_ds_cpu_optimizer"] is False and "fused" not in config["optimizer"]["params"]


# ---- torch_compile ------------------------------------------------------------------------------------------------

def test_compile_needs_a_compiler_on_path_and_python_headers(tmp_path):
    bin_dir, include = tmp_path / "bin", tmp_path / "include"
    include.mkdir()
    missing = toolchain.compile_missing(str(bin_dir), str(include), environ={})
    assert "no C compiler" in missing and "no Python headers" in missing
    _executable(bin_dir, "gcc")
    (include / "Python.h").write_text("")
    assert toolchain.c_compiler(str(bin_dir), environ={}) == str(bin_dir / "gcc")
    assert toolchain.compile_missing(str(bin_dir), str(include), environ={}) is None


def test_torch_compile_falls_back_with_one_warning_without_a_compiler(monkeypatch, caplog):
    monkeypatch.setattr(toolchain, "_chosen", {})
    toolchain._warn_once.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC", raising=False)
    with caplog.at_level(logging.WARNING, "rollflow.toolchain"):
        first, second = StrategyArgs(torch_compile=True), StrategyArgs(torch_compile=True)
    toolchain._warn_once.cache_clear()
    assert first.torch_compile is False and second.torch_compile is False
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no C compiler" in warnings[0] and "torch_compile: false" in warnings[0]
    assert "torch_compile true -> false" in toolchain.choices_line()


def test_torch_compile_stays_on_where_a_compiler_is_found(monkeypatch, tmp_path):
    if toolchain.python_headers() is None:
        pytest.skip("this interpreter has no Python headers")
    monkeypatch.setenv("PATH", str(_executable(tmp_path / "bin", "cc").parent))
    assert StrategyArgs(torch_compile=True).torch_compile is True


# ---- the vLLM sampler ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, device, kernels, use", [
    ("auto", "cpu", True, False), ("auto", "cuda", False, False), ("auto", "cuda", True, True),
    (True, "cuda", False, True), (False, "cuda", True, False),
])
def test_flashinfer_sampler_only_with_prebuilt_kernels(value, device, kernels, use):
    assert toolchain.choose_flashinfer_sampler(value, device, kernels)[0] is use


def test_the_kernel_package_is_looked_up_by_its_module():
    assert toolchain.flashinfer_kernels_present(lambda name: object() if name == "flashinfer_jit_cache" else None)
    assert not toolchain.flashinfer_kernels_present(lambda name: None)


def test_the_engine_actors_get_the_sampler_choice(gpu_host):
    engine = EngineConfig()
    assert engine.flashinfer_sampler is False  # no flashinfer_jit_cache in this environment
    assert engine.backend_env() == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert "flashinfer_sampler auto -> false" in toolchain.choices_line()
    chosen = EngineConfig(flashinfer_sampler=True)
    assert chosen.backend_env() == {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert chosen.model_dump()["flashinfer_sampler"] is True
    assert EngineConfig(backend="hf").backend_env() == {}
    assert "flashinfer_sampler" not in EngineConfig().model_dump()  # fingerprints as before the option


def test_nvcc_release_is_read_from_the_nvcc_on_path(tmp_path):
    assert toolchain.nvcc_release(str(tmp_path / "none")) is None
    folder = _executable(tmp_path / "cuda", "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 12.4, "
                                                      "V12.4.131'\n").parent
    assert toolchain.nvcc_release(str(folder)) == "12.4"
    assert os.access(folder / "nvcc", os.X_OK)


# ---- the fused output layer ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, device, zero, use", [
    ("auto", "cpu", 2, False), ("auto", "cuda", 2, True), ("auto", "cuda", 0, True), ("auto", "cuda", 3, False),
    (True, "cpu", 2, True), (False, "cuda", 2, False),
])
def test_fused_output_layer_auto_is_on_for_cuda_below_zero3(value, device, zero, use):
    assert toolchain.choose_fused_output_layer(value, device, zero)[0] is use


def test_the_config_records_the_fused_output_layer_chosen_on_a_gpu_host(gpu_host):
    """A GPU host records true (dumped, so a resumed run keeps it); ZeRO-3 records false (left out of the dump)."""
    worker = WorkerTrainConfig()
    assert worker.fused_output_layer is True and worker.model_dump()["fused_output_layer"] is True
    assert WorkerTrainConfig.model_validate(worker.model_dump()) == worker
    assert "fused_output_layer auto -> true" in toolchain.choices_line()
    zero3 = WorkerTrainConfig.model_validate({"strategy_args": {"zero_stage": 3}})
    assert zero3.fused_output_layer is False and "fused_output_layer" not in zero3.model_dump()
