"""The RLVR stages (Ray Data, run by ``stages.runner.run_stage``):

* :class:`RewardStage` — ``responses`` → ``scored``: batches go to an actor pool; each actor builds one
  :class:`~stages.rewards.RewardRouter` (workers hold sandboxes, caches, clients: built inside the actor, never
  pickled) and scores its batches, routed by the domain column.
* :class:`RLVRRewardsStage` — ``responses`` + ``scored`` → ``rlvr_rewarded``: the whole-table part of the chain
  (sample masks, reward normalisation per domain) over narrow columns read once; running moments per domain carried
  in the manifest state (``running_moments``) like the KL controller of ``stages/recompute.py``. Its rows are
  sorted by (prompt_id, row_id), as ROLL sorts by prompt id; readers join it by row_id.
* :class:`RLVRAdvantagesStage` — ``responses`` + ``rlvr_rewarded`` → ``advantaged``: row-parallel token rewards and
  advantages; the statistics that span blocks (per-domain whitening moments, the KL controller's current KL) come
  from additive partials over all blocks.

The LLM judge (``llm_judge``) needs a ``generate(prompts: list[str]) -> list[str | None]`` service. The stage takes
``services = {"generate": factory}``: a picklable zero-argument callable run once inside each reward actor, returning
the callable. :class:`stages.rlvr.generate.EngineGenerate` is that factory over the engine actors of an
:class:`~stages.rollout.engine_pool.EnginePool` (Ray actor handles pickle): ``rollflow score`` builds a pool over
``--judge-model`` for it, the RLVR training flow uses its own engines. The reward stage never builds an engine itself.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import ConfigError, InvariantError, RollflowError, SchemaError
from schemas.rlvr_config import RewardsConfig, RLVRAdvantageSection, RLVRRewardSection
from schemas.rlvr_tables import (RESPONSE_ALIGNED, RESPONSES, RLVR_ADVANTAGED, RLVR_REWARDED, SCORED,
                                 check_response_rows)
from schemas.config import Frozen
from schemas.tables import SAMPLES, check_row_invariants
from stages.recompute import reward_lookup
from stages.runner import ACTOR_POOL, Stage, StageContext, read_partials, sum_partials, write_partials
from stages.storage import Location, folder_fingerprint

log = logging.getLogger("rollflow.rlvr")

ServiceFactory = Callable[[], Any]
TOKEN_COLUMNS = ("prompt_ids", "response_ids") + RESPONSE_ALIGNED
RESPONSE_LENGTH = "response_length"


# ---- rewards: responses → scored ---------------------------------------------------------------------------------

def _preflight(section: RewardsConfig, services: Mapping[str, ServiceFactory]) -> None:
    """Fail before Ray starts work: every route names a resolvable worker whose services the stage has, and the
    workers without services build with their kwargs (a throwaway instance; the actors build their own)."""
    import stages.rewards  # noqa: F401  (registers the built-in workers)
    from stages.rewards.registry import build_worker, required_services, resolve_worker

    for domain, route in section.routes.items():
        needs = required_services(resolve_worker(route.worker))
        missing = [name for name in needs if name not in services]
        if missing:
            raise ConfigError(f"rewards.routes.{domain}: worker '{route.worker}' needs the run-time service(s) "
                              f"{missing}, because it calls a model; give the reward stage services="
                              "{'generate': factory} (see stages/rlvr/stages.py) or route this domain to a rule worker")
        if not needs:
            try:
                build_worker(route.worker, route.kwargs)
            except ConfigError as err:
                raise ConfigError(f"rewards.routes.{domain}: {err}") from None


def _check_routed(responses: Location, section: RewardsConfig) -> None:
    """Every value of the domain column has a route (or there is a '*' fallback): checked on the driver over that
    one column, so a missing route fails before any row is scored."""
    import pyarrow.dataset as pads

    from stages.rewards.routing import FALLBACK_DOMAIN

    if FALLBACK_DOMAIN in section.routes:
        return
    column = pads.dataset(responses.parquet_files(), filesystem=responses.fs).to_table(
        columns=[section.domain_column]).column(0)
    missing = [v for v in pc.unique(column).to_pylist() if str(v) not in section.routes]
    if missing:
        raise ConfigError(f"responses table at {responses.path}: {section.domain_column} value(s) "
                          f"{', '.join(repr(v) for v in missing[:5])} have no reward route (routed: "
                          f"{', '.join(sorted(section.routes))}); add rewards.routes entries for them or a '*' "
                          "fallback route")


# run-time values the reward stage hands to the workers that read them (stages.rewards.registry.run_context); they
# travel in the stage's state_in, so they enter its fingerprint (a step at another training progress scores anew)
RUN_CONTEXT = ("training_progress",)


def run_context(state_in: Mapping[str, Any]) -> dict[str, Any]:
    """The reward workers' run-time context from a reward stage's ``state_in``."""
    return {name: state_in[name] for name in RUN_CONTEXT if name in state_in}


class ScoreBatch:
    """The reward actor: one router per actor process, scoring ``pyarrow`` batches of ``responses``."""

    def __init__(self, routes: dict, domain_column: str, services: Mapping[str, ServiceFactory], where: str,
                 context: Mapping[str, Any] | None = None):
        import stages.rewards  # noqa: F401  (registers the built-in workers)
        from stages.rewards import RewardRouter

        self.where = where
        self.router = RewardRouter(routes, domain_column, {name: make() for name, make in services.items()}, context)

    def __call__(self, batch: pa.Table) -> pa.Table:
        check_response_rows(batch, self.where)
        rows: dict[str, list] = {name: batch.column(name).to_pylist() for name in batch.column_names
                                 if name not in TOKEN_COLUMNS}
        rows[RESPONSE_LENGTH] = pc.list_value_length(batch.column("response_ids")).to_pylist()
        try:
            out = self.router.score(rows)
        except RollflowError as err:
            raise type(err)(f"responses table at {self.where}: {err}") from None
        return pa.table({
            "row_id": batch.column("row_id"),
            "scores": pa.array(out.scores, pa.float32(), from_pandas=True),  # NaN (None) → null
            "response_level_rewards": pa.array(out.response_level_rewards, pa.float32(), from_pandas=True),
            "reward_worker": pa.array(out.worker.astype(str).tolist(), pa.string()),
        })


class RewardStage(Stage):
    """``responses`` → ``scored``. ``services``: run-time service factories for workers that declare them
    (``generate`` for the LLM judge); ``max_actors``/``cpus_per_actor`` size the autoscaling actor pool (1 … max)."""

    name = "rewards"
    version = "1"
    output_spec = SCORED
    section_model = RewardsConfig
    input_specs = {"responses": RESPONSES}

    def __init__(self, services: Mapping[str, ServiceFactory] | None = None, max_actors: int = 2,
                 cpus_per_actor: float = 0.5) -> None:
        self.services = dict(services or {})
        self.max_actors = max_actors
        self.cpus_per_actor = cpus_per_actor

    def build(self, ctx: StageContext):
        from ray.data import ActorPoolStrategy

        section: RewardsConfig = ctx.section
        _preflight(section, self.services)
        schema = ctx.schemas["responses"]
        if section.domain_column not in schema.names:
            raise SchemaError(f"responses table at {ctx.inputs['responses'].path}: rewards.domain_column "
                              f"'{section.domain_column}' is not a column (present: {', '.join(schema.names)}); "
                              "set rewards.domain_column to domain or tag")
        _check_routed(ctx.inputs["responses"], section)
        columns = [f.name for f in schema if f.name not in RESPONSE_ALIGNED]  # workers read text, not log-probs
        routes = {d: r.model_dump() for d, r in section.routes.items()}
        return ctx.read("responses", columns=columns).map_batches(
            ScoreBatch, batch_size=ctx.batch_rows, batch_format="pyarrow",
            fn_constructor_kwargs={"routes": routes, "domain_column": section.domain_column,
                                   "services": self.services, "where": ctx.inputs["responses"].path,
                                   "context": run_context(ctx.state_in)},
            compute=ActorPoolStrategy(min_size=1, max_size=self.max_actors), num_cpus=self.cpus_per_actor,
            **ACTOR_POOL)

    def finalize(self, ctx: StageContext, written: Location):
        import pyarrow.dataset as pads

        table = pads.dataset(written.parquet_files(), filesystem=written.fs).to_table(
            columns=["scores", "reward_worker"])
        scores = table.column("scores")
        rows = table.num_rows
        valid = pc.drop_null(scores).to_numpy() if rows else np.zeros(0)
        metrics = {"rewards/rows": float(rows), "rewards/unscored": float(scores.null_count),
                   "critic/score/mean": float(valid.mean()) if valid.size else 0.0}
        # per worker: rows it could not score (an LLM judge's unparseable or failed replies show here)
        unscored = table.filter(pc.is_null(table.column("scores"))).column("reward_worker").to_pylist() if rows else []
        for worker in sorted(set(table.column("reward_worker").to_pylist())):
            metrics[f"rewards/unscored/{worker}"] = float(unscored.count(worker))
        return metrics, {}


# ---- RLVR chain, whole-table part: responses + scored → rlvr_rewarded --------------------------------------------

def _narrow_lengths(domain_column: str, where: str):
    def narrow(batch: pa.Table) -> pa.Table:
        """The narrow columns of a responses block; response length Σ response_mask[1:] = R (prompt non-empty)."""
        check_response_rows(batch.select(["row_id", "prompt_ids", "response_ids"]), where)
        return pa.table({"row_id": batch.column("row_id"), "prompt_id": batch.column("prompt_id"),
                         "domain": batch.column(domain_column).cast(pa.string()),
                         RESPONSE_LENGTH: pc.list_value_length(batch.column("response_ids")).cast(pa.int64())})
    return narrow


class RLVRRewardsStage(Stage):
    """``responses`` + ``scored`` → ``rlvr_rewarded`` (§3.5 sample masks, §3.3 reward post-processing per domain).
    State: ``{"running_moments": {domain: RunningMoments.state_dict()}}`` in and out."""

    name = "rlvr_rewards"
    version = "1"
    output_spec = RLVR_REWARDED
    section_model = RLVRRewardSection
    input_specs = {"responses": RESPONSES, "scored": SCORED}

    def build(self, ctx: StageContext):
        s: RLVRRewardSection = ctx.section
        where = ctx.inputs["responses"].path
        scored = ctx.inputs["scored"]
        scored_files, scored_fs = scored.parquet_files(), scored.fs
        running_in = dict(ctx.state_in.get("running_moments", {}))
        out = ctx.output

        def whole_table(narrow: pa.Table) -> pa.Table:
            import pyarrow.dataset as pads

            from stages.algos.reward_norm import RunningMoments
            from stages.algos.rlvr_chain import rlvr_response_rewards

            # Ray Data does not promise the block order after repartition; sorting (as ROLL sorts by prompt id)
            # makes the statistics' float sums and the output independent of it.
            narrow = narrow.sort_by([("prompt_id", "ascending"), ("row_id", "ascending")])
            rewards_table = pads.dataset(scored_files, filesystem=scored_fs).to_table()
            joined = _join_scores(narrow, rewards_table, where, scored.path)
            running = {d: RunningMoments.from_state(st) for d, st in running_in.items()}
            result = rlvr_response_rewards(
                joined["prompt_id"], joined["domain"], joined["scores"], joined["rewards"],
                narrow.column(RESPONSE_LENGTH).to_numpy(), s, running, where)
            write_partials(out, "whole-table", {"metrics": result.metrics,
                                                "running_moments": {d: r.state_dict() for d, r in running.items()}})
            scores = np.where(result.scored, np.nan_to_num(joined["scores"]), 0.0)
            table = pa.table({"row_id": narrow.column("row_id"), "prompt_id": narrow.column("prompt_id"),
                             "domain": narrow.column("domain"), "scored": pa.array(result.scored, pa.bool_()),
                             "score": pa.array(scores, pa.float32()),
                             "sample_mask": pa.array(result.sample_mask, pa.float32()),
                             "response_level_rewards": pa.array(result.rewards, pa.float32())})
            check_row_invariants(RLVR_REWARDED, table, f"{where} (rlvr_rewards output)")
            return table

        columns = ["row_id", "prompt_id", s.domain_column, "prompt_ids", "response_ids"]
        ds = ctx.read("responses", columns=list(dict.fromkeys(columns)))
        ds = ds.map_batches(_narrow_lengths(s.domain_column, where), batch_format="pyarrow", batch_size=ctx.batch_rows)
        return ds.repartition(1, shuffle=False).map_batches(whole_table, batch_size=None, batch_format="pyarrow")

    def finalize(self, ctx: StageContext, written: Location):
        parts = read_partials(written)
        if not parts:  # empty table: nothing normalised, the trackers are unchanged
            return {}, {"running_moments": dict(ctx.state_in.get("running_moments", {}))}
        return parts[0]["metrics"], {"running_moments": parts[0]["running_moments"]}


def _join_scores(narrow: pa.Table, scored: pa.Table, where: str, scored_where: str) -> dict[str, np.ndarray]:
    """Scores and rewards of the narrow rows (NaN = null), looked up by row_id; every row must have exactly one."""
    import pandas as pd

    index = pd.Index(scored.column("row_id").to_numpy(zero_copy_only=False))
    if not index.is_unique:
        dup = index[index.duplicated()][0]
        raise InvariantError(f"scored table at {scored_where}: row_id '{dup}' occurs more than once; re-run the "
                             "reward stage on the responses table")
    ids = narrow.column("row_id").to_numpy(zero_copy_only=False)
    pos = index.get_indexer(ids)
    if (pos < 0).any():
        raise InvariantError(f"responses table at {where}: row_id '{ids[np.flatnonzero(pos < 0)[0]]}' has no score "
                             f"in the scored table at {scored_where}; score this responses table with the reward "
                             "stage (rollflow score) before the RLVR chain")
    if len(index) != len(ids):
        raise InvariantError(f"scored table at {scored_where} has {len(index)} rows but the responses table at {where} "
                             f"has {len(ids)}; score exactly this responses table")

    def column(name: str) -> np.ndarray:
        return scored.column(name).to_numpy(zero_copy_only=False).astype(np.float64)[pos]

    return {"prompt_id": narrow.column("prompt_id").to_numpy(zero_copy_only=False),
            "domain": narrow.column("domain").to_numpy(zero_copy_only=False),
            "scores": column("scores"), "rewards": column("response_level_rewards")}


# ---- RLVR chain, row-parallel part: responses + rlvr_rewarded → advantaged ---------------------------------------

class _TokenBatchFn:
    """Per block: the row layout, the looked-up narrow rewards, token rewards and advantages per domain."""

    def __init__(self, s: RLVRAdvantageSection, where: str, rewarded: tuple, kl_coef: float, output: Location):
        self.s, self.where, self.rewarded, self.kl_coef, self.output = s, where, rewarded, kl_coef, output
        self.reward_stats: dict | None = None
        self.advantage_stats: dict | None = None

    def _inputs(self, batch: pa.Table):
        from stages.algos.ragged import Ragged
        from stages.algos.rlvr_chain import response_tokens

        check_response_rows(batch, self.where)
        index, cols = reward_lookup(*self.rewarded)
        ids = batch.column("row_id").to_numpy(zero_copy_only=False)
        pos = index.get_indexer(ids)
        if (pos < 0).any():
            raise InvariantError(f"responses table at {self.where}: row_id '{ids[np.flatnonzero(pos < 0)[0]]}' has no "
                                 "row in the rlvr_rewarded table; re-run the rlvr_rewards stage on this input")
        narrow = {c: v[pos] for c, v in cols.items()}
        aligned = {c: Ragged.from_arrow(batch.column(c), np.float32) for c in RESPONSE_ALIGNED
                   if c in batch.column_names}
        tokens = response_tokens(Ragged.from_arrow(batch.column("prompt_ids"), np.int32),
                                 Ragged.from_arrow(batch.column("response_ids"), np.int32), aligned)
        return narrow, tokens

    def _compute(self, batch: pa.Table, final: bool):
        from stages.algos.rlvr_chain import rlvr_token_batch

        narrow, tokens = self._inputs(batch)
        result = rlvr_token_batch(tokens, narrow["response_level_rewards"], narrow["sample_mask"], narrow["domain"],
                                  self.s, self.kl_coef, reward_stats=self.reward_stats,
                                  advantage_stats=self.advantage_stats, final=final)
        return narrow, tokens, result

    def reward_partials(self, batch: pa.Table) -> pa.Table:
        from stages.algos.rlvr_chain import final_response_mask, token_rewards, whiten_partials_by_domain

        narrow, tokens = self._inputs(batch)
        tok = token_rewards(tokens, narrow["response_level_rewards"], self.s, self.kl_coef)
        fmask = final_response_mask(tokens, narrow["sample_mask"])
        return _partials_table(whiten_partials_by_domain(tok.token_level_rewards.values, fmask,
                                                         tok.token_level_rewards.offsets, narrow["domain"]))

    def advantage_partials(self, batch: pa.Table) -> pa.Table:
        from stages.algos.rlvr_chain import whiten_partials_by_domain

        narrow, _, result = self._compute(batch, final=False)
        return _partials_table(whiten_partials_by_domain(result.advantages.values, result.final_mask,
                                                         result.advantages.offsets, narrow["domain"]))

    def __call__(self, batch: pa.Table) -> pa.Table:
        from stages.algos.ragged import Ragged

        narrow, tokens, result = self._compute(batch, final=True)
        n = batch.num_rows
        score = narrow["score"].astype(np.float32)
        cols: dict[str, Any] = {
            "row_id": batch.column("row_id"), "group_id": batch.column("prompt_id"), "traj_id": batch.column("row_id"),
            "turn_idx": pa.array(np.zeros(n, np.int32)), "num_turns": pa.array(np.ones(n, np.int32)),
            "tag": batch.column("tag"), "input_ids": tokens.input_ids.to_arrow(pa.int32()),
            "response_mask": tokens.response_mask.to_arrow(pa.int8()), "score": pa.array(score, pa.float32()),
            "episode_score": pa.array(score, pa.float32()),
            "prompt_len": pa.array(tokens.prompt_len.astype(np.int32), pa.int32()),
            "response_level_rewards": pa.array(narrow["response_level_rewards"], pa.float32()),
            "token_level_rewards": result.token_level_rewards.to_arrow(pa.float32()),
            "advantages": result.advantages.to_arrow(pa.float32()),
            "returns": result.returns.to_arrow(pa.float32()),
            "raw_advantages": result.raw_advantages.to_arrow(pa.float32()),
            "domain": pa.array(narrow["domain"].astype(str), pa.string()),
            "scored": pa.array(narrow["scored"].astype(bool), pa.bool_()),
            "final_response_mask": Ragged(result.final_mask, result.advantages.offsets).to_arrow(pa.float32()),
        }
        for name, col in tokens.next_token.items():
            cols[name] = col.to_arrow(pa.float32())
        parts = dict(result.partials)
        parts["mask_tokens"] = float(tokens.token_mask.sum())
        parts["adv_sum"] = float((result.advantages.values.astype(np.float64) * result.final_mask).sum())
        if n:
            write_partials(self.output, batch.column("row_id")[0].as_py(), parts)
        table = pa.table(cols)
        table = table.select([f.name for f in RLVR_ADVANTAGED.arrow_schema(present=table.column_names)])
        check_row_invariants(RLVR_ADVANTAGED, table, f"{self.where} (rlvr_advantages output)")
        return table


def _partials_table(parts: dict[str, tuple[float, float, float]]) -> pa.Table:
    names = list(parts)
    return pa.table({"domain": pa.array(names, pa.string()),
                     "partials": pa.array([list(parts[d]) for d in names], pa.list_(pa.float64()))})


def _domain_stats(ds, fn) -> dict:
    """Sum per-domain whitening partials over all blocks → ``{domain: (mean, var) | None}``."""
    from stages.algos.rlvr_chain import stats_from_partials

    total: dict[str, list[float]] = {}
    for row in ds.map_batches(fn, batch_format="pyarrow").take_all():
        acc = total.setdefault(row["domain"], [0.0, 0.0, 0.0])
        for i in range(3):
            acc[i] += row["partials"][i]
    return stats_from_partials({d: tuple(v) for d, v in total.items()})


class RLVRAdvantagesStage(Stage):
    """``responses`` + ``rlvr_rewarded`` → ``advantaged`` (§2.4, §4.3 per domain, mask = final_response_mask).
    State: ``{"kl_ctrl": controller state}`` in and out; one controller update per step (Q-5 fix)."""

    name = "rlvr_advantages"
    version = "1"
    output_spec = RLVR_ADVANTAGED
    section_model = RLVRAdvantageSection
    input_specs = {"responses": RESPONSES, "rlvr_rewarded": RLVR_REWARDED}

    def required_columns(self, section: RLVRAdvantageSection) -> dict[str, tuple[str, ...]]:
        from stages.algos.estimators import estimator

        needs: tuple[str, ...] = ("values",) if estimator(section.adv_estimator).needs_critic else ()
        if section.add_token_level_kl:
            needs += ("old_log_probs", "ref_log_probs")
        return {"responses": needs}

    def _controller(self, ctx: StageContext):
        from stages.algos.kl import get_kl_controller, kl_controller_from_state

        s = ctx.section
        state = ctx.state_in.get("kl_ctrl")
        return kl_controller_from_state(state) if state else get_kl_controller(s.init_kl_coef, s.target_kl,
                                                                                s.kl_horizon)

    def build(self, ctx: StageContext):
        rewarded = ctx.inputs["rlvr_rewarded"]
        key = "rlvr:" + folder_fingerprint(rewarded)
        fn = _TokenBatchFn(ctx.section, ctx.inputs["responses"].path, (rewarded.parquet_files(), rewarded.fs, key),
                           self._controller(ctx).value, ctx.output)
        read = lambda: ctx.read("responses")  # noqa: E731 - each pass re-reads (streaming, bounded memory)
        if ctx.section.whiten_rewards:
            fn.reward_stats = _domain_stats(read(), fn.reward_partials)
        if ctx.section.whiten_advantages:
            fn.advantage_stats = _domain_stats(read(), fn.advantage_partials)
        return read().map_batches(fn, batch_format="pyarrow", batch_size=ctx.batch_rows)

    def finalize(self, ctx: StageContext, written: Location):
        total = sum_partials(read_partials(written))
        rows = total.get("rows", 0.0)
        current_kl = total.get("kl_sum", 0.0) / rows if rows else 0.0
        ctrl = self._controller(ctx)
        beta = ctrl.value if ctx.section.add_token_level_kl else 0.0
        ctrl.update(current_kl, int(rows))
        final_tokens = total.get("final_tokens", 0.0)
        tokens = total.get("mask_tokens", 0.0)
        metrics = {"critic/kl": current_kl, "critic/kl_coef": beta, "actor/final_mask_tokens": final_tokens,
                   "critic/advantages/mean": total.get("adv_sum", 0.0) / final_tokens if final_tokens else 0.0,
                   "rlvr/skip_step": float(final_tokens == 0)}
        if final_tokens == 0 and rows:
            log.warning("rlvr_advantages: every row is masked (final_response_mask sums to 0); ROLL skips the "
                        "training step for such a batch")
        if "adv_clipped" in total:
            metrics["critic/advantage_clip_frac"] = total["adv_clipped"] / final_tokens if final_tokens else 0.0
        if "token_reward_clipped" in total:
            metrics["critic/token_reward_clip_frac"] = total["token_reward_clipped"] / tokens if tokens else 0.0
        return metrics, {"kl_ctrl": ctrl.state_dict()}


# ---- old/ref log-probs and critic values onto the responses (token KL rewards, GAE in the RLVR training flow) -----

class _AttachLogProbs:
    """Per batch of ``responses``: the response part ``[P − 1, P − 1 + R)`` of the next-token log-prob (and value)
    columns of the same rows in a log-prob table (``(L − 1,)`` a row) as response-aligned ``(R,)`` columns."""

    COLUMNS = ("old_log_probs", "ref_log_probs", "values")

    def __init__(self, files: list[str], fs, where: str):
        self.files, self.fs, self.where = files, fs, where
        self._lookup = None

    def _table(self):
        """(pandas Index over the table's row_id, the table), read once per actor."""
        if self._lookup is None:
            import pandas as pd
            import pyarrow.dataset as pads

            ds = pads.dataset(self.files, filesystem=self.fs)
            table = ds.to_table(columns=["row_id", *[c for c in self.COLUMNS if c in ds.schema.names]])
            self._lookup = (pd.Index(table.column("row_id").to_numpy(zero_copy_only=False)), table)
        return self._lookup

    def __call__(self, batch: pa.Table) -> pa.Table:
        from stages.algos.ragged import Ragged
        from stages.algos.rlvr_chain import next_token_to_response

        index, table = self._table()
        ids = batch.column("row_id").to_numpy(zero_copy_only=False)
        pos = index.get_indexer(ids)
        if (pos < 0).any():
            raise InvariantError(f"log-prob table {self.where} has no row_id {ids[np.flatnonzero(pos < 0)[0]]}; "
                                 "compute the log-probs of this step's responses")
        rows = table.take(pa.array(pos, pa.int64()))
        prompt_len = pc.list_value_length(batch.column("prompt_ids")).to_numpy().astype(np.int64)
        response_len = pc.list_value_length(batch.column("response_ids")).to_numpy().astype(np.int64)
        for name in self.COLUMNS:
            if name not in rows.column_names:
                continue
            full = Ragged.from_arrow(rows.column(name), np.float32)
            bad = np.flatnonzero(full.lengths != prompt_len + response_len - 1)
            if bad.size:
                i = int(bad[0])
                raise InvariantError(f"log-prob table {self.where}: column '{name}' has {full.lengths[i]} entries for "
                                     f"row_id {ids[i]}, whose prompt and response have {prompt_len[i]} + "
                                     f"{response_len[i]} tokens (one per next token: P + R − 1 expected); compute the "
                                     "log-probs of this step's responses")
            if name in batch.column_names:
                batch = batch.drop_columns([name])
            sliced = next_token_to_response(full, prompt_len, response_len)
            batch = batch.append_column(pa.field(name, pa.list_(pa.float32())), sliced.to_arrow(pa.float32()))
        return batch


class AttachLogProbsSection(Frozen):
    """The attach stage has no settings (its inputs' fingerprints say everything)."""


class AttachLogProbsStage(Stage):
    """``responses`` + a log-prob table of the same rows → ``responses`` with response-aligned ``old_log_probs``
    (and ``ref_log_probs``, ``values`` where the table has them), so that the RLVR chain can subtract the token-level
    KL (spec §2.4) and run GAE on the critic's values (§4.3)."""

    name = "rlvr_attach_logprobs"
    version = "2"  # 2: values too
    output_spec = RESPONSES
    section_model = AttachLogProbsSection
    input_specs = {"responses": RESPONSES, "logprobs": SAMPLES}

    def required_columns(self, section) -> dict[str, tuple[str, ...]]:
        return {"logprobs": ("old_log_probs",)}

    def build(self, ctx: StageContext):
        lp = ctx.inputs["logprobs"]
        fn = _AttachLogProbs(lp.parquet_files(), lp.fs, lp.path)
        return ctx.read("responses").map_batches(fn, batch_format="pyarrow", batch_size=ctx.batch_rows)
