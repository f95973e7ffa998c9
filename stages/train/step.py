"""One PPO training step on DeepSpeed engines (spec §6, §0.4 step 10). No Ray import.

The critic's optimizer steps (gae) run first, then the actor's, each over ``ppo_epochs`` passes of seeded
mini-batches, each mini-batch as token-budget micro-batches whose losses use the mini-batch's global normalisers
(spec §6.2), so their accumulated gradient is the gradient of the mini-batch loss. Every rank holds the whole table
and takes its share by the plan (stages/train/batching.py); the micro-batch metrics of all ranks are combined per
optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from schemas.errors import InvariantError
from schemas.train_config import TrainSection
from stages.algos.ragged import Ragged
from stages.losses import apply_train_infer_correction_to_batch
from stages.train.batching import (MiniBatchPlan, TokenLogits, TokenRows, batching_policy, pad_micro_batch, plan_step,
                                   unpad_next_token)
from stages.train.distributed import DistInfo, gather
from stages.train.engine import Engine
from stages.train.objectives import ActorObjective, CriticObjective, Metrics


@dataclass
class StepReport:
    """What a training step did: metrics under ROLL's names (means over optimizer steps), the per-optimizer-step
    values, and throughput counters (real tokens forwarded and backpropagated, seconds in the loop)."""

    metrics: Metrics
    per_step: list[Metrics] = field(default_factory=list)
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def run_engine(engine: Engine, objective, rows: TokenRows, plans: list[MiniBatchPlan], pad_token_id: int,
               dist: DistInfo, progress=None) -> tuple[list[list[Metrics]], list[Metrics], int, int]:
    """Every optimizer step of ``plans`` on this rank → (micro-batch metrics per step, step metrics, tokens,
    padded tokens). The loss is scaled by the world size: DeepSpeed averages gradients over ranks, while the global
    normalisers already make the sum over ranks the mini-batch loss."""
    micro_metrics, step_metrics = [], []
    tokens = padded = 0
    for plan in plans:
        mine = []
        for k, index in enumerate(plan.micro_batches):
            mb = pad_micro_batch(rows, index, pad_token_id).to(dist.device)
            output = engine.forward(mb)
            if mb.padding_step:  # same collectives as the other ranks, zero gradient
                values = output.values if isinstance(output, TokenLogits) else output
                loss, metrics = values.float().sum() * 0.0, {}
            else:
                loss, metrics = objective(output, mb, index, plan)
            engine.backward(loss * dist.world_size, last=k == len(plan.micro_batches) - 1)
            mine.append(metrics)
            tokens += mb.real_tokens
            if not mb.padding_step:  # what the forward computed: a packed row has no padding
                padded += mb.real_tokens if engine.worker.use_sequence_packing else mb.padded_tokens
            if progress is not None:
                progress.add(1)
        step_metrics.append(engine.step())
        micro_metrics.append(mine)
    return micro_metrics, step_metrics, tokens, padded


def combine_metrics(per_rank: list[list[list[Metrics]]]) -> list[Metrics]:
    """Micro-batch metrics of all ranks → one dict per optimizer step, suffix dropped: ``@sum`` added, ``@max`` /
    ``@min`` extremes, anything else (``@mean`` or no suffix) averaged over micro-batches."""
    steps = []
    for k in range(len(per_rank[0])):
        merged: dict[str, list[float]] = {}
        for rank in per_rank:
            for metrics in rank[k]:
                for key, value in metrics.items():
                    merged.setdefault(key, []).append(float(value))
        out = {}
        for key, values in merged.items():
            name, _, kind = key.partition("@")
            reduce = {"sum": sum, "max": max, "min": min}.get(kind, lambda v: sum(v) / len(v))
            out[name] = float(reduce(values))
        steps.append(out)
    return steps


def mean_metrics(steps: list[Metrics]) -> Metrics:
    keys = sorted({k for s in steps for k in s})
    return {k: float(np.mean([s[k] for s in steps if k in s])) for k in keys}


def train_step(rows: TokenRows, actor: Engine | None, critic: Engine | None, cfg: TrainSection, dist: DistInfo,
               step: int, pad_token_id: int, progress=None) -> StepReport:
    """One training step over the whole table ``rows`` (every rank holds all rows and takes its share by the plan).

    ``step``: training steps done before this one (seeds the shuffle; the actor waits for ``critic_warmup``).
    ``progress``: a :class:`stages.progress.Ticker` told this rank's micro-batches (total, then one by one), or None."""
    start, cpu_start = time.perf_counter(), time.process_time()
    rows, correction = apply_train_infer_correction(rows, cfg)
    lengths, loss_tokens, final_tokens = rows.lengths, rows.loss_tokens(), rows.final_tokens()
    per_step: list[Metrics] = []
    tokens = padded = 0
    jobs = []
    if critic is not None:
        for col in ("values", "returns"):
            if col not in rows.next_token:
                raise InvariantError(f"the critic (adv_estimator {cfg.adv_estimator}) trains on '{col}', which the "
                                     "table lacks; run the values stage and the advantages stage first")
        jobs.append((critic, CriticObjective(cfg.value_clip), cfg.critic_train))
    if actor is not None and step >= cfg.critic_warmup:
        jobs.append((actor, ActorObjective.from_section(cfg), cfg.actor_train))
    planned = [(engine, objective, plan_step(lengths, loss_tokens, policy=batching_policy(worker),
                                             world_size=dist.world_size, rank=dist.rank, ppo_epochs=cfg.ppo_epochs,
                                             seed=worker.training_args.seed, step=step, final_tokens=final_tokens))
               for engine, objective, worker in jobs]
    if progress is not None:
        progress.total(sum(len(plan.micro_batches) for _, _, plans in planned for plan in plans))
    for engine, objective, plans in planned:
        micro, steps, n_tok, n_pad = run_engine(engine, objective, rows, plans, pad_token_id, dist, progress)
        combined = combine_metrics(gather(micro, dist))
        for i, s in enumerate(steps):
            combined[i].update(s)
        per_step = _zip_longest(per_step, combined)
        tokens += n_tok
        padded += n_pad
    counts = gather((tokens, padded), dist)
    report = StepReport(mean_metrics(per_step), per_step, sum(c[0] for c in counts), sum(c[1] for c in counts),
                        time.perf_counter() - start, time.process_time() - cpu_start)
    report.metrics.update(correction)
    report.metrics["system/tokens"] = float(report.tokens)
    report.metrics["system/padding_ratio"] = 1.0 - report.tokens / max(1, report.padded_tokens)
    return report


def _zip_longest(a: list[Metrics], b: list[Metrics]) -> list[Metrics]:
    n = max(len(a), len(b))
    return [{**(a[i] if i < len(a) else {}), **(b[i] if i < len(b) else {})} for i in range(n)]


def apply_train_infer_correction(rows: TokenRows, cfg: TrainSection) -> tuple[TokenRows, Metrics]:
    """ROLL's pipeline-level train/infer correction (spec §6.6, recompute on): with ``old_log_probs`` and
    ``infer_logprobs`` present and a correction configured, add ``train_infer_is_weight`` and filter the response
    mask before the normalisers are counted; the correction's metrics (the weight's statistics, the filtered
    share) go into the step's. Per-row math, so it runs on the whole table at once."""
    c = cfg.train_infer_correction  # the section is a LossOptions: the typed correction itself
    configured = c.is_weight.enabled or any(f.enabled for f in c.filters)
    if not configured or "old_log_probs" not in rows.next_token or "infer_logprobs" not in rows.next_token:
        return rows, {}
    mb = pad_micro_batch(rows, np.arange(rows.num_rows))
    batch = {"response_mask": mb.response_mask, "old_log_probs": mb.next_token["old_log_probs"],
             "infer_logprobs": mb.next_token["infer_logprobs"]}
    out, metrics = apply_train_infer_correction_to_batch(c, batch, roll_compat=cfg.roll_compat)
    mask = Ragged.from_padded(out["response_mask"].numpy().astype(np.int64), rows.lengths)
    weight = unpad_next_token(out["train_infer_is_weight"], rows.lengths)
    return rows.with_response_mask(mask).with_next_token("train_infer_is_weight", weight), \
        {k: float(v) for k, v in metrics.items()}
