"""The response-level rewards stage of both pipelines: a samples table (+ for RLVR its scores) → ``rewarded``.

It needs whole-group statistics, so it reads only narrow columns — a few bytes a row. When every set of rows the
agentic step reads together lies inside one group (:func:`partition_column`) and the table has more rows than the
memory budget allows the step at once (:data:`STEP_BYTES_PER_ROW`), the rows are hash-partitioned by group and the
step runs one partition at a time (stages/partitioned.py), written back in the input's row order; otherwise it runs
in one batch over the whole table. The advantages stage (stages/advantages.py) joins its rows by row_id. The config section
selects ROLL's algorithm:

* :class:`~schemas.config.ResponseRewardSection` (agentic, spec §5.1, §5.4): groups, batch mean/std, discounted
  returns across a trajectory's rows, GiGPO's step groups; reads ``samples`` only.
* :class:`~schemas.rlvr_config.RLVRRewardSection` (RLVR, §3.5 sample masks, §3.3 reward post-processing per
  domain): reads the response lengths and prompt groups from ``samples`` and the workers' scores and domains from
  ``scored``; its running moments per domain are carried in the manifest state (``running_moments``). Rows are
  sorted by (prompt id, row_id), as ROLL sorts by prompt id, so the float sums do not depend on the block order.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
from pydantic import BaseModel

from schemas.config import GROUPING_COLUMNS, ResponseRewardSection
from schemas.errors import ConfigError, InvariantError, SchemaError
from schemas.rlvr_config import RLVRRewardSection
from schemas.rlvr_tables import SCORED
from schemas.tables import REWARDED, SAMPLES, TableSpec, check_row_invariants, check_structure
from stages.advantages import indexed, take_by_row_id
from stages.algos.estimators import estimator
from stages.algos.ragged import Ragged, row_sum
from stages.algos.response_rewards import (RewardNormSettings, compute_response_level_rewards, discounted_returns,
                                           gigpo_step_norm_types)
from stages.algos.reward_norm import RunningMoments, resolve_norm_types
from stages.algos.rlvr_chain import rlvr_response_rewards
from stages.partials import SIDE_DIR, read_partials, write_partials
from stages.partitioned import key_hash, partitioned
from stages.stage import Stage, StageContext
from stages.storage import Location

NARROW = ["row_id", "group_id", "traj_id", "turn_idx", "num_turns", "tag", "score", "episode_score"]
# Peak memory of the agentic whole-table step per row (the id columns as Python strings, their sorts, GiGPO's state
# ids): +250 MB at 200k rows measured in one process (BENCHMARKS.md, issue 49), with a margin. A table of more rows
# than the memory budget / this is computed in hash partitions of that many rows on average.
STEP_BYTES_PER_ROW = 2048
DEFAULT_BUDGET_MB = 512  # when Ray Data's memory limit is not set (runtime.data_memory_mb null)
SPILL_ROWS = 65_536  # rows per read batch of the spill pass and per output table of the merge


# ---- response-level rewards -------------------------------------------------------------------------------------

def response_rewards_table(table: pa.Table, section: ResponseRewardSection, where: str) -> tuple[pa.Table, dict]:
    """Whole narrow ``samples`` table → ``rewarded`` table (row_id + reward columns) and metrics (spec §5.1, §5.4)."""
    check_row_invariants(SAMPLES, table, where)
    check_structure(table, where, section.group_size)
    est = estimator(section.adv_estimator)
    col = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    if est.needs_step_rows and ("state_hash" not in col and est.response_reward == "gigpo"):
        raise SchemaError(f"samples table at {where}: adv_estimator {section.adv_estimator} groups steps by anchor "
                          "state and needs the 'state_hash' column of step-level rows; roll out with step-level "
                          "samples or choose grpo/reinforce")
    roll = {"traj_group_id": col["group_id"], "traj_id": col["traj_id"], "step": col["turn_idx"],
            "episode_scores": col["episode_score"], "score_sum": col["score"], "tags": col["tag"]}
    out: dict[str, Any] = {"row_id": table.column("row_id")}
    if est.needs_step_rows:
        step_rewards = discounted_returns(col["traj_id"], col["turn_idx"], col["score"], section.step_reward_gamma)
        roll["step_rewards"] = step_rewards
        out["step_rewards"] = pa.array(step_rewards, pa.float32())
    if "state_hash" in col:
        if est.response_reward == "gigpo" and table.column("state_hash").null_count:
            raise InvariantError(f"samples table at {where}: 'state_hash' is null in some rows; GiGPO needs the anchor "
                                 "state of every step row (trajectory-level rows have none)")
        roll["state_hash"] = col["state_hash"]
    rn = section.reward_normalization
    grouping = GROUPING_COLUMNS.get(rn.grouping, rn.grouping)
    if rn.grouping != "batch":
        if grouping not in col:
            raise ConfigError(f"reward_normalization.grouping '{rn.grouping}' names no column of the samples table; "
                              f"use batch, traj_group_id, tags or traj_id")
        roll[rn.grouping] = col[grouping]
    result = compute_response_level_rewards(
        est.response_reward, roll,
        RewardNormSettings(rn.grouping, rn.method, rn.norm_mean_type, rn.norm_std_type),
        episode_reward_weight=section.episode_reward_weight, step_reward_weight=section.step_reward_weight,
        reward_clip=section.reward_clip, roll_compat=section.roll_compat)
    out["response_level_rewards"] = pa.array(result.rewards, pa.float32())
    for name, values in result.columns.items():
        typ = pa.string() if name == "state_group_id" else pa.float32()
        out[name] = pa.array(values if typ != pa.string() else [str(v) for v in values], typ)
    rewarded = pa.table(out)
    return rewarded.select([f.name for f in REWARDED.arrow_schema(present=rewarded.column_names)]), result.metrics


def partition_column(section: ResponseRewardSection) -> str | None:
    """The column whose groups hold every set of rows the agentic step reads together — the normalisation groups,
    the trajectories (discounted returns), GiGPO's state groups — or None when one of those can be the whole table:
    a batch statistic, a normalisation group by tag, ROLL's state groups keyed by the bare state hash. A trajectory
    lies inside its group (``group_id``), as every rollout writes them."""
    rn = section.reward_normalization
    types = resolve_norm_types(rn.grouping, rn.method, rn.norm_mean_type, rn.norm_std_type)
    if "batch" in types or ("group" in types and GROUPING_COLUMNS.get(rn.grouping) not in ("group_id", "traj_id")):
        return None
    if estimator(section.adv_estimator).response_reward == "gigpo":
        step_types = gigpo_step_norm_types(RewardNormSettings(rn.grouping, rn.method, rn.norm_mean_type,
                                                              rn.norm_std_type), section.roll_compat)
        if "batch" in step_types or (section.roll_compat and "group" in step_types):
            return None
    return "group_id"


COMBINED_METRICS = {"critic/reward_clip_frac", "system/state_batch_size/max", "system/state_batch_size/mean",
                    "system/state_batch_size/min"}


def _reward_summary(table: pa.Table) -> tuple[float, float, float]:
    rewards = table.column("response_level_rewards").to_numpy()
    return float(rewards.astype(np.float64).sum()), float(rewards.max()), float(rewards.min())


def combined_metrics(results: list[tuple[int, Any]]) -> dict[str, float]:
    """The metrics of the whole table from those of its partitions: ``results`` holds (rows, (metrics, reward sum,
    max, min)) of each, None for an empty one. Fractions are weighted by rows; GiGPO's state-group sizes combine
    exactly (every state group lies in one partition, and a partition's sizes sum to its rows)."""
    done = [(n, r) for n, r in results if r is not None]
    rows = sum(n for n, _ in done)
    metrics: dict[str, float] = {}
    unknown = {k for _, (m, *_) in done for k in m} - COMBINED_METRICS
    if unknown:
        raise InvariantError(f"response rewards: no rule combines the partitions' metrics {sorted(unknown)}; add one "
                             "to stages/response_rewards.py combined_metrics")
    if not rows:
        return metrics
    if any("critic/reward_clip_frac" in m for _, (m, *_) in done):
        metrics["critic/reward_clip_frac"] = sum(round(m["critic/reward_clip_frac"] * n) for n, (m, *_) in done) / rows
    sizes = [(n, m) for n, (m, *_) in done if "system/state_batch_size/mean" in m]
    if sizes:
        groups = sum(round(n / m["system/state_batch_size/mean"]) for n, m in sizes)
        metrics.update({"system/state_batch_size/max": max(m["system/state_batch_size/max"] for _, m in sizes),
                        "system/state_batch_size/mean": float(sum(n for n, _ in sizes)) / groups,
                        "system/state_batch_size/min": min(m["system/state_batch_size/min"] for _, m in sizes)})
    metrics.update({"critic/response_level_rewards/mean": sum(r[1] for _, r in done) / rows,
                    "critic/response_level_rewards/max": max(r[2] for _, r in done),
                    "critic/response_level_rewards/min": min(r[3] for _, r in done)})
    return metrics


# ---- RLVR: sample masks and reward post-processing per domain ----------------------------------------------------

def _rlvr_narrow(batch: pa.Table) -> pa.Table:
    """A samples block → (row_id, prompt_id = group_id, response_length = Σ response_mask, int64)."""
    lengths = row_sum(Ragged.from_arrow(batch.column("response_mask"), np.int64)).astype(np.int64)
    return pa.table({"row_id": batch.column("row_id"), "prompt_id": batch.column("group_id"),
                     "response_length": pa.array(lengths, pa.int64())})


def rlvr_rewards_table(narrow: pa.Table, scored: pa.Table, section: RLVRRewardSection, running_in: dict,
                       where: str, scored_where: str) -> tuple[pa.Table, dict, dict]:
    """Whole narrow table (row_id, prompt_id, response_length) + the ``scored`` table → ``rewarded`` rows, metrics and
    the running moments per domain after this table."""
    narrow = narrow.sort_by([("prompt_id", "ascending"), ("row_id", "ascending")])
    lookup = indexed(scored, f"scored table at {scored_where}")
    joined = take_by_row_id(lookup, narrow, f"samples table at {where}: row_id '{{row_id}}' has no score in the "
                            f"scored table at {scored_where}; score the responses these samples came from with the "
                            "reward stage (rollflow score)")
    if len(lookup[0]) != narrow.num_rows:
        raise InvariantError(f"scored table at {scored_where} has {len(lookup[0])} rows but the samples table at "
                             f"{where} has {narrow.num_rows}; score exactly the responses of these samples")
    domain = joined["domain"].astype(str)
    scores = joined["scores"].astype(np.float64)
    running = {d: RunningMoments.from_state(st) for d, st in running_in.items()}
    result = rlvr_response_rewards(narrow.column("prompt_id").to_numpy(zero_copy_only=False), domain, scores,
                                   joined["response_level_rewards"].astype(np.float64),
                                   narrow.column("response_length").to_numpy(), section, running, where)
    table = pa.table({"row_id": narrow.column("row_id"),
                      "response_level_rewards": pa.array(result.rewards, pa.float32()),
                      "prompt_id": narrow.column("prompt_id"), "domain": pa.array(domain, pa.string()),
                      "scored": pa.array(result.scored, pa.bool_()),
                      "score": pa.array(np.where(result.scored, np.nan_to_num(scores), 0.0), pa.float32()),
                      "sample_mask": pa.array(result.sample_mask, pa.float32())})
    return table, result.metrics, {d: r.state_dict() for d, r in running.items()}


# ---- the stage ----------------------------------------------------------------------------------------------------

def read_narrow(loc: Location, columns: list[str], narrow: Callable[[pa.Table], pa.Table] | None,
                rows: int) -> pa.Table:
    """The ``columns`` of the table in ``loc``, in file and row order; with ``narrow``, each slice of ``rows`` rows
    narrowed as it is read (RLVR reads ``response_mask`` only to sum it), so the wide column is never whole."""
    dataset = pads.dataset(loc.parquet_files(), filesystem=loc.fs)
    if narrow is None:
        return dataset.to_table(columns=columns)
    parts = [narrow(pa.Table.from_batches([batch])) for batch in dataset.to_batches(columns=columns, batch_size=rows)
             if batch.num_rows]
    return pa.concat_tables(parts) if parts else narrow(dataset.schema.empty_table().select(columns))



def memory_budget_bytes() -> float:
    """The run's memory budget (``runtime.data_memory_mb``, as :func:`stages.cluster.ensure_ray` gave it to Ray
    Data), or :data:`DEFAULT_BUDGET_MB` when none is set."""
    import ray.data  # the driver has Ray started (ensure_ray); tests of the pure parts do not import it

    limit = ray.data.DataContext.get_current().execution_options.resource_limits.object_store_memory
    return float(limit) if limit is not None and math.isfinite(limit) else DEFAULT_BUDGET_MB * 2.0**20


def table_rows(loc: Location) -> int:
    """Rows of the table in ``loc``, from its files' Parquet footers."""
    return pads.dataset(loc.parquet_files(), filesystem=loc.fs).count_rows()


def _spill_folder(out: Location) -> str:
    """An empty local folder for a partitioned step's spill: under the stage's temporary output on local disk (a
    killed run's is removed with it), else a temporary folder of the worker."""
    if out.atomic_rename:
        folder = f"{out.path}/{SIDE_DIR}/spill"
        os.makedirs(folder, exist_ok=True)
        return folder
    return tempfile.mkdtemp(prefix="rollflow-spill-")


def partitioned_rewards(samples: Location, columns: list[str], section: ResponseRewardSection, key: str, parts: int,
                        out: Location, where: str, rows: int = SPILL_ROWS) -> Iterator[pa.Table]:
    """The ``rewarded`` rows of the agentic step over ``parts`` hash partitions of column ``key`` (stages/
    partitioned.py), in the samples' row order, ``rows`` a table; the combined metrics are written as the stage's
    partials. Each partition's values equal the whole-table step's: every statistic it computes is per group of
    ``key`` (:func:`partition_column`), summed in row order."""

    def step(table: pa.Table):
        rewarded, metrics = response_rewards_table(table, section, where)
        check_row_invariants(REWARDED, rewarded, where)
        return rewarded, (metrics, *_reward_summary(rewarded))

    dataset = pads.dataset(samples.parquet_files(), filesystem=samples.fs)
    hashes: list[np.ndarray] = []  # 8 bytes a row: a row_id repeated in two groups lands in two partitions

    def batches() -> Iterator[pa.Table]:
        for b in dataset.to_batches(columns=columns, batch_size=rows):
            if b.num_rows:
                table = pa.Table.from_batches([b])
                hashes.append(key_hash(table.column("row_id")))
                yield table

    folder = _spill_folder(out)
    try:
        results, merged = partitioned(batches(), key, parts, step, folder, rows)
        check_unique_row_ids(dataset, np.concatenate(hashes) if hashes else np.zeros(0, np.uint64), where)
        write_partials(out, "whole-table", {"metrics": combined_metrics(results), "state": {}})
        yield from merged
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_unique_row_ids(dataset: pads.Dataset, hashes: np.ndarray, where: str) -> None:
    """The whole-table step's unique-row_id check, for a table read in batches: ``hashes`` (n,) uint64 are the
    :func:`key_hash` of every row_id; a repeated hash is looked up in ``dataset`` (a second read of the row_id column
    only), so a hash collision of two different ids raises nothing. Raises :class:`InvariantError`."""
    ordered = np.sort(hashes)
    repeated = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    if not repeated.size:
        return
    seen: set[str] = set()
    for b in dataset.to_batches(columns=["row_id"]):
        ids = b.column(0)
        for i in np.flatnonzero(np.isin(key_hash(ids), repeated)):
            rid = ids[int(i)].as_py()
            if rid in seen:
                raise InvariantError(f"table at {where}: row_id '{rid}' occurs more than once; row ids must be "
                                     "unique.")
            seen.add(rid)


def _kind(value: Any) -> str:
    """Which algorithm a section (or its dumped mapping) is: RLVR sections have a group size of sequences."""
    if isinstance(value, BaseModel):
        return "rlvr" if isinstance(value, RLVRRewardSection) else "agentic"
    return "rlvr" if "num_return_sequences_in_group" in value else "agentic"


class RewardsSection:
    """The stage's section model as ``rollflow stage`` reads it back from a manifest: the agentic or the RLVR
    section, told apart by their fields (no extra field, so each dumps — and fingerprints — as its own model does)."""

    @staticmethod
    def model_validate(data: dict) -> BaseModel:
        return (RLVRRewardSection if _kind(data) == "rlvr" else ResponseRewardSection).model_validate(data)


@dataclass(frozen=True)
class _Algorithm:
    """One of ROLL's response-level reward algorithms as the stage runs it."""

    inputs: dict[str, TableSpec]
    columns: Callable[[pa.Schema], list[str]]  # the narrow samples columns it reads
    required: dict[str, tuple[str, ...]]  # optional columns its inputs must have
    narrow: Callable[[pa.Table], pa.Table] | None  # per-block narrowing before the whole-table step
    whole_table: Callable[[pa.Table, Any, StageContext], tuple[pa.Table, dict, dict]]  # → rows, metrics, state


def _agentic_whole_table(batch: pa.Table, section: ResponseRewardSection, ctx: StageContext):
    table, metrics = response_rewards_table(batch, section, ctx.inputs["samples"].path)
    rewards = table.column("response_level_rewards").to_numpy()
    if len(rewards):
        metrics.update({"critic/response_level_rewards/mean": float(rewards.mean()),
                        "critic/response_level_rewards/max": float(rewards.max()),
                        "critic/response_level_rewards/min": float(rewards.min())})
    return table, metrics, {}


def _rlvr_whole_table(narrow: pa.Table, section: RLVRRewardSection, ctx: StageContext):
    scored = ctx.inputs["scored"]
    scores = pads.dataset(scored.parquet_files(), filesystem=scored.fs).to_table(
        columns=["row_id", "scores", "response_level_rewards", "domain"])
    table, metrics, running = rlvr_rewards_table(narrow, scores, section, dict(ctx.state_in.get("running_moments", {})),
                                                 ctx.inputs["samples"].path, scored.path)
    return table, metrics, {"running_moments": running}


ALGORITHMS = {
    "agentic": _Algorithm({"samples": SAMPLES},
                          lambda schema: NARROW + (["state_hash"] if "state_hash" in schema.names else []), {}, None,
                          _agentic_whole_table),
    "rlvr": _Algorithm({"samples": SAMPLES, "scored": SCORED}, lambda schema: ["row_id", "group_id", "response_mask"],
                       {"scored": ("domain",)}, _rlvr_narrow, _rlvr_whole_table),
}


class ResponseRewardsStage(Stage):
    """``samples`` (+ ``scored`` for RLVR) → ``rewarded``; the section picks the algorithm (module docstring). State:
    RLVR's ``{"running_moments": {domain: RunningMoments.state_dict()}}`` in and out; none for agentic runs."""

    name = "response_rewards"
    version = "1"
    output_spec = REWARDED
    section_model = RewardsSection  # type: ignore[assignment]  (picks one of two pydantic models)
    input_specs = {"samples": SAMPLES, "scored": SCORED}

    def inputs_for(self, section: BaseModel) -> dict[str, TableSpec]:
        return ALGORITHMS[_kind(section)].inputs

    def required_columns(self, section: BaseModel) -> dict[str, tuple[str, ...]]:
        return ALGORITHMS[_kind(section)].required

    def build(self, ctx: StageContext):
        """One task: read the narrow columns of every file (narrowing each ``batch_rows`` slice first, for RLVR), then
        the whole-table step — or, for an agentic table larger than the memory budget allows at once, the step over
        hash partitions by group (:func:`partitioned_rewards`). Reading inside the task replaces a Ray Data read split
        into ~200 blocks and gathered again by a ``repartition(1)``, which took seconds of scheduling around 0.1 CPU-s
        of work (issue 49)."""
        section = ctx.section
        algo = ALGORITHMS[_kind(section)]
        out, where = ctx.output, f"{ctx.inputs['samples'].path} (response_rewards output)"
        samples, columns = ctx.inputs["samples"], algo.columns(ctx.schemas["samples"])
        key = partition_column(section) if _kind(section) == "agentic" else None
        step_rows = max(1, int(memory_budget_bytes() // STEP_BYTES_PER_ROW))

        def whole_table() -> Iterator[pa.Table]:
            rows = table_rows(samples) if key is not None else 0
            if rows > step_rows:
                yield from partitioned_rewards(samples, columns, section, key, math.ceil(rows / step_rows), out, where)
                return
            narrow = read_narrow(samples, columns, algo.narrow, ctx.batch_rows)
            table, metrics, state = algo.whole_table(narrow, section, ctx)
            check_row_invariants(REWARDED, table, where)
            write_partials(out, "whole-table", {"metrics": metrics, "state": state})
            yield table

        return ctx.one_task(whole_table)

    def finalize(self, ctx: StageContext, written: Location):
        parts = read_partials(written)
        if parts:
            return parts[0]["metrics"], parts[0]["state"]
        # an empty table: nothing normalised, RLVR's trackers unchanged
        return {}, ({"running_moments": dict(ctx.state_in["running_moments"])} if "running_moments" in ctx.state_in
                    else {})
