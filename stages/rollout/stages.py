"""The rollout's Ray Data stages, each run through the one runner (resumable, committed with a manifest):

* ``rollout_reset``: ``num_env_groups * group_size`` episodes → the reset table (``turn_idx = -1``, first prompts);
* ``rollout_turn`` (once per turn): the previous table's active rows → generate (engine actors) → environment
  step → this turn's table. A crash in turn k resumes at turn k: turns before it are committed and skipped;
* ``rollout_samples``: every turn table → the ``samples`` table (step or trajectory level) + rollout metrics.

Generation and the environment step share one ``map_batches`` task per batch, so a batch reaches the engine whole
(vLLM's throughput grows with batch size); the task records the seconds spent in each as partials.

Inputs are read on the driver with pyarrow (the ``done`` filter pushed into the scan) and handed to Ray Data as
in-memory blocks, one block per engine call. The tables are small — one row per active episode — and a turn's own
work is short: from in-memory blocks its fixed cost stays below a second once the workers are warm (Ray Data 2.60's
default Parquet reader cost 3–20 s per ``read_parquet`` here; the stages now read with the first one, see
stages/cluster.py ``PARQUET_DATASOURCE_V2``, which still costs a few tenths of a second per read).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from schemas.errors import InvariantError
from schemas.rollout_config import SamplesSection, TurnSection
from schemas.tables import SAMPLES, check_row_invariants, check_structure
from stages.partials import read_partials, sum_partials, write_partials
from stages.rollout.samples import episode_summary, rollout_metrics, turns_to_samples
from stages.rollout.tables import NARROW_COLUMNS, TURNS, rows_to_table
from stages.stage import Stage, StageContext
from stages.storage import Location

# Ray Data tasks of the rollout stages are light (they hand a batch to an engine actor and wait): small CPU requests
# keep them schedulable next to an engine actor that holds a whole CPU (STACK.md: the 2-CPU deadlock).
TASK_CPUS = 0.25


def _count_partials(table: pa.Table) -> dict[str, float]:
    lengths = {c: pc.sum(pc.list_value_length(table.column(c))).as_py() or 0 for c in ("response_ids", "prompt_ids")}
    return {"rows": table.num_rows, "active": table.num_rows - (pc.sum(table.column("done")).as_py() or 0),
            "response_tokens": lengths["response_ids"], "prompt_tokens": lengths["prompt_ids"]}


def read_table(loc: Location, columns: list[str] | None = None, where=None) -> pa.Table:
    """A committed table folder as one pyarrow table (file order), optionally filtered."""
    files = loc.parquet_files()
    if not files:
        return TURNS.arrow_schema().empty_table().select(columns or TURNS.arrow_schema().names)
    return pads.dataset(files, filesystem=loc.fs).to_table(columns=columns, filter=where)


def in_blocks(table: pa.Table, rows_per_block: int):
    """A Ray dataset over ``table`` cut into contiguous blocks of ``rows_per_block`` rows (one task each)."""
    import ray.data

    size = max(1, rows_per_block)
    blocks = [table.slice(start, size) for start in range(0, table.num_rows, size)] or [table]
    return ray.data.from_arrow(blocks)


def _engine_for(first_env_id: int, engines: int, total: int) -> int:
    """A batch's engine: batches are contiguous ranges of env ids, so map that range onto the engines evenly."""
    return min(engines - 1, first_env_id * engines // max(total, 1))


class EngineStage(Stage):
    """A stage whose Ray Data tasks hand their batches to the engine actors of ``pool`` (an EnginePool, started by
    the caller): the rollout's reset and turns, RLVR's generation. ``ticker``: a stages.progress.Ticker of the rows
    done, or None. Its metrics are the sums of the partials its tasks wrote."""

    def __init__(self, pool, ticker=None) -> None:
        self.pool, self.ticker = pool, ticker

    @staticmethod
    def on_engines(table: pa.Table, rows_per_block: int, fn):
        """The Ray dataset of ``fn`` (a pyarrow table -> table) over ``table`` cut into blocks of ``rows_per_block``
        rows, one light task (TASK_CPUS) per block, each handing its block whole to an engine."""
        return in_blocks(table, rows_per_block).map_batches(fn, batch_format="pyarrow", batch_size=None,
                                                            num_cpus=TASK_CPUS)

    def finalize(self, ctx: StageContext, written: Location):
        return sum_partials(read_partials(written)), {}


class ResetStage(EngineStage):
    """Reset every episode's environment and build its first prompt (on the engine actors, which hold the
    tokenizer)."""

    name = "rollout_reset"
    version = "1"
    output_spec = TURNS
    section_model = TurnSection
    input_specs: dict = {}

    def build(self, ctx: StageContext):
        section: TurnSection = ctx.section
        handles, output = self.pool.handles(), ctx.output
        total = section.env.num_env_groups * section.env.group_size

        def reset_batch(batch: pa.Table) -> pa.Table:
            import ray

            env_ids = [int(i) for i in batch.column("id").to_pylist()]
            if not env_ids:
                return rows_to_table([])
            actor = handles[_engine_for(env_ids[0], len(handles), total)]
            table = ray.get(actor.reset.remote(section, env_ids))
            write_partials(output, f"reset-{env_ids[0]}", _count_partials(table))
            return table

        ids = pa.table({"id": pa.array(range(total), pa.int64())})
        return self.on_engines(ids, math.ceil(total / len(handles)), reset_batch)


class TurnStage(EngineStage):
    """Play turn ``turn`` of every active episode: generate with the pool's engines, step the environments."""

    name = "rollout_turn"
    version = "1"
    output_spec = TURNS
    section_model = TurnSection
    input_specs = {"previous": TURNS}

    def __init__(self, turn: int, pool, active: int, ticker=None) -> None:
        super().__init__(pool, ticker)  # ticker: episodes played
        self.turn, self.active = turn, active

    def _batch_size(self) -> int:
        configured = self.pool.config.batch_size
        return configured or max(1, math.ceil(self.active / self.pool.config.num_engines))

    def build(self, ctx: StageContext):
        section: TurnSection = ctx.section
        handles, output, turn, ticker = self.pool.handles(), ctx.output, self.turn, self.ticker
        total = section.env.num_env_groups * section.env.group_size
        where = ctx.inputs["previous"].path

        def play_batch(batch: pa.Table) -> pa.Table:
            import ray

            if batch.num_rows == 0:
                return rows_to_table([])
            turns = batch.column("turn_idx").to_numpy()
            if (turns != turn - 1).any():
                raise InvariantError(f"turn table {where}: an episode is at turn {int(turns.max())}, expected "
                                     f"{turn - 1}; pass the table of the previous turn")
            start = time.time()
            actor = handles[_engine_for(batch.column("env_id")[0].as_py(), len(handles), total)]
            table, seconds = ray.get(actor.play.remote(section, batch))
            write_partials(output, batch.column("traj_id")[0].as_py(),
                           {**_count_partials(table), **seconds, "actor_seconds": time.time() - start,
                            "batches": 1})
            if ticker is not None:
                ticker.add(batch.num_rows)
            return table

        active = read_table(ctx.inputs["previous"], where=pc.field("done") == False)  # noqa: E712
        return self.on_engines(active, self._batch_size(), play_batch)

    def check_output(self, ctx: StageContext, written: Location) -> None:
        check_turn_table(written, ctx.output.path)


def check_turn_table(loc: Location, where: str) -> None:
    """Aligned list lengths of a turn table: context_mask = prompt_ids, context_logprobs = prompt_ids - 1,
    logprobs = response_ids. Raises :class:`InvariantError` naming the episode."""
    files = loc.parquet_files()
    if not files:
        return
    cols = ["traj_id", "prompt_ids", "context_mask", "context_logprobs", "response_ids", "logprobs"]
    table = pads.dataset(files, filesystem=loc.fs).to_table(columns=cols)
    length = {c: pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False) for c in cols[1:]}
    checks = (("context_mask", length["prompt_ids"]), ("context_logprobs", np.maximum(length["prompt_ids"] - 1, 0)),
              ("logprobs", length["response_ids"]))
    for name, want in checks:
        bad = np.flatnonzero(length[name] != want)
        if bad.size:
            i = int(bad[0])
            raise InvariantError(f"turn table {where}: column '{name}' of episode {table.column('traj_id')[i]} has "
                                 f"{length[name][i]} entries, expected {want[i]}; this is a rollflow bug — report it")


def read_narrow(locations: list[Location], columns: list[str] | None = None) -> pa.Table:
    """The narrow columns of several turn tables, in order (pyarrow, no Ray)."""
    columns = columns or NARROW_COLUMNS
    empty = TURNS.arrow_schema().empty_table().select(columns)
    return pa.concat_tables([read_table(loc, columns) for loc in locations] or [empty])


class SamplesStage(Stage):
    """Every turn table → ``samples`` (step or trajectory level) + ROLL's rollout metrics in the manifest."""

    name = "rollout_samples"
    version = "1"
    output_spec = SAMPLES
    section_model = SamplesSection

    def __init__(self, turn_names: list[str]) -> None:
        self.turn_names = list(turn_names)
        self.input_specs = {name: TURNS for name in self.turn_names}
        self._metrics: dict[str, float] = {}

    def build(self, ctx: StageContext):
        section: SamplesSection = ctx.section
        locations = [ctx.inputs[name] for name in self.turn_names]
        narrow = read_narrow(locations, NARROW_COLUMNS + ["level_seed"])
        lengths = read_narrow(locations, ["prompt_ids", "response_ids"])
        response_tokens = int(pc.sum(pc.list_value_length(lengths.column("response_ids"))).as_py() or 0)
        prompt_tokens = int(pc.sum(pc.list_value_length(lengths.column("prompt_ids"))).as_py() or 0)
        self._metrics = rollout_metrics(narrow, response_tokens, prompt_tokens)
        episodes = episode_summary(narrow)
        # trajectory level: an episode's last row holds the whole conversation
        last_only = pc.field("done") == True if section.sample_level == "trajectory" else None  # noqa: E712
        rows = pa.concat_tables([read_table(loc, where=last_only) for loc in locations])
        where = ctx.output.path

        def to_samples(batch: pa.Table) -> pa.Table:
            out = turns_to_samples(batch, section, episodes)
            check_row_invariants(SAMPLES, out, where)
            return out

        return in_blocks(rows, ctx.batch_rows).map_batches(to_samples, batch_format="pyarrow", batch_size=None,
                                                           num_cpus=TASK_CPUS)

    def check_output(self, ctx: StageContext, written: Location) -> None:
        files = written.parquet_files()
        if not files:
            raise InvariantError(f"samples table {ctx.output.path}: the rollout produced no samples; check that "
                                 "the turn tables hold played turns")
        table = pads.dataset(files, filesystem=written.fs).to_table(columns=["row_id", "group_id", "traj_id",
                                                                              "turn_idx"])
        check_structure(table, ctx.output.path, ctx.section.group_size)

    def finalize(self, ctx: StageContext, written: Location):
        return dict(self._metrics), {}
