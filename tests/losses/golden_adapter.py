"""Turn a golden ROLL loss case (padded logits, ROLL's option names) into our LossInputs / LossConfig.

Every ``params`` entry of a loss case is dispatched here (an unknown one fails the test, see
``GoldenCase.check_params``):

* options of ROLL's loss_func → ``LossConfig`` fields of the same name (``train_infer_correction`` nested, and the
  dotted ``train_infer_correction.is_weight.enabled`` / ``is_weight.enabled``);
* ``enable_old_logprobs_recompute`` → True: the IS weight comes precomputed in the batch; False: the correction runs
  inside the loss, and without an ``old_log_probs`` input (or with a ``sample_uuid`` column) ROLL takes its cache
  path, old = detach(current log-probs), ratio 1 (spec §6.3 step 2) → our ``old_log_probs=None``;
* ``ppo_epochs`` → nothing to do for one call: the cache path only serves epochs after the first;
* ``batch_num_tokens`` / ``global_valid_samples`` → the global counts (the number, or the case's input of that name
  when the param describes it);
* ``final_response_mask`` (RLVR) → the case's ``final_response_mask`` input (the param describes it);
* ``difficulty_dtype`` (RLVR) → the ``difficulty`` column handed over with that numpy dtype (ROLL's DataProto stores
  it as ``object``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.losses import LossConfig, LossInputs, TrainInferCorrectionConfig, op_compute_entropy, op_compute_log_probs
from tests.golden import GoldenCase, family

AGENTIC_LOSS = "roll.pipeline.agentic.agentic_actor_worker.ActorWorker.loss_func"
BASE_LOSS = "roll.pipeline.base_worker.ActorWorker.loss_func"
RLVR_LOSS = "roll.pipeline.rlvr.actor_worker.ActorWorker.loss_func"
KIND_OF = {AGENTIC_LOSS: "agentic", BASE_LOSS: "base", RLVR_LOSS: "rlvr"}

_ROLL_OPTIONS = set(LossConfig.model_fields) - {"dual_clip_c", "sum_norm_constant", "kl_loss_type", "roll_compat"}
_COMMON = _ROLL_OPTIONS | {"enable_old_logprobs_recompute", "ppo_epochs", "batch_num_tokens", "global_valid_samples",
                           "train_infer_correction.is_weight.enabled", "is_weight.enabled"}
KNOWN_PARAMS = {"agentic": _COMMON, "base": _COMMON, "rlvr": _COMMON | {"final_response_mask", "difficulty_dtype"}}


def loss_cases(*kinds: str) -> list[str]:
    """Every golden actor-loss case of the given kinds (all three by default)."""
    kinds = kinds or ("agentic", "base", "rlvr")
    return family(*[f for f, k in KIND_OF.items() if k in kinds])


def kind_of(case: GoldenCase) -> str:
    return KIND_OF[case.function]


def loss_config(case: GoldenCase, **overrides) -> LossConfig:
    """ROLL's params of the case → LossConfig (dotted ``*is_weight.enabled`` keys included)."""
    p = case.check_params(KNOWN_PARAMS[kind_of(case)])
    opts = {k: v for k, v in p.items() if k in _ROLL_OPTIONS - {"train_infer_correction"}}
    correction = TrainInferCorrectionConfig.from_dict(p.get("train_infer_correction"))
    for key in ("train_infer_correction.is_weight.enabled", "is_weight.enabled"):
        if key in p:
            is_weight = correction.is_weight.model_copy(update={"enabled": bool(p[key])})
            correction = correction.model_copy(update={"is_weight": is_weight})
    opts.update(overrides)
    return LossConfig(train_infer_correction=correction, **opts)


def recompute_on(case: GoldenCase) -> bool:
    """ROLL's enable_old_logprobs_recompute (default False): True → the IS weight comes precomputed in the batch."""
    return bool(case.params.get("enable_old_logprobs_recompute", False))


def cache_path(case: GoldenCase) -> bool:
    """ROLL's cache path (spec §6.3 step 2): recompute off and no ``old_log_probs`` input (or a ``sample_uuid``
    column, which makes ROLL ignore the batch's old log-probs on the first epoch) → old = detach(current)."""
    if recompute_on(case):
        if "old_log_probs" not in case.inputs:
            pytest.fail(f"golden case {case.name}: enable_old_logprobs_recompute is on but there is no old_log_probs "
                        f"input", pytrace=False)
        return False
    return "old_log_probs" not in case.inputs or "sample_uuid" in case.inputs


def global_count(case: GoldenCase, name: str) -> float | None:
    """``batch_num_tokens`` / ``global_valid_samples``: a number in params, else the case's input, else None (our
    loss then counts the micro-batch's own mask, as for any missing global count)."""
    value = case.params.get(name)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if name in case.inputs:
            assert float(case.inputs[name]) == float(value), f"{case.name}: param {name} != input"
        return float(value)
    if name in case.inputs:
        return float(case.inputs[name])
    if value is not None:
        pytest.fail(f"golden case {case.name}: param {name} = {value!r} describes an input that is missing",
                    pytrace=False)
    return None


def final_mask(case: GoldenCase) -> np.ndarray | None:
    """RLVR's ``final_response_mask`` input ((B, S-1)), required when the params name it."""
    if "final_response_mask" in case.inputs:
        return case.inputs["final_response_mask"]
    if "final_response_mask" in case.params:
        pytest.fail(f"golden case {case.name}: params name final_response_mask but the input is missing",
                    pytrace=False)
    return None


def difficulty(case: GoldenCase):
    """The ``difficulty`` column with the params' ``difficulty_dtype`` (ROLL's DataProto: object)."""
    if "difficulty" not in case.inputs:
        return None
    return np.asarray(case.inputs["difficulty"], dtype=np.dtype(case.params.get("difficulty_dtype", "float64")))


def reference_args(case: GoldenCase) -> tuple[dict, dict]:
    """(inputs, params) for tests/losses/reference.py: the inputs with the global counts as :func:`global_count`
    resolves them and the difficulty column; ROLL's params plus ``recompute`` and ``cache``."""
    inputs = {k: v for k, v in case.inputs.items() if k not in ("batch_num_tokens", "global_valid_samples")}
    for name in ("batch_num_tokens", "global_valid_samples"):
        value = global_count(case, name)
        if value is not None:
            inputs[name] = np.float64(value)
    if kind_of(case) == "rlvr" and "difficulty" in inputs:
        inputs["difficulty"] = difficulty(case)
    if kind_of(case) != "rlvr":
        inputs.pop("final_response_mask", None)     # only RLVR's loss reads it
    return inputs, dict(case.params, recompute=recompute_on(case), cache=cache_path(case))


def loss_inputs(case: GoldenCase, cfg: LossConfig, **overrides) -> tuple[LossInputs, torch.Tensor]:
    """(LossInputs, logits leaf with requires_grad) for a golden actor-loss case."""
    i = case.inputs
    logits = torch.tensor(i["logits"], requires_grad=True)
    response_mask = torch.tensor(i["response_mask"])
    t = {k: torch.tensor(i[k]) for k in ("old_log_probs", "ref_log_probs", "infer_logprobs", "advantages",
                                         "train_infer_is_weight") if k in i}
    if recompute_on(case) and "train_infer_is_weight" not in t:
        pytest.fail(f"golden case {case.name}: enable_old_logprobs_recompute is on but there is no "
                    f"train_infer_is_weight input", pytrace=False)
    final = final_mask(case) if kind_of(case) == "rlvr" else None
    kwargs = dict(
        log_probs=op_compute_log_probs(logits, torch.tensor(i["input_ids"]), response_mask),
        mask=response_mask[:, 1:], advantages=t["advantages"],
        old_log_probs=None if cache_path(case) else t["old_log_probs"],
        ref_log_probs=t.get("ref_log_probs"), infer_log_probs=t.get("infer_logprobs"),
        train_infer_is_weight=t["train_infer_is_weight"] if recompute_on(case) else None,
        entropy=op_compute_entropy(logits, response_mask) if cfg.entropy_loss_coef > 0 else None,
        final_mask=None if final is None else torch.tensor(final),
        num_tokens=global_count(case, "batch_num_tokens"), num_seqs=global_count(case, "global_valid_samples"),
        difficulty=difficulty(case))
    kwargs.update(overrides)
    return LossInputs(**kwargs), logits


def golden_metrics(case: GoldenCase) -> dict[str, float]:
    """The case's metrics under ROLL's names (``actor/pg_loss@sum``)."""
    return case.metrics()


def run_loss(fn, inputs: LossInputs, cfg: LossConfig, logits: torch.Tensor) -> tuple[float, dict, np.ndarray]:
    """(total loss, metrics, d loss / d logits)."""
    total, metrics = fn(inputs, cfg)
    total.backward()
    return float(total.detach()), metrics, logits.grad.numpy()
