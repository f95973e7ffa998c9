"""The engine contract without a model: sampling spec rules, seeds, request expansion, filters, chat prompts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from schemas.errors import ConfigError, RollflowError
from stages.generation.engines import (
    GENERATION_BACKENDS,
    GenRequest,
    GenResult,
    SamplingSpec,
    backend_options,
    build_engine,
    chat_prompt_token_ids,
    check_engine_options,
    check_model_dir,
    expand_requests,
    load_tokenizer,
    sample_seed,
)
from stages.generation.vllm_backend import compile_stance
from stages.generation.hf_backend import filter_logits


def test_backends_are_registered_under_their_names() -> None:
    with pytest.raises(KeyError, match="known: hf, vllm"):
        build_engine("sglang", ".")
    assert GENERATION_BACKENDS.names() == ["hf", "vllm"]


def test_engine_options_are_the_backend_constructor_arguments() -> None:
    """An engine section's options are checked against its backend's constructor before Ray starts: an unknown key
    (or the other backend's) names the key, the backend and the accepted keys."""
    assert "max_batch_size" in backend_options("hf") and "kv_cache_space_gib" not in backend_options("hf")
    assert {"kv_cache_space_gib", "engine_kwargs"} <= set(backend_options("vllm"))
    check_engine_options("vllm", {"kv_cache_space_gib": 2, "gpu_memory_utilization": 0.3}, "rollout.engine.options")
    check_engine_options("hf", {"max_batch_size": 8}, "engine.options")
    with pytest.raises(ConfigError, match=r"rollout.engine.options: 'kv_cache_space_gib' is not an option of the "
                                          r"'hf' generation backend.*max_batch_size"):
        check_engine_options("hf", {"kv_cache_space_gib": 2}, "rollout.engine.options")


@pytest.mark.parametrize("name", ["rollout_frozenlake", "rollout_sokoban", "webshop", "gem_guess_the_number"])
def test_shipped_rollout_configs_give_their_backend_its_options(name: str) -> None:
    from schemas.config import load_config
    from schemas.rollout_config import RolloutConfig

    engine = load_config(RolloutConfig, Path(__file__).resolve().parents[2] / f"configs/{name}.yaml").engine
    check_engine_options(engine.backend, engine.options, "engine.options")


def test_vllm_engine_kwargs_are_checked_against_vllm_without_importing_it() -> None:
    import sys

    from stages.generation.vllm_backend import vllm_engine_arguments

    accepted = vllm_engine_arguments()
    if accepted is None:
        pytest.skip("vLLM is not installed here")
    assert {"max_num_seqs", "enable_chunked_prefill", "worker_extension_cls", "seed"} <= accepted
    check_engine_options("vllm", {"engine_kwargs": {"max_num_seqs": 4}}, "engine.options")
    with pytest.raises(ConfigError, match="engine.options.engine_kwargs: 'max_num_seq' is not a keyword argument"):
        check_engine_options("vllm", {"engine_kwargs": {"max_num_seq": 4}}, "engine.options")
    with pytest.raises(ConfigError, match="engine.options.engine_kwargs is 4, .* write a mapping"):
        check_engine_options("vllm", {"engine_kwargs": 4}, "engine.options")
    assert "vllm.engine.arg_utils" not in sys.modules or "vllm" in sys.modules  # read from source, not imported


# what a command's driver does with the engines and a LoRA checkpoint before Ray starts, in a fresh interpreter
_DRIVER_CHECKS = """
import json, sys, types
from stages.generation.engines import check_engine_options
from stages.train.adapter_base import why_not_adapter_base
check_engine_options("hf", {"max_batch_size": 4}, "rollout.engine.options")
check_engine_options("vllm", {"engine_kwargs": {"max_num_seqs": 4}}, "rollout.engine.options")
ckpt, base = sys.argv[1], sys.argv[2]
info = types.SimpleNamespace(path=ckpt, lora={"actor": {"base": base, "base_fingerprint": "f"}})
assert why_not_adapter_base(info, base, "f") is None
print(json.dumps([m for m in ("torch", "transformers", "vllm", "peft") if m in sys.modules]))
"""


def test_a_drivers_engine_and_adapter_checks_load_no_torch(tmp_path) -> None:
    """A command's driver checks the engine options of both backends (it imports their modules) and whether a LoRA
    checkpoint's reference is its adapter's base (the log-prob plan), and loads neither torch nor transformers for it
    (1.5-2 CPU-s and about 200 MB of each command's driver): the engines import torch where they run, and the base
    check compares weights (with torch) only when the base's fingerprint was not recorded."""
    import json
    import subprocess
    import sys

    from tests.spine.helpers import REPO

    (tmp_path / "ckpt/lora/actor").mkdir(parents=True)
    (tmp_path / "ckpt/lora/actor/adapter_model.safetensors").write_bytes(b"")
    done = subprocess.run([sys.executable, "-c", _DRIVER_CHECKS, str(tmp_path / "ckpt"), str(tmp_path / "base")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [], done.stdout


def test_compile_stance_runs_torch_compile_functions_eagerly() -> None:
    """The stance an eager CPU vLLM engine generates under (vLLM's compiled rank count runs uncompiled there)."""
    probe = torch.compile(lambda x: x + int(torch.compiler.is_compiling()), backend="eager")
    with compile_stance(True):
        assert probe(torch.zeros(1)).item() == 0
    with compile_stance(False):
        assert probe(torch.zeros(1)).item() == 1  # compiled: the probe sees the compiler


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(max_new_tokens=0),
                                 dict(n=0), dict(stop=("",))])
def test_sampling_spec_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ConfigError):
        SamplingSpec(**bad)


def test_sample_seeds_are_stable_distinct_and_31_bit() -> None:
    seeds = [sample_seed(seed, i) for seed in range(50) for i in range(8)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**31 for s in seeds)
    assert sample_seed(0, 0) == sample_seed(0, 0)
    assert sample_seed(1, 0) != sample_seed(0, 1)  # neighbouring seeds do not share samples


def test_expand_requests_is_request_major_and_caps_the_budget_at_the_context() -> None:
    requests = [GenRequest([1, 2, 3], SamplingSpec(n=2, seed=5, max_new_tokens=10)),
                GenRequest([4] * 8, SamplingSpec(n=3, seed=6, max_new_tokens=10))]
    jobs = expand_requests(requests, max_model_len=12)
    assert [(j.request_index, j.sample_index) for j in jobs] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert [j.max_new_tokens for j in jobs] == [9, 9, 4, 4, 4]
    assert [j.seed for j in jobs[2:]] == [sample_seed(6, i) for i in range(3)]


def test_expand_requests_rejects_empty_and_overlong_prompts() -> None:
    with pytest.raises(RollflowError, match="request 1 has an empty prompt"):
        expand_requests([GenRequest([1]), GenRequest([])], max_model_len=8)
    with pytest.raises(ConfigError, match="request 0: prompt has 8 tokens.*max_model_len=8"):
        expand_requests([GenRequest([1] * 8)], max_model_len=8)


def test_gen_result_checks_its_invariants() -> None:
    ok = GenResult(0, 0, [1], [5, 6], [-0.1, -0.2], "length", "ab")
    assert ok.truncated and not GenResult(0, 0, [1], [5], [-0.1], "stop", "a").truncated
    with pytest.raises(RollflowError, match="2 log-probs for 1 response tokens"):
        GenResult(0, 0, [1], [5], [-0.1, -0.2], "stop", "a")
    with pytest.raises(RollflowError, match="finish_reason 'abort'"):
        GenResult(0, 0, [1], [5], [-0.1], "abort", "a")


def test_check_model_dir_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(RollflowError, match="no config.json"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RollflowError, match="no \\*.safetensors"):
        check_model_dir(tmp_path)


def filter_logits_loop(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Reference: one row at a time, the definitions written out plainly."""
    scaled = (logits / temperature).tolist()
    order = sorted(range(len(scaled)), key=lambda v: -scaled[v])
    kept = order[:top_k] if top_k > 0 else order
    total = sum(math.exp(scaled[v]) for v in kept)
    nucleus, mass = [], 0.0
    for v in kept:
        if mass >= top_p:
            break
        nucleus.append(v)
        mass += math.exp(scaled[v]) / total
    return torch.tensor([scaled[v] if v in nucleus else -math.inf for v in range(len(scaled))])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 3, 1.0), (1.3, -1, 0.6), (0.9, 4, 0.8),
                                                     (1.0, 1, 1.0), (1.0, -1, 1e-6)])
def test_filter_logits_matches_the_row_loop(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(3))
    fast = filter_logits(logits, torch.full((5,), temperature), torch.full((5,), top_k), torch.full((5,), top_p))
    for row in range(5):
        torch.testing.assert_close(fast[row], filter_logits_loop(logits[row], temperature, top_k, top_p))


def test_filter_logits_hand_case() -> None:
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 < 0.7 ≤ 0.8); top_k=3 drops the last."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, torch.ones(1), torch.tensor([-1]), torch.tensor([0.7])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = filter_logits(logits, torch.ones(1), torch.tensor([3]), torch.tensor([1.0])).isfinite()
    assert kept.tolist() == [[True, True, True, False]]


def test_chat_prompt_uses_the_tokenizer_template(tiny_model: Path) -> None:
    tokenizer = load_tokenizer(tiny_model)
    ids = chat_prompt_token_ids(tokenizer, [{"role": "user", "content": "Hi there"}])
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHi there<|im_end|>\n"
                                                                      "<|im_start|>assistant\n")
    assert all(isinstance(t, int) for t in ids)
