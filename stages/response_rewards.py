"""The response-level rewards stage of both pipelines: a samples table (+ for RLVR its scores) → ``rewarded``.

It needs whole-table statistics, so it reads only narrow columns — a few bytes a row — and computes them in one
batch over the whole table. The advantages stage (stages/advantages.py) joins its rows by row_id. The config section
selects ROLL's algorithm:

* :class:`~schemas.config.ResponseRewardSection` (agentic, spec §5.1, §5.4): groups, batch mean/std, discounted
  returns across a trajectory's rows, GiGPO's step groups; reads ``samples`` only.
* :class:`~schemas.rlvr_config.RLVRRewardSection` (RLVR, §3.5 sample masks, §3.3 reward post-processing per
  domain): reads the response lengths and prompt groups from ``samples`` and the workers' scores and domains from
  ``scored``; its running moments per domain are carried in the manifest state (``running_moments``). Rows are
  sorted by (prompt id, row_id), as ROLL sorts by prompt id, so the float sums do not depend on the block order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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
from stages.algos.response_rewards import RewardNormSettings, compute_response_level_rewards, discounted_returns
from stages.algos.reward_norm import RunningMoments
from stages.algos.rlvr_chain import rlvr_response_rewards
from stages.runner import Stage, StageContext, read_partials, write_partials
from stages.storage import Location

NARROW = ["row_id", "group_id", "traj_id", "turn_idx", "num_turns", "tag", "score", "episode_score"]


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
        the whole-table step. Reading inside the task replaces a Ray Data read split into ~200 blocks and gathered
        again by a ``repartition(1)``, which took seconds of scheduling around 0.1 CPU-s of work (issue 49)."""
        section = ctx.section
        algo = ALGORITHMS[_kind(section)]
        out, where = ctx.output, f"{ctx.inputs['samples'].path} (response_rewards output)"
        samples, columns = ctx.inputs["samples"], algo.columns(ctx.schemas["samples"])

        def whole_table() -> pa.Table:
            narrow = read_narrow(samples, columns, algo.narrow, ctx.batch_rows)
            table, metrics, state = algo.whole_table(narrow, section, ctx)
            check_row_invariants(REWARDED, table, where)
            write_partials(out, "whole-table", {"metrics": metrics, "state": state})
            return table

        return ctx.one_task(whole_table)

    def finalize(self, ctx: StageContext, written: Location):
        parts = read_partials(written)
        if parts:
            return parts[0]["metrics"], parts[0]["state"]
        # an empty table: nothing normalised, RLVR's trackers unchanged
        return {}, ({"running_moments": dict(ctx.state_in["running_moments"])} if "running_moments" in ctx.state_in
                    else {})
