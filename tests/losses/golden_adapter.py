"""Turn a golden ROLL loss case (padded logits, ROLL's option names) into our LossInputs / LossConfig."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from stages.losses import LossConfig, LossInputs, TrainInferCorrectionConfig, op_compute_entropy, op_compute_log_probs
from stages.losses.train_infer import IsWeightConfig
from tests.golden import GoldenCase


def loss_config(case: GoldenCase, **overrides) -> LossConfig:
    """ROLL's params of the case → LossConfig (dotted ``*is_weight.enabled`` keys included)."""
    p = case.params
    fields = {f.name for f in dataclasses.fields(LossConfig)} - {"train_infer_correction"}
    opts = {k: v for k, v in p.items() if k in fields}
    correction = TrainInferCorrectionConfig.from_dict(p.get("train_infer_correction"))
    for key in ("train_infer_correction.is_weight.enabled", "is_weight.enabled"):
        if key in p:
            correction = dataclasses.replace(correction, is_weight=IsWeightConfig(enabled=p[key]))
    opts.update(overrides)
    return LossConfig(train_infer_correction=correction, **opts)


def recompute_on(case: GoldenCase) -> bool:
    """ROLL's enable_old_logprobs_recompute (default False): True → the IS weight comes precomputed in the batch."""
    return bool(case.params.get("enable_old_logprobs_recompute", False))


def loss_inputs(case: GoldenCase, cfg: LossConfig, **overrides) -> tuple[LossInputs, torch.Tensor]:
    """(LossInputs, logits leaf with requires_grad) for a golden actor-loss case."""
    i = case.inputs
    logits = torch.tensor(i["logits"], requires_grad=True)
    response_mask = torch.tensor(i["response_mask"])
    t = {k: torch.tensor(i[k]) for k in ("old_log_probs", "ref_log_probs", "infer_logprobs", "advantages",
                                         "train_infer_is_weight") if k in i}
    kwargs = dict(
        log_probs=op_compute_log_probs(logits, torch.tensor(i["input_ids"]), response_mask),
        mask=response_mask[:, 1:], advantages=t["advantages"], old_log_probs=t["old_log_probs"],
        ref_log_probs=t["ref_log_probs"], infer_log_probs=t.get("infer_logprobs"),
        train_infer_is_weight=t["train_infer_is_weight"] if recompute_on(case) else None,
        entropy=op_compute_entropy(logits, response_mask) if cfg.entropy_loss_coef > 0 else None,
        final_mask=torch.tensor(i["final_response_mask"]) if "final_response_mask" in i else None,
        num_tokens=float(i["batch_num_tokens"]), num_seqs=float(i["global_valid_samples"]),
        difficulty=i.get("difficulty"))
    kwargs.update(overrides)
    return LossInputs(**kwargs), logits


def golden_metrics(case: GoldenCase) -> dict[str, float]:
    """The case's metrics under ROLL's names (``actor/pg_loss@sum``)."""
    return {k[len("metric:"):].replace("|", "/"): float(v) for k, v in case.outputs.items()
            if k.startswith("metric:")}


def run_loss(fn, inputs: LossInputs, cfg: LossConfig, logits: torch.Tensor) -> tuple[float, dict, np.ndarray]:
    """(total loss, metrics, d loss / d logits)."""
    total, metrics = fn(inputs, cfg)
    total.backward()
    return float(total.detach()), metrics, logits.grad.numpy()
