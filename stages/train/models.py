"""Loading the models a training or forward process runs: the actor (a causal LM) and the critic (a token
classifier with one label), in float32 with every dropout off; and compiling a model's decoder layers
(``strategy_args.torch_compile``). No Ray or DeepSpeed import; LoRA wrapping is ``stages.train.lora``'s."""

from __future__ import annotations

import torch

from schemas.errors import ConfigError
from schemas.train_config import WorkerTrainConfig


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout to 0: the ratio of new to old log-probs must compare the same function (and the critic's
    value head would otherwise get Hugging Face's default classifier dropout of 0.1)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for name in ("attention_dropout", "hidden_dropout", "classifier_dropout"):
        if getattr(model.config, name, None):
            setattr(model.config, name, 0.0)
    return model


def load_actor_model(model_dir: str, worker: WorkerTrainConfig | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return disable_dropout(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))


def load_critic_model(critic_dir: str | None, actor_dir: str, seed: int) -> torch.nn.Module:
    """The critic: a saved one, or the actor's backbone with a new one-label value head initialised from ``seed``
    (deterministic, so the values stage and the first training step see the same critic). No dropout."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    if critic_dir is not None:
        return disable_dropout(AutoModelForTokenClassification.from_pretrained(critic_dir, dtype=torch.float32))
    config = AutoConfig.from_pretrained(actor_dir, num_labels=1)
    model = disable_dropout(AutoModelForTokenClassification.from_pretrained(actor_dir, config=config,
                                                                            dtype=torch.float32))
    generator = torch.Generator().manual_seed(seed)
    head = model.score
    with torch.no_grad():
        std = getattr(model.config, "initializer_range", 0.02)
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
        if head.bias is not None:
            head.bias.zero_()
    return model


def compile_decoder_layers(model: torch.nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (regional compilation: one graph, reused by every layer, with
    dynamic shapes, since micro-batches differ in rows and length). The embedding, head and loss stay eager."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"strategy_args.torch_compile: {type(model).__name__} has no decoder layers at "
                          f"model.{getattr(model, 'base_model_prefix', '?')}.layers to compile; set torch_compile: "
                          "false for this model")
    for layer in layers:
        layer.compile(dynamic=True)
