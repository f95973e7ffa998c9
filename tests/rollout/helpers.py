"""Helpers shared by the rollout tests: small configs and fake engine replies."""

from __future__ import annotations

GOOD = "<answer>Right</answer>"
GARBAGE = "I think I will go somewhere nice."


def small_config(**overrides):
    """A small FrozenLake rollout config (HF backend), with dotted overrides like ``{"env.max_steps": 2}``."""
    from schemas.config import _set_dotted
    from schemas.rollout_config import RolloutConfig

    data: dict = {"sequence_length": 1024, "env": {"num_env_groups": 2, "group_size": 2, "max_steps": 3},
                  "generating_args": {"max_new_tokens": 8},
                  "engine": {"backend": "hf", "dtype": "float32", "threads": 1, "options": {"max_batch_size": 8}},
                  "runtime": {"num_cpus": 2}}
    for key, value in overrides.items():
        _set_dotted(data, key, value)
    return RolloutConfig.model_validate(data)


def fake_result(tokenizer, text: str, finish_reason: str = "stop", eos: bool = True, logprob: float = -0.5,
                prompt: list[int] | None = None):
    """A GenResult as an engine would return it for ``text`` (eos appended when it ended by itself)."""
    from stages.generation.engines import GenResult

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if eos and finish_reason == "stop":
        ids = ids + [tokenizer.eos_token_id]
    return GenResult(request_index=0, sample_index=0, prompt_token_ids=list(prompt or [1]),
                     response_token_ids=list(ids), logprobs=[logprob - 0.01 * i for i in range(len(ids))], finish_reason=finish_reason, text=text)
