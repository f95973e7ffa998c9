"""LoRA adapters of a trained model (``model_args.lora_rank``), through peft. No Ray or DeepSpeed import.

With LoRA on, the base weights ``W`` are frozen and each target linear layer computes ``W x + s B (A x)`` with
``s = lora_alpha / lora_rank``, ``A`` (r x k) and ``B`` (d x r) the trained adapter (spec of LoRA: Hu et al. 2021).
Only the adapters (and a critic's value head, which is new and must train) are passed to the optimizer, so its
state holds them alone. The rest of the pipeline never sees an adapter: a checkpoint's weights files hold the merged
weights ``W + s B A`` (:func:`merged_state_dict`), a plain Hugging Face model; the adapter itself is saved beside
them (peft's format) together with the base it applies to, from which training resumes exactly.

The adapter's initial ``A`` is random (``B`` is zero, so the first forward equals the base): it is drawn from a
generator seeded by ``training_args.seed``, so every rank, and a replay of the same steps, starts from the same one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from schemas.errors import ConfigError, RollflowError
from schemas.train_config import ModelArgs

ADAPTER_NAME = "default"
CRITIC_HEAD = "score"  # the value head of AutoModelForTokenClassification: trained fully, saved with the adapter


def lora_config(args: ModelArgs, role: str):
    """peft's ``LoraConfig`` of ``args`` (no dropout: the PPO ratio compares one function; bias frozen)."""
    from peft import LoraConfig

    targets = list(args.lora_target_modules)
    return LoraConfig(r=args.lora_rank, lora_alpha=args.effective_lora_alpha,
                      target_modules="all-linear" if targets == ["all"] else targets, lora_dropout=0.0,
                      bias="none", modules_to_save=[CRITIC_HEAD] if role == "critic" else None)


def wrap(model: torch.nn.Module, args: ModelArgs, role: str, seed: int) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``args.lora_target_modules`` (a peft ``PeftModel``): only the adapters (and
    the critic's value head) require gradients. The adapters' random init is seeded by ``seed``."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            peft_model = get_peft_model(model, lora_config(args, role))
        except ValueError as err:
            raise ConfigError(f"{role}_train.model_args.lora_target_modules {list(args.lora_target_modules)}: peft "
                              f"found no layer of {type(model).__name__} to adapt ({err}); name linear layers of "
                              "this model (e.g. q_proj, v_proj for Llama-style models)") from None
    return peft_model


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def trainable_parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict of a LoRA model, on the CPU: every adapted weight is ``W + s B A`` (computed
    here, out of place: the model itself is not merged, since merging and unmerging in place would not give back
    ``W`` bit for bit), the critic's trained value head replaces its original, and the names are the plain model's
    (``...q_proj.weight``, ``score.weight``), so ``from_pretrained`` loads the result as an ordinary model."""
    from peft.tuners.lora import LoraLayer

    inner = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for name, module in inner.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
            deltas[f"{name}.weight"] = module.get_delta_weight(ADAPTER_NAME)
    out: dict[str, torch.Tensor] = {}
    for key, value in inner.state_dict().items():
        if ".lora_" in key or ".original_module." in key:
            continue
        plain = key.replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER_NAME}.", ".")
        delta = deltas.pop(plain, None)
        merged = value if delta is None else value + delta.to(value.dtype)
        out[plain] = merged.detach().to("cpu")  # not copied: tied weights stay one tensor, saved once
    if deltas:
        raise RollflowError(f"merging the LoRA adapters: the adapted layers {sorted(deltas)} have no base weight in "
                            "the model's state dict; this peft version names them differently — use the peft "
                            "version of requirements.lock")
    return out


def save_adapter(model: torch.nn.Module, folder: str) -> None:
    """The adapter alone (peft's folder: ``adapter_config.json``, ``adapter_model.safetensors``), which vLLM's LoRA
    support and ``PeftModel.from_pretrained`` read."""
    model.save_pretrained(folder, safe_serialization=True)


@torch.no_grad()
def load_adapter(model: torch.nn.Module, folder: str) -> None:
    """Set the adapter weights of the LoRA ``model`` from an adapter folder written by :func:`save_adapter`; every
    adapter weight must be there."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(folder) / "adapter_model.safetensors"
    if not path.is_file():
        raise RollflowError(f"LoRA adapter {path} is missing; the checkpoint is incomplete — resume from an earlier "
                            "checkpoint")
    result = set_peft_model_state_dict(model, load_file(str(path)), adapter_name=ADAPTER_NAME)
    missing = [k for k in result.missing_keys if ".lora_" in k or f".modules_to_save.{ADAPTER_NAME}." in k]
    if missing or result.unexpected_keys:
        raise RollflowError(f"LoRA adapter {folder} does not fit the model built from the config's LoRA options "
                            f"(missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}); resume with the "
                            "lora_rank and lora_target_modules the checkpoint was trained with")
