"""One trained model under a DeepSpeed engine (:class:`Engine`): the actor (causal LM) or the critic (one-label token
head), with its forward, backward and optimizer step, its resumable DeepSpeed state and its whole weights (gathered
from the ranks under ZeRO-3, merged with LoRA). No Ray import; DeepSpeed is imported by the functions that use it
(through :func:`stages.train.distributed.import_deepspeed`)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from schemas.errors import InvariantError
from schemas.train_config import WorkerTrainConfig
from stages.train import lora
from stages.train.batching import (MicroBatch, TokenHidden, TokenLogits, causal_lm_logits, forward_packed, select_hidden,
                                   select_logits)
from stages.train.distributed import DistInfo, import_deepspeed
from stages.train.engine_config import deepspeed_config, lr_lambda
from stages.train.models import compile_decoder_layers
from stages.train.packed_attention import attention_for, set_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Engine:
    """One trained model under a DeepSpeed engine: the actor (causal LM) or the critic (one-label token head)."""

    def __init__(self, model: torch.nn.Module, worker: WorkerTrainConfig, dist: DistInfo, role: str):
        deepspeed = import_deepspeed()
        self.role, self.worker, self.dist = role, worker, dist
        self.lora = lora.is_lora(model)
        set_attention(model, attention_for(worker.model_args.attn_implementation, worker.use_sequence_packing,
                                           dist.device), "model_args.attn_implementation")
        if not worker.model_args.disable_gradient_checkpointing:
            model.gradient_checkpointing_enable()
            if self.lora:  # frozen embeddings: reentrant checkpointing needs inputs that require grad
                model.enable_input_require_grads()
        if worker.strategy_args.torch_compile:
            compile_decoder_layers(model)
        t = worker.training_args
        self.schedule = lr_lambda(t.lr_scheduler_type, t.warmup_steps, t.max_steps)
        config = deepspeed_config(worker, dist.device.type == "cuda")
        self.optimizer_params = config["optimizer"]["params"]
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, self.schedule))
        if self.lora:
            self.engine.module_state_dict = self._trainable_state_dict
        self.engine.train()

    def _trainable_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        """DeepSpeed's ``module_state_dict`` for a LoRA engine: with ``exclude_frozen_parameters`` only the trained
        parameters. DeepSpeed's own filter walks ``named_parameters()``, which lists a tied weight once, so the
        frozen output layer tied to the embeddings (the largest matrix) would stay in every state."""
        state = self.engine.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if not exclude_frozen_parameters:
            return state
        trained = {prefix + name for name, p in self.engine.module.named_parameters() if p.requires_grad}
        return type(state)((k, v) for k, v in state.items() if k in trained)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def forward(self, mb: MicroBatch) -> TokenLogits | TokenHidden | torch.Tensor:
        """The actor's logits at the loss tokens (:class:`TokenLogits`; :class:`TokenHidden`, the hidden states there
        and the output layer, with ``fused_output_layer``), or the critic's values ``(b, S, 1)``. Rows
        are right-padded and attention is causal, so padding is invisible to real tokens and no attention mask is
        passed (the fast causal path). With ``use_sequence_packing`` the rows run as one packed row (the critic's
        values come back in the padded layout, padding 0)."""
        packed = self.worker.use_sequence_packing and not mb.padding_step
        if self.role == "actor" and self.worker.fused_output_layer:
            return select_hidden(self.engine, mb, packed)
        if self.role == "actor":
            return select_logits(partial(causal_lm_logits, self.engine), mb, packed)

        def call(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            return self.engine(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

        return forward_packed(call, mb) if packed else call(mb.input_ids, mb.position_ids)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss)

    def step(self) -> dict[str, float]:
        """The optimizer step at the end of a mini-batch: gradient norm (before clipping) and the LR used."""
        lr = float(self.scheduler.get_last_lr()[0])
        own_norm = None
        if not hasattr(self.engine.optimizer, "_global_grad_norm"):  # ZeRO-0 fp32 computes it but keeps it
            grads = [p.grad.detach().float().norm() for p in self.module.parameters() if p.grad is not None]
            own_norm = float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0
        self.engine.step()
        norm = own_norm if own_norm is not None else self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return {f"{self.role}/grad_norm": norm, f"{self.role}/lr": lr}

    @property
    def optimizer_steps(self) -> int:
        return int(self.engine.global_steps)

    def save_state(self, folder: str) -> None:
        """DeepSpeed's resumable state (module, ZeRO optimizer partitions, LR schedule) into ``folder``; every rank
        calls it. With LoRA the frozen base weights are left out: the state holds the adapters and their optimizer
        moments only (the base is read again from its own folder)."""
        self.engine.save_checkpoint(folder, tag="state", save_latest=False, exclude_frozen_parameters=self.lora)

    def load_state(self, folder: str) -> None:
        path, _ = self.engine.load_checkpoint(folder, tag="state", load_optimizer_states=True,
                                              load_lr_scheduler_states=True, load_module_strict=not self.lora)
        if path is None:
            raise InvariantError(f"DeepSpeed state of the {self.role} at {folder} could not be loaded; the checkpoint "
                                 "is incomplete — resume from an earlier checkpoint")
        self._apply_configured_hyperparameters()

    def _apply_configured_hyperparameters(self) -> None:
        """After a state is loaded, the configured optimizer settings are the truth and the saved counters carry
        over. DeepSpeed restores the saved run's scheduler (``base_lrs``, last LR) and each param group's lr,
        weight_decay, betas and eps; this sets the configured peak LR as every group's base, the LR to base x the
        schedule's factor at the restored step (``last_epoch``), and the configured weight_decay, betas and eps.
        Under the saved run's config it rewrites the same values (the same float product LambdaLR computes)."""
        params = self.optimizer_params
        state = self.scheduler.state_dict()
        groups = self.engine.optimizer.param_groups  # ZeRO 0-3 wrappers expose their optimizer's groups
        base = [float(params["lr"])] * len(groups)
        last = [b * self.schedule(state["last_epoch"]) for b in base]
        self.scheduler.load_state_dict({**state, "base_lrs": base, "_last_lr": last})
        for group, b, lr in zip(groups, base, last):
            group.update(lr=lr, initial_lr=b, weight_decay=params["weight_decay"], eps=params["eps"],
                         betas=type(group["betas"])(params["betas"]))

    @property
    def partitioned(self) -> bool:
        """Whether the parameters themselves are split over the ranks (ZeRO-3): reading whole weights is then a
        collective that every rank must enter."""
        return self.worker.strategy_args.zero_stage == 3

    def state_dict_for_save(self) -> dict[str, torch.Tensor] | None:
        """The full weights on CPU; with LoRA the merged weights ``W + s B A`` under the plain model's names. ZeRO 0-2
        keep every parameter on every rank, so any rank may call it alone. Under ZeRO-3 every rank must call it
        (the parameters are gathered from all ranks) and rank 0 gets the weights, the others None."""
        if self.partitioned:
            return gathered_state_dict(self.module, self.dist.rank == 0)
        if self.lora:
            return lora.merged_state_dict(self.module)
        return {k: v.detach().to("cpu") for k, v in self.module.state_dict().items()}

    def save_pretrained(self, folder: Path, adapter: Path) -> None:
        """The model as a plain Hugging Face folder, written by rank 0 (every rank calls it: under ZeRO-3 the
        weights are gathered from all of them); with LoRA also the adapter alone into ``adapter`` (peft's format),
        from which training resumes on the base."""
        if self.dist.rank != 0:
            if self.partitioned:
                self.state_dict_for_save()
            return
        folder.mkdir(parents=True, exist_ok=True)
        if not self.lora:
            self.module.save_pretrained(folder, state_dict=self.state_dict_for_save(), safe_serialization=True)
            return
        self.module.get_base_model().save_pretrained(folder, state_dict=self.state_dict_for_save(),
                                                     safe_serialization=True)
        lora.save_adapter(self.module, str(adapter))


def gathered_state_dict(module: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor] | None:
    """The whole weights of a ZeRO-3 ``module`` (parameters split over the ranks), gathered one module at a time so
    that at most one layer is whole on a rank at once; every rank calls it, the one with ``keep`` gets the CPU
    copies (under the names of ``module.state_dict()``; a tied weight is one tensor under both names), the others
    None. DeepSpeed's ``GatheredParameters`` without a modifier rank: read-only, nothing is scattered back."""
    deepspeed = import_deepspeed()
    out: dict[str, torch.Tensor] | None = {} if keep else None
    copies: dict[int, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        own = list(sub.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(own, modifier_rank=None):
            if out is None:
                continue
            for name, param in sub.named_parameters(recurse=False):
                if id(param) not in copies:
                    copies[id(param)] = param.detach().to("cpu", copy=True)
                out[f"{prefix}.{name}" if prefix else name] = copies[id(param)]
            for name, buffer in sub.named_buffers(recurse=False):
                if name not in sub._non_persistent_buffers_set:
                    out[f"{prefix}.{name}" if prefix else name] = buffer.detach().to("cpu", copy=True)
    return out
