"""Forward passes over ragged rows without gradients: log-probs, entropy and critic values. No Ray import.

Rows are grouped into micro-batches by a token budget (longest first, so padding stays small), right-padded,
run through the model, and the next-token results cut back to ``L - 1`` entries per row, in the input row order
(ragged in, ragged out). Log-probs and entropy follow ROLL's strategy ops (spec §1.8): float32, exactly 0 where
``response_mask[1:]`` is 0; the output layer projects only the positions whose next token is a response token
(``TokenLogits``). Values are the critic's raw outputs ``output[:, :-1, 0]`` at every position.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch

from schemas.errors import ConfigError, RollflowError
from schemas.tables import FLOATS, TableSpec, check_row_invariants
from schemas.train_config import PassOptions
from stages.algos.ragged import Ragged
from stages.partials import write_partials
from stages.storage import Location
from stages.train import models
from stages.train.batching import (TokenHidden, TokenRows, causal_lm_logits, forward_packed, output_layer,
                                   pad_micro_batch, select_hidden, select_logits, split_by_real_tokens,
                                   split_by_token_budget, unpad_next_token)
from stages.train.lora import load_adapter, load_with_adapter, same_adapter_options
from stages.train.packed_attention import attention_for, attention_used


@dataclass
class ForwardResult:
    """Per column, the ragged ``L - 1`` results in input row order; counters for throughput."""

    columns: dict[str, Ragged]
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    micro_batches: int = 0
    extra: dict = field(default_factory=dict)


def _concat_in_order(parts: list[tuple[np.ndarray, Ragged]], num_rows: int) -> Ragged:
    """Micro-batch results (their row indices, their rows) → one Ragged in row order 0..num_rows-1."""
    lengths = np.zeros(num_rows, dtype=np.int64)
    for index, r in parts:
        lengths[index] = r.lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.zeros(offsets[-1], dtype=np.float32)
    for index, r in parts:
        dest = np.repeat(offsets[:-1][index], r.lengths) + r.position()
        values[dest] = r.values
    return Ragged(values, offsets)


@torch.inference_mode()
def forward_rows(model: torch.nn.Module, rows: TokenRows, max_tokens: int, *, kind: str = "log_probs",
                 entropy: bool = False, device: torch.device | str = "cpu", pad_token_id: int = 0,
                 options: PassOptions = PassOptions()) -> ForwardResult:
    """Run ``model`` over ``rows`` in micro-batches of at most ``max_tokens`` padded tokens, or, ``options.packed``,
    of at most ``max_tokens`` real tokens run as one row without padding (:func:`forward_packed`; the same values up
    to float rounding), under the attention option ``options.attention`` resolved on ``device``
    (:func:`stages.train.packed_attention.attention_for`; the model's own choice again after the pass).
    ``options.fused`` (kind ``log_probs``): the output layer fused with the log-prob and entropy reduction
    (:class:`TokenHidden`: the ``(N, V)`` logits never held; the same values up to float32 rounding); the result's
    ``extra["fused_micro_batches"]`` counts the micro-batches that ran so.

    kind ``log_probs``: column ``log_probs`` (and ``entropy`` if asked) from a causal LM's logits;
    kind ``values``: column ``values`` from a one-label token-classification critic."""
    start = time.perf_counter()
    parts: dict[str, list[tuple[np.ndarray, Ragged]]] = {}
    tokens = padded = count = fused_count = 0
    packed, fused = options.packed, options.fused and kind == "log_probs"
    if fused:
        check_fused_output_layer(model)

    def values_of(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    split = split_by_real_tokens if packed else split_by_token_budget
    with attention_used(model, attention_for(options.attention, packed, device)):
        for index in split(rows.lengths, max_tokens):
            mb = pad_micro_batch(rows, index, pad_token_id).to(device)
            # right padding + causal attention: real tokens never see the padding, so no attention mask is needed
            results = {}
            if kind == "values":
                out = forward_packed(values_of, mb) if packed else values_of(mb.input_ids, mb.position_ids)
                results["values"] = out[:, :-1, 0].float()
            else:  # the output layer runs at the response tokens only (TokenLogits)
                if fused:
                    logits = select_hidden(model, mb, packed, with_entropy=entropy)
                    fused_count += isinstance(logits, TokenHidden)
                else:
                    logits = select_logits(partial(causal_lm_logits, model), mb, packed)
                results["log_probs"] = logits.log_probs(mb)
                if entropy:
                    results["entropy"] = logits.entropy()
            for name, value in results.items():
                parts.setdefault(name, []).append((index, unpad_next_token(value, mb.lengths)))
            tokens += mb.real_tokens
            padded += mb.real_tokens if packed else mb.padded_tokens
            count += 1
    columns = {name: _concat_in_order(p, rows.num_rows) for name, p in parts.items()}
    if rows.num_rows == 0:
        names = ["values"] if kind == "values" else ["log_probs"] + (["entropy"] if entropy else [])
        columns = {n: Ragged(np.zeros(0, np.float32), np.zeros(1, np.int64)) for n in names}
    return ForwardResult(columns, tokens, padded, time.perf_counter() - start, count,
                         {"fused_micro_batches": fused_count} if fused else {})


def check_fused_output_layer(model: torch.nn.Module) -> None:
    """Refuse ``logprobs.fused_output_layer: true`` for a model whose output layer is not a plain linear layer (a
    LoRA adapter on it, which switching the adapter off does not unwrap): ConfigError with the fix, before the
    first micro-batch."""
    layer = output_layer(model)
    if type(layer) is not torch.nn.Linear:
        raise ConfigError(f"logprobs.fused_output_layer is true, but the model's output layer is "
                          f"{type(layer).__module__}.{type(layer).__name__}, not a plain torch.nn.Linear (a LoRA "
                          "adapter on the output layer?), so its logits are not hidden @ weight.T + bias; set "
                          "logprobs.fused_output_layer: false, or leave the output layer out of "
                          "lora_target_modules")


def forward_batch(models: list, jobs: list, batch: pa.Table, max_tokens: int, output: Location,
                  spec: TableSpec, where: str, device: str = "cpu", options: PassOptions = PassOptions()) -> pa.Table:
    """The rows of ``batch`` plus each job's result columns (``jobs``: :class:`stages.train.stage.ForwardJob`, one per
    model; ragged in, ragged out; row order kept), checked against ``spec``; the batch's counters are recorded beside
    ``output`` (:func:`stages.runner.write_partials`). Every pass (the LoRA base pass too) runs under ``options``, as
    :func:`forward_rows`; with ``options.fused`` the counter ``fused_micro_batches`` counts the fused log-prob
    micro-batches. Every rank of an actor group (stages/train/actor_forward.py) runs each batch through it."""
    cpu_start = time.process_time()
    rows = TokenRows.from_arrow(batch, where, columns=())
    counters = {"tokens": 0.0, "padded_tokens": 0.0, "seconds": 0.0, "rows": float(batch.num_rows)}
    if options.fused:  # present only when asked: an unfused pass records what it did before the option
        counters["fused_micro_batches"] = 0.0
    for job, model in zip(jobs, models):
        result = forward_rows(model, rows, max_tokens, kind=job.kind, entropy=job.entropy, device=device,
                              options=options)
        produced = {job.column: result.columns["values" if job.kind == "values" else "log_probs"]}
        produced.update({c: produced[job.column] for c in job.copies})
        if job.entropy:
            produced["entropy"] = result.columns["entropy"]
        if job.base_column is not None:  # the LoRA model with its adapter off is exactly its base
            with model.disable_adapter():
                base = forward_rows(model, rows, max_tokens, device=device, options=options)
            produced[job.base_column] = base.columns["log_probs"]
            result.tokens, result.padded_tokens = result.tokens + base.tokens, result.padded_tokens + base.padded_tokens
            result.seconds += base.seconds
            if options.fused:
                counters["fused_micro_batches"] += base.extra["fused_micro_batches"]
        for name, ragged in produced.items():
            if name in batch.column_names:
                batch = batch.drop_columns([name])
            batch = batch.append_column(pa.field(name, FLOATS), ragged.to_arrow(pa.float32()))
        counters["tokens"] += result.tokens
        counters["padded_tokens"] += result.padded_tokens
        counters["seconds"] += result.seconds
        if options.fused:
            counters["fused_micro_batches"] += result.extra.get("fused_micro_batches", 0)
    counters["cpu_seconds"] = time.process_time() - cpu_start
    counters["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    check_row_invariants(spec, batch, f"{where} (forward output)")
    key = batch.column("row_id")[0].as_py() if batch.num_rows else "empty"
    write_partials(output, key, counters)
    return batch


def load_forward_model(path: str, kind: str, dtype: str = "fp32", *, actor_dir: str | None = None, seed: int = 42,
                       device: torch.device | str = "cpu", adapter: str | None = None) -> torch.nn.Module:
    """The model of a forward pass, in eval mode: a causal LM (``log_probs``; with ``adapter``, the base model at
    ``path`` plus that LoRA adapter, :func:`stages.train.lora.load_with_adapter`) or the critic (``values``: the saved
    critic at ``path``, or, when ``path`` holds none yet, a new head on ``actor_dir`` seeded as training does)."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    require_device(device)
    if kind == "values":
        model = models.load_critic_model(path if actor_dir is None else None, actor_dir or path, seed)
    elif adapter is not None:
        model = load_with_adapter(path, adapter)  # cast below with its adapter, as DeepSpeed casts the trained one
    else:
        model = models.load_actor_model(path)
    return cast_parameters(model.to(device=device), torch_dtype).eval()


def require_device(device: torch.device | str) -> None:
    """:class:`ConfigError` when a pass asks for ``device`` cuda in a process that sees no CUDA device (a Ray GPU
    share on a node without CUDA, or a CPU build of torch)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: cuda, but this process (pid {os.getpid()}) sees no CUDA device (torch "
                          f"{torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                          "set device: cpu, or install a CUDA build of torch on the GPU nodes")


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with its floating-point parameters in ``dtype`` and its buffers as loaded, as DeepSpeed casts the
    module it trains in bf16/fp16 (params only: the rotary embedding's ``inv_freq`` stays float32). ``model.to(dtype)``
    would round the buffers too, and a bf16 pass then differed from the training forward (and from the actor group's
    pass on the held engine) by up to 0.22 nats a token on SmolLM2-135M (issue 44)."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def _same_architecture(a: str, b: str) -> bool:
    """Two HF model folders whose config.json describe the same architecture (weights may differ)."""
    def arch(folder: str) -> dict:
        config = json.loads((Path(folder) / "config.json").read_text())
        return {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version", "torch_dtype",
                                                              "dtype", "use_cache")}
    return arch(a) == arch(b)


@torch.no_grad()
def load_weights_in_place(model: torch.nn.Module, path: str) -> bool:
    """Copy the safetensors weights of the HF folder ``path`` into ``model`` (same architecture, already in its
    dtype and device) — a new checkpoint of the same policy without building the model again. Returns False (and
    changes nothing) when the folder's tensors do not match the model's: then load it afresh."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return False
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    own = model.state_dict()
    tied = {k for k in own if k not in weights and getattr(model.config, "tie_word_embeddings", False)
            and k.endswith("lm_head.weight")}
    if set(weights) != set(own) - tied or any(weights[k].shape != own[k].shape for k in weights):
        return False
    for name, value in weights.items():
        own[name].copy_(value)
    return True


class ModelIdent(NamedTuple):
    """What a forward worker's model holds: the weights at ``path`` (content ``fingerprint``), run as ``kind`` in
    ``dtype`` on ``device``; a new critic head from ``actor_dir`` and ``seed``; or the base at ``path`` (content
    ``base_fingerprint``) plus the LoRA ``adapter`` (then ``fingerprint`` is the checkpoint's)."""

    path: str
    fingerprint: str
    kind: str
    dtype: str
    actor_dir: str | None
    seed: int
    device: str
    adapter: str | None = None
    base_fingerprint: str = ""


class ForwardModels:
    """The models a long-lived forward worker keeps: one per role (``old_log_probs``, ``ref_log_probs``,
    ``values``), each with the identity of what it holds (:class:`ModelIdent`). A new checkpoint of the same
    architecture is copied into the kept log-prob model in place (:func:`load_weights_in_place`), a new LoRA adapter
    on the same base into the kept LoRA model (:func:`stages.train.lora.load_adapter`); anything else is loaded
    afresh (:func:`load_forward_model`). Equal to a fresh load: tests/train/test_stage.py, tests/train/test_lora.py."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[ModelIdent, torch.nn.Module]] = {}
        self.loads = {"fresh": 0, "in_place": 0, "kept": 0}

    def get(self, role: str, path: str, kind: str, dtype: str, *, fingerprint: str = "", actor_dir: str | None = None,
            seed: int = 42, device: str = "cpu", adapter: str | None = None,
            base_fingerprint: str = "") -> torch.nn.Module:
        ident = ModelIdent(path, fingerprint, kind, dtype, actor_dir, seed, device, adapter, base_fingerprint)
        held = self._held.get(role)
        if held is not None and held[0] == ident and fingerprint:
            self.loads["kept"] += 1
            model = held[1]
        elif (held is not None and adapter is None and kind == "log_probs"
              and held[0][2:] == ident[2:]  # same kind, dtype, head, device; a plain model
              and _same_architecture(held[0].path, path) and load_weights_in_place(held[1], path)):
            self.loads["in_place"] += 1
            model = held[1]
        elif held is not None and adapter is not None and _adapter_in_place(held, ident):
            self.loads["in_place"] += 1
            model = held[1]
        else:
            self._held.pop(role, None)  # free the old model before loading the new one
            held = None
            model = load_forward_model(path, kind, dtype, actor_dir=actor_dir, seed=seed, device=device,
                                       adapter=adapter)
            self.loads["fresh"] += 1
        self._held[role] = (ident, model)
        return model


def _adapter_in_place(held: tuple[ModelIdent, torch.nn.Module], ident: ModelIdent) -> bool:
    """Copy the adapter of ``ident`` into the held LoRA model when it holds the same base (path and content, dtype,
    device) with an adapter of the same options; False (the held model is then dropped) otherwise."""
    was, model = held
    if not (was.adapter is not None and ident.base_fingerprint and (was.path, was.base_fingerprint, was.kind,
            was.dtype, was.device) == (ident.path, ident.base_fingerprint, ident.kind, ident.dtype, ident.device)
            and same_adapter_options(model, ident.adapter)):
        return False
    try:
        load_adapter(model, ident.adapter)  # copied into the model's dtype, as a fresh load casts it
    except RollflowError:
        return False  # partly copied: the caller loads afresh
    return True
