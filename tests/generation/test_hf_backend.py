"""The transformers backend: schema, seeds, group sampling, budget cut, stop strings, log-probs, in-place reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from schemas.errors import RollflowError
from stages.generation.engines import Engine, GenRequest, SamplingSpec, build_engine, chat_prompt_token_ids

from .conftest import save_perturbed_copy

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def tiny_engine(tiny_model: Path):
    engine = build_engine("hf", tiny_model, dtype="float32", max_batch_size=4)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(tiny_engine) -> list[list[int]]:
    return [chat_prompt_token_ids(tiny_engine.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]


def test_results_follow_the_schema_and_request_major_order(tiny_engine, prompts) -> None:
    requests = [GenRequest(prompts[0], SamplingSpec(n=3, seed=1, max_new_tokens=6)),
                GenRequest(prompts[1], SamplingSpec(n=2, seed=2, max_new_tokens=6))]
    results = tiny_engine.generate(requests)
    assert isinstance(tiny_engine, Engine)
    assert [(r.request_index, r.sample_index) for r in results] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    for r in results:
        assert r.prompt_token_ids == prompts[r.request_index]
        assert len(r.logprobs) == len(r.response_token_ids) <= 6
        assert all(lp <= 0 for lp in r.logprobs)
        assert r.text == tiny_engine.tokenizer.decode(r.response_token_ids, skip_special_tokens=True)
    assert len({tuple(r.response_token_ids) for r in results[:3]}) == 3  # the group's samples differ


def test_overlong_replies_are_cut_at_max_new_tokens_and_marked(tiny_engine, prompts) -> None:
    results = tiny_engine.generate([GenRequest(prompts[0], SamplingSpec(seed=3, max_new_tokens=5, n=4))])
    for r in results:  # a random model almost never says eos within 5 tokens; if it does, it is a 'stop'
        assert (r.finish_reason, r.truncated, len(r.response_token_ids)) == ("length", True, 5) or (
            r.finish_reason == "stop" and r.response_token_ids[-1] == 2)
    assert any(r.truncated for r in results)


def test_same_seed_same_sample_regardless_of_batch(tiny_engine, prompts) -> None:
    alone = tiny_engine.generate([GenRequest(prompts[1], SamplingSpec(seed=7, n=2, max_new_tokens=8))])
    batched = tiny_engine.generate([GenRequest(prompts[0], SamplingSpec(seed=9, n=3, max_new_tokens=8)),
                                    GenRequest(prompts[1], SamplingSpec(seed=7, n=2, max_new_tokens=8))])
    assert [r.response_token_ids for r in alone] == [r.response_token_ids for r in batched[3:]]
    other_seed = tiny_engine.generate([GenRequest(prompts[1], SamplingSpec(seed=8, n=2, max_new_tokens=8))])
    assert [r.response_token_ids for r in other_seed] != [r.response_token_ids for r in alone]


def test_greedy_picks_the_argmax_and_logprobs_are_teacher_forced_logprobs(tiny_engine, prompts) -> None:
    spec = SamplingSpec(temperature=0.0, max_new_tokens=6)
    (result,) = tiny_engine.generate([GenRequest(prompts[0], spec)])
    ids = torch.tensor([prompts[0] + result.response_token_ids])
    with torch.no_grad():
        logits = tiny_engine.model(input_ids=ids).logits[0, len(prompts[0]) - 1:-1].float()
    assert logits.argmax(-1).tolist() == result.response_token_ids
    torch.testing.assert_close(torch.tensor(result.logprobs), logits.log_softmax(-1).max(-1).values,
                               atol=1e-4, rtol=0)


def test_sampled_logprobs_are_raw_model_logprobs_not_temperature_scaled(tiny_engine, prompts) -> None:
    spec = SamplingSpec(temperature=0.6, top_k=20, top_p=0.9, seed=4, max_new_tokens=8)
    (result,) = tiny_engine.generate([GenRequest(prompts[1], spec)])
    reference = tiny_engine.score(prompts[1], result.response_token_ids)
    torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(reference), atol=1e-4, rtol=0)


def test_stop_string_ends_the_reply_after_the_token_that_completes_it(tiny_engine, prompts) -> None:
    spec = SamplingSpec(seed=11, max_new_tokens=12)
    (free,) = tiny_engine.generate([GenRequest(prompts[0], spec)])
    stop = free.text[len(free.text) // 2:][:3]  # a piece of the middle of the free reply
    assert stop.strip(), f"pick another seed: reply {free.text!r}"
    (stopped,) = tiny_engine.generate([GenRequest(prompts[0], SamplingSpec(seed=11, max_new_tokens=12,
                                                                           stop=(stop,)))])
    assert stopped.finish_reason == "stop" and not stopped.truncated
    n = len(stopped.response_token_ids)
    assert stopped.response_token_ids == free.response_token_ids[:n]
    assert stop in stopped.text
    assert stop not in tiny_engine.tokenizer.decode(stopped.response_token_ids[:-1], skip_special_tokens=True)


def test_reply_is_cut_at_the_context_window(tiny_model: Path, prompts) -> None:
    engine = build_engine("hf", tiny_model, max_model_len=len(prompts[0]) + 3)
    (result,) = engine.generate([GenRequest(prompts[0], SamplingSpec(seed=1, max_new_tokens=50))])
    assert len(result.response_token_ids) <= 3 and (result.truncated or result.response_token_ids[-1] == 2)


def test_load_weights_in_place_equals_a_fresh_engine(tiny_engine, tiny_model: Path, prompts, tmp_path: Path) -> None:
    """In place, and through sleep and wake (the colocated path, EngineMemory): asleep the engine refuses to
    generate; level 1 on a CPU device has nothing to move and wakes to the same model; level 2 frees every weight and
    buffer byte (meta tensors) and, woken with the new checkpoint, equals the fresh engine too."""
    requests = [GenRequest(p, SamplingSpec(seed=5, n=2, max_new_tokens=8)) for p in prompts]
    before = tiny_engine.generate(requests)
    changed = save_perturbed_copy(tiny_model, tmp_path / "changed", relative_scale=0.5)
    held = sum(t.numel() * t.element_size() for t in (*tiny_engine.model.parameters(), *tiny_engine.model.buffers()))
    tiny_engine.load_weights(changed)
    try:
        reloaded = tiny_engine.generate(requests)
        fresh = build_engine("hf", changed, dtype="float32", max_batch_size=4).generate(requests)
        tiny_engine.load_weights(tiny_model)
        assert tiny_engine.sleep(1) == {"released_bytes": 0, "offloaded_bytes": 0}
        with pytest.raises(RollflowError, match="asleep"):
            tiny_engine.generate(requests)
        tiny_engine.wake()
        assert [r.logprobs for r in tiny_engine.generate(requests)] == [r.logprobs for r in before]
        assert tiny_engine.sleep(2) == {"released_bytes": held, "offloaded_bytes": 0}
        assert {p.device.type for p in tiny_engine.model.parameters()} == {"meta"}
        with pytest.raises(RollflowError, match="asleep"):
            tiny_engine.generate(requests)
        tiny_engine.wake(changed)
        woken = tiny_engine.generate(requests)
    finally:
        if getattr(tiny_engine, "_asleep", 0):
            tiny_engine.wake(tiny_model)
        tiny_engine.load_weights(tiny_model)
    for got in (reloaded, woken):
        assert [r.response_token_ids for r in got] == [r.response_token_ids for r in fresh]
        assert [r.logprobs for r in got] == [r.logprobs for r in fresh]
    assert [r.logprobs for r in reloaded] != [r.logprobs for r in before]  # the new weights changed the model
    assert [r.logprobs for r in tiny_engine.generate(requests)] == [r.logprobs for r in before]


def test_load_weights_rejects_another_architecture(tiny_engine, default_model: Path) -> None:
    with pytest.raises(RollflowError, match="does not match the engine's model"):
        tiny_engine.load_weights(default_model)


def test_real_model_short_generation(default_model: Path) -> None:
    """SmolLM2-135M-Instruct: 2 prompts × 8 tokens sampled, and a greedy answer that ends with eos."""
    engine = build_engine("hf", default_model, dtype="float32")
    prompts = [chat_prompt_token_ids(engine.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    sampled = engine.generate([GenRequest(p, SamplingSpec(seed=0, max_new_tokens=8)) for p in prompts])
    assert all(len(r.response_token_ids) == len(r.logprobs) <= 8 for r in sampled)
    (greedy,) = engine.generate([GenRequest(prompts[0], SamplingSpec(temperature=0, max_new_tokens=12))])
    assert "Paris" in greedy.text
    assert greedy.finish_reason == "stop" and greedy.response_token_ids[-1] == engine.tokenizer.eos_token_id
    assert "<|im_end|>" not in greedy.text
    engine.close()


def test_the_weights_served_are_checked_against_the_checkpoint(tiny_engine, tiny_model: Path, tmp_path: Path) -> None:
    """Every load and wake compares sampled tensors with the checkpoint's files: equal for the checkpoint loaded,
    and a different weight file (the reload that did not happen) is named with its tensor."""
    assert tiny_engine.check_weights(tiny_model) >= 3  # embedding, norms, projections of the first and last layer
    changed = save_perturbed_copy(tiny_model, tmp_path / "changed", relative_scale=0.5)
    with pytest.raises(RollflowError, match=r"does not serve the checkpoint it was asked for: its \S+ differs from"):
        tiny_engine.check_weights(changed)


def test_probe_names_pick_unfused_tensors_of_the_first_and_last_layer() -> None:
    from stages.generation.weight_check import probe_names

    names = [f"model.layers.{i}.{p}" for i in range(3) for p in ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                                                                  "self_attn.qkv_proj.weight")]
    assert probe_names(["model.embed_tokens.weight", "model.norm.weight", *names]) == [
        "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.2.mlp.down_proj.weight"]
