"""Variable-length attention for packed micro-batches (``use_sequence_packing``), registered with Hugging Face.

A packed micro-batch is one row of ``T = Σ L_i`` tokens whose position ids restart at 0 for every row
(``stages.train.batching.forward_packed``). Hugging Face's ``sdpa`` reads the restarts as separate sequences and
builds a block-diagonal ``(1, 1, T, T)`` mask: O(T²) memory, and SDPA leaves its fused causal kernels. The attention
registered here (:data:`PACKED_ATTENTION`) reads the segments from the position ids instead (``cu_seqlens``, the
offsets where a new row starts) and runs

* on CUDA in bf16/fp16: torch's FlashAttention-2 variable-length kernel (``torch.nn.attention.varlen.varlen_attn``,
  causal, the model's scaling, grouped key/value heads by the kernel's ``enable_gqa``): O(T) memory;
* where that kernel cannot run (CPU, float32, head size over 256): causal SDPA on each segment's slice of q/k/v
  (``is_causal=True``): O(Σ L_i²) work, and no (T, T) tensor either.

Its mask function builds no mask for a one-row prefill without a padding mask (packed or not: the attention reads the
segments itself) and gives Hugging Face's ``sdpa`` mask otherwise. Inputs that are not packed (several rows, no
restart, a cache, a padding mask, a sliding-window or bidirectional layer) go to Hugging Face's ``sdpa`` attention
unchanged. ``model_args.attn_implementation`` / the log-prob pass's ``attn_implementation`` choose it
(:func:`attention_for`). No Ray import; transformers is imported when the attention is first registered.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections import Counter
from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

from schemas.errors import ConfigError

PACKED_ATTENTION = "rollflow_packed_varlen"  # its name in transformers' AttentionInterface and mask registry
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_MAX_HEAD_DIM = 256
# the kernel's first versions take is_causal and neither scale nor enable_gqa; later ones a window ((-1, 0): causal)
VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)

# how each call of the packed attention ran, by path: "varlen" (torch's flash kernel), "segments" (per-segment SDPA),
# "sdpa" (not packed: Hugging Face's sdpa unchanged). Read by the tests and the GPU smoke check.
calls: Counter[str] = Counter()


def attention_for(choice: str, packed: bool, device: torch.device | str) -> str:
    """The Hugging Face attention implementation of a model whose micro-batches run ``packed`` on ``device`` under the
    option ``choice``: ``auto`` is the packed attention on CUDA with packing and ``sdpa`` otherwise, ``fa2`` the
    packed attention (on CPU its per-segment SDPA), ``sdpa`` Hugging Face's."""
    if choice == "auto":
        return PACKED_ATTENTION if packed and torch.device(device).type == "cuda" else "sdpa"
    return PACKED_ATTENTION if choice == "fa2" else "sdpa"


def segment_offsets(position_ids: torch.Tensor) -> torch.Tensor:
    """``(1, T)`` position ids → ``(n + 1,)`` int32 offsets of the ``n`` segments (``cu_seqlens``): a segment starts
    wherever a position is not its predecessor's plus one, as Hugging Face's packed-sequence detection reads them."""
    pos = position_ids[0]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    first = starts.nonzero().flatten()
    return torch.cat([first, first.new_tensor([pos.numel()])]).to(torch.int32)


def varlen_runs(query: torch.Tensor, dropout: float, scaling: float | None) -> bool:
    """Whether torch's variable-length flash kernel runs ``query`` ``(1, H, T, D)``: CUDA (compute capability 8.0 or
    newer), bf16/fp16, head size a multiple of 8 up to 256, no dropout, a scaling the kernel takes (its first versions
    only 1/sqrt(head size))."""
    head_dim = query.shape[-1]
    scalable = "scale" in VARLEN_PARAMS or scaling is None or math.isclose(scaling, head_dim ** -0.5)
    if not (query.is_cuda and query.dtype in VARLEN_DTYPES and dropout == 0.0 and scalable):
        return False
    return (head_dim % 8 == 0 and head_dim <= VARLEN_MAX_HEAD_DIM
            and torch.cuda.get_device_capability(query.device) >= (8, 0))


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor,
                     scaling: float | None) -> torch.Tensor:
    """Causal attention of each segment over itself with torch's variable-length flash kernel: ``query``
    ``(1, Hq, T, D)``, ``key``/``value`` ``(1, Hkv, T, D)``, ``offsets`` ``(n + 1,)`` → ``(1, T, Hq, D)``. The
    kernel's own grouped-query support where it has one, else the key/value heads repeated."""
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (T, H, D)
    options = {"is_causal": True} if "is_causal" in VARLEN_PARAMS else {"window_size": (-1, 0)}
    if scaling is not None and "scale" in VARLEN_PARAMS:
        options["scale"] = scaling
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in VARLEN_PARAMS:
            options["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    longest = int((offsets[1:] - offsets[:-1]).max())
    return varlen_attn(q, k, v, offsets, offsets, longest, longest, **options).unsqueeze(0)


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor,
                      scaling: float | None, dropout: float) -> torch.Tensor:
    """The same causal attention per segment where the flash kernel cannot run: SDPA over each segment's slice of
    ``query`` ``(1, Hq, T, D)`` and ``key``/``value`` ``(1, Hkv, T, D)`` with ``is_causal=True``
    → ``(1, T, Hq, D)``."""
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    grouped = key.shape[1] != query.shape[1]
    parts = [F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                            enable_gqa=grouped)
             for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, *, standard, **kwargs) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function contract (``query`` ``(b, Hq, S, D)``, ``key``/``value`` ``(b, Hkv, S, D)``
    → ``(b, S, Hq, D)``, no weights). One row of packed segments (``kwargs["position_ids"]`` restarting, no mask, no
    cache, a causal full-attention layer) runs :func:`varlen_attention` or :func:`segment_attention`; anything else
    ``standard`` (Hugging Face's ``sdpa_attention_forward``) with every argument as given."""
    position_ids = kwargs.get("position_ids")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (attention_mask is None and position_ids is not None and query.shape[0] == 1 and causal
            and key.shape[2] == query.shape[2] == position_ids.shape[-1] and kwargs.get("sliding_window") is None):
        offsets = segment_offsets(position_ids.reshape(1, -1))
        if offsets.numel() > 2:
            if varlen_runs(query, dropout, scaling):
                calls["varlen"] += 1
                return varlen_attention(query, key, value, offsets, scaling), None
            calls["segments"] += 1
            return segment_attention(query, key, value, offsets, scaling, dropout), None
    calls["sdpa"] += 1
    return standard(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)


def packed_attention_mask(*, standard, **kwargs) -> torch.Tensor | None:
    """Hugging Face's mask-function contract (keyword arguments of ``masking_utils.sdpa_mask``): no mask for one row
    of full causal attention from position 0 without a padding mask, custom mask functions or a local window (the
    attention reads the segments from the position ids), ``standard`` (``sdpa_mask``) otherwise."""
    if (kwargs.get("batch_size") == 1 and kwargs.get("attention_mask") is None and not kwargs.get("q_offset")
            and not kwargs.get("kv_offset") and kwargs.get("q_length") == kwargs.get("kv_length")
            and kwargs.get("local_size") is None and not kwargs.get("use_vmap")
            and not kwargs.get("allow_is_bidirectional_skip")):
        return None
    return standard(**kwargs)


def register() -> str:
    """Register :data:`PACKED_ATTENTION` (the attention and its mask function) with transformers, once per process;
    returns its name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if PACKED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_ATTENTION,
                                    partial(packed_attention_forward, standard=sdpa_attention_forward))
        AttentionMaskInterface.register(PACKED_ATTENTION, partial(packed_attention_mask, standard=sdpa_mask))
    return PACKED_ATTENTION


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model under a DeepSpeed engine (``.module``); a PEFT wrapper forwards to its base itself."""
    return getattr(model, "module", model)


def set_attention(model: torch.nn.Module, name: str, option: str = "attn_implementation") -> None:
    """Make ``model`` (a Hugging Face model, also under PEFT or a DeepSpeed engine) run attention ``name``; refuses a
    model that takes no named attention implementation (``option``: the config field to name in the error)."""
    model = hf_model(model)
    if name == PACKED_ATTENTION:
        register()
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if current == name:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    if getattr(getattr(model, "config", None), "_attn_implementation", None) != name:
        raise ConfigError(f"{option}: {type(model).__name__} does not run attention through transformers' "
                          f"AttentionInterface, so its attention cannot be set to {name!r}; set {option}: sdpa (or "
                          "auto) for this model")


@contextlib.contextmanager
def attention_used(model: torch.nn.Module, name: str, option: str = "attn_implementation") -> Iterator[None]:
    """``model`` runs attention ``name`` inside the block and what it ran before after it (a held training engine
    keeps its own choice for training)."""
    before = getattr(getattr(hf_model(model), "config", None), "_attn_implementation", None)
    set_attention(model, name, option)
    try:
        yield
    finally:
        if before is not None and before != name:
            set_attention(model, before, option)
