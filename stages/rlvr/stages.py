"""The RLVR stages (Ray Data, run by ``stages.runner.run_stage``):

* :class:`RewardStage` — ``responses`` → ``scored``: batches go to Ray tasks; each worker process builds one
  :class:`~stages.rewards.RewardRouter` for the stage (workers hold sandboxes, caches, clients: built inside the
  process, never pickled) at its first batch and scores its batches with it, routed by the domain column.
* :class:`RLVRSamplesStage` — ``responses`` + ``scored`` → ``samples``: the step's token table in the layout every
  samples table has, on which the log-prob, value, response-rewards (stages/response_rewards.py, with ``scored``
  for the workers' scores and domains), advantages and training stages of both pipelines run.

The LLM judge (``llm_judge``) needs a ``generate(prompts: list[str]) -> list[str | None]`` service. The stage takes
``services = {"generate": factory}``: a picklable zero-argument callable run once inside each process that scores
the stage's batches, returning the callable. :class:`stages.rlvr.generate.EngineGenerate` is that factory over the
engine actors of an :class:`~stages.rollout.engine_pool.EnginePool` (Ray actor handles pickle): ``rollflow score``
builds a pool over ``--judge-model`` for it, the RLVR training flow uses its own engines. The reward stage never
builds an engine itself.
"""

from __future__ import annotations

import functools
import inspect
import pickle
from typing import Any, Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

import stages.rewards  # noqa: F401  (registers the built-in workers)
from schemas.errors import ConfigError, RollflowError, SchemaError
from schemas.rlvr_config import RewardsConfig
from schemas.rlvr_tables import RESPONSES, RESPONSE_ALIGNED, SCORED, check_response_rows
from schemas.rollout_config import PlayedAhead
from schemas.tables import SAMPLES, check_row_invariants, staleness_column
from stages.advantages import joined_rows
from stages.algos.ragged import Ragged
from stages.algos.rlvr_chain import check_groups, response_tokens
from stages.rewards import RewardRouter
from stages.rewards.registry import build_worker, required_services, resolve_worker
from stages.rewards.routing import FALLBACK_DOMAIN
from stages.stage import Stage, StageContext
from stages.storage import Location, folder_fingerprint

ServiceFactory = Callable[[], Any]
TOKEN_COLUMNS = ("prompt_ids", "response_ids") + RESPONSE_ALIGNED
RESPONSE_LENGTH = "response_length"


# ---- rewards: responses → scored ---------------------------------------------------------------------------------

def check_routes(section: RewardsConfig, field: str = "rewards") -> None:
    """Every route of ``section`` names a resolvable worker that takes its kwargs: a worker without run-time services
    is built once (a throwaway instance; the scoring processes build their own), the kwargs of one with services (an
    LLM judge) are bound to its signature. Pure python, before Prefect and Ray start; ``field``: the config section of
    the routes, for the message."""
    for domain, route in section.routes.items():
        try:
            entry = resolve_worker(route.worker)
            needs = required_services(entry)
            if not needs:
                build_worker(route.worker, route.kwargs)
                continue
            given = [name for name in needs if name in route.kwargs]
            if given:
                raise ConfigError(f"reward worker '{route.worker}': '{given[0]}' is a run-time service given by the "
                                  "stage, not a config value; remove it from the worker kwargs")
            rows = () if isinstance(entry, type) else ({},)  # a function worker takes the rows first
            try:
                inspect.signature(entry).bind_partial(*rows, **route.kwargs)
            except TypeError as error:
                raise ConfigError(f"reward worker '{route.worker}': bad kwargs {sorted(route.kwargs)} ({error}); see "
                                  "the worker's docstring for its parameters") from None
        except ConfigError as err:
            raise ConfigError(f"{field}.routes.{domain}: {err}") from None


def _preflight(section: RewardsConfig, services: Mapping[str, ServiceFactory]) -> None:
    """Fail before Ray starts work: every route names a resolvable worker that takes its kwargs
    (:func:`check_routes`) and whose services the stage has."""
    check_routes(section)
    for domain, route in section.routes.items():
        missing = [name for name in required_services(resolve_worker(route.worker)) if name not in services]
        if missing:
            raise ConfigError(f"rewards.routes.{domain}: worker '{route.worker}' needs the run-time service(s) "
                              f"{missing}, because it calls a model; give the reward stage services="
                              "{'generate': factory} (see stages/rlvr/stages.py) or route this domain to a rule worker")


def _check_domain_column(section: RewardsConfig, schema: pa.Schema, where: str) -> None:
    if section.domain_column not in schema.names:
        raise SchemaError(f"responses table at {where}: rewards.domain_column '{section.domain_column}' is not a "
                          f"column (present: {', '.join(schema.names)}); set rewards.domain_column to domain or tag")


def _check_routed(responses: Location, section: RewardsConfig) -> None:
    """Every value of the domain column has a route (or there is a '*' fallback): checked on the driver over that
    one column, so a missing route fails before any row is scored."""
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


def check_response_groups(responses: str, domain_column: str, n: int) -> None:
    """``rollflow score --advantages``: every prompt of the on-disk responses table has ``n`` responses
    (num_return_sequences_in_group), all of one domain, checked on the driver over two columns before the first stage
    commits; else the chain would stop at its response-rewards stage, after committing scored/ and samples/, naming
    its own samples/ output as the culprit."""
    loc = Location.of(responses)
    table = pads.dataset(loc.parquet_files(), filesystem=loc.fs).to_table(columns=["prompt_id", domain_column])
    check_groups(table.column("prompt_id").to_numpy(zero_copy_only=False),
                 table.column(domain_column).cast(pa.string()).to_numpy(zero_copy_only=False), n, loc.path)


# run-time values the reward stage hands to the workers that read them (stages.rewards.registry.run_context); they
# travel in the stage's state_in, so they enter its fingerprint (a step at another training progress scores anew)
RUN_CONTEXT = ("training_progress",)


def run_context(state_in: Mapping[str, Any]) -> dict[str, Any]:
    """The reward workers' run-time context from a reward stage's ``state_in``."""
    return {name: state_in[name] for name in RUN_CONTEXT if name in state_in}


class ScoreBatch:
    """A reward stage's scorer: one router, scoring ``pyarrow`` batches of ``responses``."""

    def __init__(self, routes: dict, domain_column: str, services: Mapping[str, ServiceFactory], where: str,
                 context: Mapping[str, Any] | None = None):
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
            "domain": batch.column(self.router.domain_column).cast(pa.string()),  # what RLVR normalises rewards by
        })


@functools.lru_cache(maxsize=2)
def _scorer(arguments: bytes) -> ScoreBatch:
    """This process's :class:`ScoreBatch` for a reward stage's pickled constructor arguments: built at the first
    batch of the stage the process scores, kept for its next batches (and the next stage's with the same arguments)."""
    return ScoreBatch(**pickle.loads(arguments))


def score_batch(batch: pa.Table, arguments: bytes) -> pa.Table:
    """A reward stage's Ray Data task function: ``batch`` scored by this process's scorer for ``arguments``."""
    return _scorer(arguments)(batch)


class RewardStage(Stage):
    """``responses`` → ``scored``. ``services``: run-time service factories for workers that declare them
    (``generate`` for the LLM judge); at most ``max_tasks`` tasks of ``cpus_per_task`` CPUs score at once. The batches
    go to Ray tasks, not to an actor pool: Ray keeps idle task workers for the next tasks (stages/cluster.py
    WORKER_POOL_ENV), so a stage of a later iteration scores in processes already started, where a pool started an
    actor process per stage (about 1.5 CPU-s each before its first batch on two cores)."""

    name = "rewards"
    version = "2"  # 2: the output carries each row's domain
    output_spec = SCORED
    section_model = RewardsConfig
    input_specs = {"responses": RESPONSES}

    def __init__(self, services: Mapping[str, ServiceFactory] | None = None, max_tasks: int = 2,
                 cpus_per_task: float = 0.5) -> None:
        self.services = dict(services or {})
        self.max_tasks = max_tasks
        self.cpus_per_task = cpus_per_task

    def build(self, ctx: StageContext):
        from ray import cloudpickle
        from ray.data import TaskPoolStrategy

        section: RewardsConfig = ctx.section
        _preflight(section, self.services)
        schema = ctx.schemas["responses"]
        _check_domain_column(section, schema, ctx.inputs["responses"].path)
        _check_routed(ctx.inputs["responses"], section)
        columns = [f.name for f in schema if f.name not in RESPONSE_ALIGNED]  # workers read text, not log-probs
        routes = {d: r.model_dump() for d, r in section.routes.items()}
        # pickled once here: the bytes are the key of each process's scorer (services may be closures: cloudpickle)
        arguments = cloudpickle.dumps({"routes": routes, "domain_column": section.domain_column,
                                       "services": self.services, "where": ctx.inputs["responses"].path,
                                       "context": run_context(ctx.state_in)})
        return ctx.read("responses", columns=columns).map_batches(
            score_batch, batch_size=ctx.batch_rows, batch_format="pyarrow", fn_kwargs={"arguments": arguments},
            compute=TaskPoolStrategy(size=self.max_tasks), num_cpus=self.cpus_per_task, **ctx.task_options())

    def preflight(self, section: RewardsConfig, on_disk: Mapping[str, str], schemas: Mapping[str, pa.Schema]
                  ) -> None:
        """Before Prefect and Ray start (stages/preflight.py): the routes' workers and kwargs, the domain column,
        and a route for every domain of an on-disk responses table. The judge's services come later; the stage
        checks them when it starts."""
        check_routes(section)
        where = on_disk.get("responses")
        _check_domain_column(section, schemas["responses"], Location.of(where).path if where else "(not yet written)")
        if where:
            _check_routed(Location.of(where), section)

    def finalize(self, ctx: StageContext, written: Location):
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


# ---- responses + scored → samples: the project's row layout, on which log-probs, values and advantages run -----

class SamplesSection(PlayedAhead):
    """The samples stage's one setting: the staleness column of responses generated ahead (async_generation_ratio >
    0); in turn none, so the section dumps as {} (its inputs' fingerprints say everything), its fingerprint as
    before."""


class _ToSamples:
    """Per block of ``responses``: the samples rows (``input_ids = prompt_ids + response_ids``, ``response_mask =
    0…0 1…1``, response-aligned columns moved to the next-token layout) with the row's score from ``scored``, and
    with ``staleness`` not None (responses generated ahead) the rows' staleness column."""

    def __init__(self, scored: tuple, where: str, staleness: int | None = None):
        self.scored, self.where, self.staleness = scored, where, staleness

    def __call__(self, batch: pa.Table) -> pa.Table:
        check_response_rows(batch, self.where)
        scored = joined_rows(self.scored, batch, f"responses table at {self.where}: row_id '{{row_id}}' has no row in "
                             "the scored table; score this responses table with the reward stage first")
        score = np.nan_to_num(np.asarray(scored["scores"], np.float64)).astype(np.float32)  # null: unscored → 0
        aligned = {c: Ragged.from_arrow(batch.column(c), np.float32) for c in RESPONSE_ALIGNED
                   if c in batch.column_names}
        tokens = response_tokens(Ragged.from_arrow(batch.column("prompt_ids"), np.int32),
                                 Ragged.from_arrow(batch.column("response_ids"), np.int32), aligned)
        n = batch.num_rows
        out: dict[str, Any] = {
            "row_id": batch.column("row_id"), "group_id": batch.column("prompt_id"), "traj_id": batch.column("row_id"),
            "turn_idx": pa.array(np.zeros(n, np.int32)), "num_turns": pa.array(np.ones(n, np.int32)),
            "tag": batch.column("tag"), "input_ids": tokens.input_ids.to_arrow(pa.int32()),
            "response_mask": tokens.response_mask.to_arrow(pa.int8()), "score": pa.array(score, pa.float32()),
            "episode_score": pa.array(score, pa.float32()),
            "prompt_len": pa.array(tokens.prompt_len.astype(np.int32), pa.int32())}
        for name, col in tokens.next_token.items():
            out[name] = col.to_arrow(pa.float32())
        out.update(staleness_column(self.staleness, n))
        table = pa.table(out)
        check_row_invariants(SAMPLES, table, f"{self.where} (rlvr_samples output)")
        return table


class RLVRSamplesStage(Stage):
    """``responses`` + ``scored`` → ``samples``: the RLVR step's token table in the layout of every samples table,
    so that the log-prob, value, advantages and training stages of both pipelines run on it unchanged. Response-aligned
    ``infer_logprobs`` / ``old_log_probs`` / ``ref_log_probs`` / ``values`` become next-token columns (zeros on the
    prompt positions); ``group_id`` is the prompt id, each row its own trajectory of one turn. Responses generated
    ahead of training (async_generation_ratio > 0) get the ``staleness`` column of the section, as a rollout's samples
    do."""

    name = "rlvr_samples"
    version = "1"
    output_spec = SAMPLES
    section_model = SamplesSection
    input_specs = {"responses": RESPONSES, "scored": SCORED}

    def output_schema(self, input_schemas: dict[str, pa.Schema]) -> pa.Schema:
        names = input_schemas["responses"].names
        return SAMPLES.arrow_schema(present=["prompt_len", *[c for c in RESPONSE_ALIGNED if c in names]])

    def build(self, ctx: StageContext):
        scored = ctx.inputs["scored"]
        fn = _ToSamples((scored.parquet_files(), scored.fs, "scored:" + folder_fingerprint(scored)),
                        ctx.inputs["responses"].path, ctx.section.staleness)
        columns = [f.name for f in ctx.schemas["responses"]
                   if f.name in ("row_id", "prompt_id", "tag", "prompt_ids", "response_ids", *RESPONSE_ALIGNED)]
        return ctx.read("responses", columns=columns).map_batches(fn, batch_format="pyarrow",
                                                                  batch_size=ctx.batch_rows)
