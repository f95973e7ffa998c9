"""Whether a LoRA checkpoint's reference model is the base its actor adapter was trained on: the log-prob stage then
runs one model for the old and the reference log-probs (the adapter on, then off). The driver asks when it plans the
log-prob pass, so this module imports no torch: only a base whose content fingerprint the checkpoint did not record
has its weights compared (stages/train/lora.py ``base_drift_problem``, which imports torch and safetensors)."""

from __future__ import annotations

import os
from pathlib import Path

from stages.train.checkpoint import ACTOR_ADAPTER


def why_not_adapter_base(info, reference: str, reference_fingerprint: str = "") -> str | None:
    """None when the reference model folder ``reference`` is the base that the actor adapter of checkpoint ``info``
    (a :class:`stages.train.checkpoint.CheckpointInfo`) applies to — the folder its ``train_state.json`` records,
    still holding the weights the adapter was trained on: its content fingerprint ``reference_fingerprint`` is the
    recorded one, or (a checkpoint written before the record had it, or a base folder touched since) the base with
    the adapter gives the checkpoint's merged weights up to a few units of rounding of the checkpoint's dtype. Then
    the reference's log-probs are the LoRA model's with its adapter switched off, and one model serves both.
    Otherwise the reason (the reference is loaded as a model of its own)."""
    record = (info.lora or {}).get("actor")
    if record is None:
        return "the checkpoint's actor was not trained with LoRA"
    adapter = Path(info.path) / ACTOR_ADAPTER
    if not (adapter / "adapter_model.safetensors").is_file():
        return f"the checkpoint has no adapter {adapter}"
    if os.path.realpath(record["base"]) != os.path.realpath(reference):
        return f"the reference {reference} is not the base {record['base']} the adapter was trained on"
    if reference_fingerprint and record.get("base_fingerprint") == reference_fingerprint:
        return None
    from stages.train.lora import base_drift_problem  # torch: only for a base without a recorded fingerprint

    return base_drift_problem(reference, adapter, info.path)
