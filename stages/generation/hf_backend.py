"""The transformers backend ("hf"): the fallback engine, same schema as vLLM.

It runs its own batched decode loop over ``model.forward`` with a KV cache instead of ``model.generate``, because
``generate`` samples every row from the one global RNG; here each sample has its own ``torch.Generator`` seeded with
``sample_seed(seed, i)``, so a sample depends on (prompt, seed, i), not on its neighbours in the batch (up to
floating-point near-ties from padding). Sampling follows vLLM: temperature, then top-k, then top-p on the
renormalised remainder; log-probs are of the raw logits (engines.py).
"""

from __future__ import annotations

import functools
import gc
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from schemas.errors import RollflowError
from stages.generation.engines import (FINISH_LENGTH, FINISH_STOP, GENERATION_BACKENDS, GenRequest, GenResult,
                                       SampleJob, check_model_dir, decode_response, expand_requests, load_tokenizer,
                                       stop_string_hit)
from stages.generation.weight_check import check_served, probe_names, sample

if TYPE_CHECKING:
    import torch

# torch is imported where the engine runs: a driver imports this module to register the backend and check a
# config's engine options (stages/generation/engines.py backend_class), and a command's driver needs no torch
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPE_NAMES:
        raise RollflowError(f"unknown dtype '{name}' for the hf generation backend; use one of "
                            f"{', '.join(sorted(DTYPE_NAMES))}")
    return getattr(torch, DTYPE_NAMES[name])


def inference_mode(method):
    """``torch.inference_mode()`` around ``method``, torch imported at the first call."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        import torch

        with torch.inference_mode():
            return method(*args, **kwargs)
    return run


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a response: the tokenizer's eos plus the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(t) for t in configured)
    return ids


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Sampling logits per row: divide by temperature, keep the top_k, then the top_p nucleus.

    logits (B, V) float32; temperature (B,) > 0; top_k (B,) int (<= 0: off); top_p (B,) in (0, 1].
    Returns (B, V) with dropped tokens at -inf. The nucleus is the smallest set of most likely tokens whose
    probability reaches top_p (at least one token).
    """
    import torch

    scaled = logits / temperature[:, None]
    if not bool(((top_k > 0) | (top_p < 1)).any()):
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1])[None, :]
    drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def sample_tokens(logits: torch.Tensor, jobs: Sequence[SampleJob], generators: Sequence[torch.Generator]
                  ) -> torch.Tensor:
    """One token per row: argmax for temperature 0, else a draw from the filtered distribution with the row's RNG.

    logits (B, V) float32 → (B,) int64.
    """
    import torch

    temperature = torch.tensor([job.sampling.temperature for job in jobs], dtype=torch.float32)
    top_k = torch.tensor([job.sampling.top_k for job in jobs])
    top_p = torch.tensor([job.sampling.top_p for job in jobs], dtype=torch.float32)
    greedy = temperature == 0
    probs = filter_logits(logits, temperature.masked_fill(greedy, 1.0), top_k, top_p).softmax(dim=-1)
    tokens = logits.argmax(dim=-1)
    for row in torch.nonzero(~greedy).flatten().tolist():
        tokens[row] = torch.multinomial(probs[row], 1, generator=generators[row])[0]
    return tokens


@GENERATION_BACKENDS.register("hf")
class HFEngine:
    """transformers ``AutoModelForCausalLM`` on one device with a hand-written sampling loop.

    dtype: "float32" | "bfloat16" | "float16"; max_model_len: context window (default: the config's
    max_position_embeddings); max_batch_size: samples decoded together; num_threads: torch intra-op threads.
    """

    def __init__(self, model_dir: str | os.PathLike, dtype: str = "float32", max_model_len: int | None = None,
                 max_batch_size: int = 32, num_threads: int | None = None, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.model_dir = check_model_dir(model_dir)
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.tokenizer_dir: str | None = str(self.model_dir)  # kept as loaded: the actor's chat format shares it
        self.model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch_dtype(dtype),
                                                          local_files_only=True).to(self.device).eval()
        self.max_model_len = int(max_model_len or self.model.config.max_position_embeddings)
        self.max_batch_size = int(max_batch_size)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self._asleep = 0  # the sleep level while asleep (sleep / wake)
        self._buffers: dict[str, torch.Tensor] = {}  # the host copies of the buffers over a level-2 sleep

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        if self._asleep:
            raise RollflowError(f"the hf engine is asleep (sleep level {self._asleep}) and was asked to generate; "
                                "wake() it first (a training flow wakes its engines before each rollout)")
        jobs = expand_requests(requests, self.max_model_len)
        results: list[GenResult] = []
        for start in range(0, len(jobs), self.max_batch_size):
            results.extend(self._generate_batch(jobs[start:start + self.max_batch_size]))
        return results

    @inference_mode
    def _generate_batch(self, jobs: Sequence[SampleJob]) -> list[GenResult]:
        """Decode a batch of samples together: left-padded prefill, then one token per step for every row."""
        import torch

        batch, width = len(jobs), max(len(job.prompt_token_ids) for job in jobs)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, job in enumerate(jobs):
            input_ids[row, width - len(job.prompt_token_ids):] = torch.tensor(job.prompt_token_ids)
            attention_mask[row, width - len(job.prompt_token_ids):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator().manual_seed(job.seed) for job in jobs]
        responses: list[list[int]] = [[] for _ in jobs]
        logprobs: list[list[float]] = [[] for _ in jobs]
        finish: list[str | None] = [None] * batch

        out = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                         position_ids=position_ids.to(self.device), use_cache=True, logits_to_keep=1)
        next_position = position_ids[:, -1] + 1
        while True:
            logits = out.logits[:, -1, :].float().cpu()
            tokens = sample_tokens(logits, jobs, generators)
            token_logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
            for row, job in enumerate(jobs):
                if finish[row] is None:
                    responses[row].append(int(tokens[row]))
                    logprobs[row].append(float(token_logprobs[row]))
                    finish[row] = self._finish_reason(responses[row], job)
            active = torch.tensor([reason is None for reason in finish])
            if not bool(active.any()):
                break
            tokens = tokens.masked_fill(~active, self.pad_id)
            attention_mask = torch.cat([attention_mask, active.long()[:, None]], dim=-1)
            out = self.model(input_ids=tokens[:, None].to(self.device),
                             attention_mask=attention_mask.to(self.device),
                             position_ids=next_position[:, None].to(self.device),
                             past_key_values=out.past_key_values, use_cache=True)
            next_position = next_position + 1
        return [GenResult(job.request_index, job.sample_index, job.prompt_token_ids, responses[row], logprobs[row],
                          finish[row], decode_response(self.tokenizer, responses[row]))
                for row, job in enumerate(jobs)]

    def _finish_reason(self, response: list[int], job: SampleJob) -> str | None:
        if response[-1] in self.eos_ids:
            return FINISH_STOP
        if job.sampling.stop and stop_string_hit(decode_response(self.tokenizer, response), job.sampling.stop):
            return FINISH_STOP
        if len(response) >= job.max_new_tokens:
            return FINISH_LENGTH
        return None

    @inference_mode
    def score(self, prompt_token_ids: Sequence[int], response_token_ids: Sequence[int]) -> list[float]:
        """Teacher-forced log-probs of ``response_token_ids`` after the prompt (R,), float32 log-softmax."""
        import torch

        ids = torch.tensor([list(prompt_token_ids) + list(response_token_ids)], device=self.device)
        logits = self.model(input_ids=ids).logits[0, len(prompt_token_ids) - 1:-1].float()
        picked = logits.log_softmax(dim=-1).gather(-1, ids[0, len(prompt_token_ids):, None])[:, 0]
        return picked.cpu().tolist()

    def load_weights(self, checkpoint_dir: str | os.PathLike) -> None:
        """Copy the weights of an HF safetensors folder into the model in place (same architecture)."""
        from safetensors.torch import load_file

        folder = check_model_dir(checkpoint_dir)
        state: dict[str, torch.Tensor] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            state.update(load_file(str(path)))
        expected = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        if self.model.config.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        found = {name: tuple(t.shape) for name, t in state.items()}
        if found != expected:  # checked before copying anything, so a bad checkpoint leaves the model untouched
            wrong = sorted(n for n in found.keys() & expected.keys() if found[n] != expected[n])
            raise RollflowError(
                f"checkpoint {folder} does not match the engine's model {self.model_dir}: missing "
                f"{sorted(expected.keys() - found.keys())[:3]}, unexpected {sorted(found.keys() - expected.keys())[:3]}, "
                f"wrong shapes {wrong[:3]}; save the trained model with the same architecture")
        self.model.load_state_dict(state, strict=False)
        self.model_dir = folder
        self.check_weights(folder)

    def check_weights(self, folder: str | os.PathLike) -> int:
        """Raise when the model's weights differ from the checkpoint in ``folder`` (stages/generation/
        weight_check.py); returns how many tensors were compared."""
        params = dict(self.model.named_parameters())
        names = probe_names(params)
        dtype = next(iter(params.values())).dtype
        return check_served({n: sample(params[n]) for n in names}, folder, dtype, "hf")

    def sleep(self, level: int) -> dict[str, int]:
        """Give the model's memory back (:class:`~stages.generation.engines.EngineMemory`). The decode loop keeps no
        KV cache between calls, so only the weights count. Level 1: moved to host memory (on a CPU device they are
        there already: nothing moves, nothing is freed); level 2: discarded (the parameters and buffers become meta
        tensors; the buffers that no checkpoint holds, e.g. rotary frequencies, are kept on the host)."""
        held = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        self._asleep = level
        if level >= 2:
            self._buffers = {name: b.detach().to("cpu", copy=True) for name, b in self.model.named_buffers()}
            self.model.to("meta")
            _empty_device_cache(self.device)
            return {"released_bytes": held, "offloaded_bytes": 0}
        if self.device.type == "cpu":
            return {"released_bytes": 0, "offloaded_bytes": 0}
        self.model.to("cpu")
        _empty_device_cache(self.device)
        return {"released_bytes": held, "offloaded_bytes": held}

    def wake(self, checkpoint_dir: str | os.PathLike | None = None) -> None:
        """Take the memory again: the weights of ``checkpoint_dir`` when given (in place), else those kept by a level
        1 sleep. After level 2 without a folder, the weights are reloaded from the model's own folder."""
        import torch

        level, self._asleep = self._asleep, 0
        if level >= 2:
            self.model.to_empty(device=self.device)
            with torch.no_grad():
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(self._buffers[name])
            self._buffers = {}
            self.model.tie_weights()
            self.load_weights(checkpoint_dir or self.model_dir)
            return
        self.model.to(self.device)
        if checkpoint_dir is not None:
            self.load_weights(checkpoint_dir)

    def close(self) -> None:
        self.model = None
        gc.collect()


def _empty_device_cache(device: torch.device) -> None:
    """Return the allocator's cached blocks of a CUDA device (what other processes on the GPU can then use)."""
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
