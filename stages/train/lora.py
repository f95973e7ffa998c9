"""LoRA adapters of a trained model (``model_args.lora_rank``), through peft. No Ray or DeepSpeed import.

With LoRA on, the base weights ``W`` are frozen and each target linear layer computes ``W x + s B (A x)`` with
``s = lora_alpha / lora_rank``, ``A`` (r x k) and ``B`` (d x r) the trained adapter (spec of LoRA: Hu et al. 2021).
Only the adapters (and a critic's value head, which is new and must train) are passed to the optimizer, so its
state holds them alone. The rest of the pipeline never sees an adapter: a checkpoint's weights files hold the merged
weights ``W + s B A`` (:func:`merged_state_dict`), a plain Hugging Face model; the adapter itself is saved beside
them (peft's format) together with the base it applies to, from which training resumes exactly: the base of each
trained role is recorded in the checkpoint's train_state.json (:func:`lora_bases`), and :func:`build_actor_model` /
:func:`build_critic_model` rebuild a checkpoint's model from it.

The adapter's initial ``A`` is random (``B`` is zero, so the first forward equals the base): it is drawn from a
generator seeded by ``training_args.seed``, so every rank, and a replay of the same steps, starts from the same one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from schemas.errors import ConfigError, RollflowError
from schemas.train_config import ModelArgs, TrainSection, WorkerTrainConfig
from stages.train import models
from stages.train.checkpoint import ACTOR_ADAPTER, CRITIC_ADAPTER, checkpoint_fingerprint

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
    """Whether ``model`` is a peft model. Only a process that loaded peft can hold one, so where peft is not loaded
    (every run without LoRA) the answer is no without importing it (0.2 CPU-s per training process, seconds cold)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


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


# ---- one model for the policy and its reference (the log-prob stage) ------------------------------------------

def load_with_adapter(base_dir: str, adapter_dir: str) -> torch.nn.Module:
    """The base model of ``base_dir`` (float32, eval, no dropout) wrapped with the adapter saved in ``adapter_dir``
    (:func:`save_adapter`; its ``adapter_config.json`` gives rank, alpha and targets), as a peft model: with the
    adapter on it is the trained policy, under ``disable_adapter()`` exactly the base. One copy of the base
    weights; the adapter adds ``r (d_in + d_out)`` per adapted layer."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig.from_pretrained(adapter_dir)
    config.inference_mode = True
    with torch.random.fork_rng(devices=[]):  # peft draws an initial A, overwritten below: leave the global RNG alone
        model = get_peft_model(models.load_actor_model(base_dir), config)
    load_adapter(model, adapter_dir)
    return model.eval()


def same_adapter_options(model: torch.nn.Module, adapter_dir: str) -> bool:
    """The LoRA ``model``'s adapter has the options (rank, alpha, targets, ...) of the one saved in ``adapter_dir``,
    so that folder's weights can be copied into it (:func:`load_adapter`) in place of a fresh load."""
    from peft import LoraConfig

    def options(config) -> dict:
        return {"r": config.r, "lora_alpha": config.lora_alpha, "use_rslora": config.use_rslora,
                "use_dora": config.use_dora, "rank_pattern": config.rank_pattern,
                "alpha_pattern": config.alpha_pattern, "modules_to_save": config.modules_to_save,
                "target_modules": (sorted(config.target_modules) if isinstance(config.target_modules, (set, list))
                                   else config.target_modules)}
    return options(model.peft_config[ADAPTER_NAME]) == options(LoraConfig.from_pretrained(adapter_dir))


@torch.no_grad()
def merged_drift(base_dir: str, adapter_dir: str, merged_dir: str) -> tuple[float, float]:
    """How far the adapter of ``adapter_dir`` on the base weights of ``base_dir`` is from the merged weights of the
    checkpoint ``merged_dir``: ``(max |W + s B A - M|, max |M|)`` over every tensor (``inf`` when the names, shapes
    or adapter options do not fit). Read one tensor at a time (safetensors), so it needs no model in memory."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    if (config.get("use_rslora") or config.get("use_dora") or config.get("fan_in_fan_out")
            or config.get("rank_pattern") or config.get("alpha_pattern")):
        return float("inf"), 0.0  # not the plain s = alpha / r update that training uses
    scale = config["lora_alpha"] / config["r"]
    adapter = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    prefix = "base_model.model."
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in adapter.items():
        if key.endswith(".lora_A.weight"):
            layer = key.removeprefix(prefix).removesuffix(".lora_A.weight")
            pairs[f"{layer}.weight"] = (a, adapter[key.replace(".lora_A.", ".lora_B.")])
        elif ".lora_B." not in key:
            return float("inf"), 0.0  # a trained tensor other than LoRA's (a critic's head): not an actor adapter

    def tensors(folder: str) -> dict:  # name -> the open file that holds it
        handles = [safe_open(str(p), framework="pt") for p in sorted(Path(folder).glob("*.safetensors"))]
        return {name: h for h in handles for name in h.keys()}

    base, merged = tensors(base_dir), tensors(merged_dir)
    if set(base) != set(merged) or not set(pairs) <= set(merged):
        return float("inf"), 0.0
    drift = largest = 0.0
    for name, handle in merged.items():
        m = handle.get_tensor(name).float()
        w = base[name].get_tensor(name).float()
        if w.shape != m.shape:
            return float("inf"), 0.0
        if name in pairs:
            a, b = pairs[name]
            w = w + scale * (b.float() @ a.float())
        if m.numel():
            drift = max(drift, float((w - m).abs().max()))
            largest = max(largest, float(m.abs().max()))
    return drift, largest


def base_drift_problem(reference: str, adapter: Path, merged: str) -> str | None:
    """Why the model folder ``reference`` with the actor adapter in ``adapter`` is not the checkpoint ``merged``:
    their merged weights differ by more than a few units of rounding of the checkpoint's dtype (:func:`merged_drift`,
    which reads both models' files: 9 s of CPU for SmolLM2-135M on the loaded 2-core machine); else None. The slow
    path of stages/train/adapter_base.py ``why_not_adapter_base``, for a base whose fingerprint was not recorded."""
    drift, largest = merged_drift(reference, str(adapter), merged)
    dtype = _weights_dtype(merged)
    if not drift <= 4 * torch.finfo(dtype).eps * max(largest, 1.0):  # the merge's rounding, as check_lora_base
        return (f"the base {reference} with the adapter differs from the checkpoint's merged weights by up to "
                f"{drift:.3g}: the base folder changed since training")
    return None


def _weights_dtype(folder: str) -> torch.dtype:
    """The floating dtype of the first tensor of a model folder's safetensors files (a checkpoint is saved in one)."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(tensor.get_dtype())
                if dtype is not None:
                    return dtype
    return torch.float32


def lora_bases(info, cfg: TrainSection) -> dict[str, dict]:
    """Per role trained with LoRA (``actor``, ``critic``), what its adapter applies to: the options and the base
    folder(s), as the checkpoint's ``train_state.json`` records them. A role trained before keeps its record (its
    DeepSpeed state holds the optimizer state of exactly those adapters); a role that starts now takes the
    checkpoint's current weights as its base. Raises ConfigError when the config's LoRA options differ from those a
    role of ``info`` was trained with."""
    recorded = info.lora or {}
    out: dict[str, dict] = {}
    roles = [("actor", cfg.actor_train, info.global_step > 0)]
    if cfg.needs_critic:
        roles.append(("critic", cfg.critic_train, info.critic_dir is not None))
    for role, worker, trained in roles:
        options = worker.model_args.lora_options()
        record = recorded.get(role)
        if trained and (record or {}).get("options") != options:
            had = record["options"] if record else "full training (no LoRA)"
            raise ConfigError(f"checkpoint {info.path}: its {role} was trained with {had}, but "
                              f"{role}_train.model_args sets {options or 'full training (no LoRA)'}; its optimizer "
                              "state belongs to the trained parameters of that setting. Resume with the checkpoint's "
                              "lora_rank, lora_alpha and lora_target_modules, or start a new run from its weights "
                              "(a copy of the folder without deepspeed/, lora/ and train_state.json)")
        if options is None:
            continue
        if trained:
            out[role] = record
        elif role == "actor":  # the base's content fingerprint lets the log-prob stage see it is the reference
            out[role] = {"options": options, "base": info.path, "base_fingerprint": checkpoint_fingerprint(info.path)}
        else:
            out[role] = {"options": options, "base": info.critic_dir, "actor_base": info.path,
                         "seed": worker.training_args.seed}
    return out


def build_actor_model(info, worker: WorkerTrainConfig, base: dict | None) -> torch.nn.Module:
    """The actor of checkpoint ``info``: its weights, or with LoRA (``base``: its :func:`lora_bases` entry) the
    base model wrapped with the adapters, set from the checkpoint's adapter when it has one."""
    if base is None:
        return models.load_actor_model(info.path, worker)
    model = wrap(models.load_actor_model(base["base"], worker), worker.model_args, "actor",
                 worker.training_args.seed)
    if (Path(info.path) / ACTOR_ADAPTER).is_dir():
        load_adapter(model, str(Path(info.path) / ACTOR_ADAPTER))
    return model


def build_critic_model(info, worker: WorkerTrainConfig, base: dict | None) -> torch.nn.Module:
    """The critic of checkpoint ``info`` (:func:`stages.train.models.load_critic_model`), or with LoRA its base
    critic wrapped with the adapters (the value head trains fully), set from the checkpoint's critic adapter when it
    has one."""
    if base is None:
        return models.load_critic_model(info.critic_dir, info.path, worker.training_args.seed)
    model = wrap(models.load_critic_model(base["base"], base["actor_base"], base["seed"]), worker.model_args,
                 "critic", worker.training_args.seed)
    if (Path(info.path) / CRITIC_ADAPTER).is_dir():
        load_adapter(model, str(Path(info.path) / CRITIC_ADAPTER))
    return model
