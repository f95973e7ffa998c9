"""The advantages stage of both pipelines: a samples table + its response-level rewards → ``advantaged``.

Row-parallel over the wide token columns: per block, token rewards (§2.4, with the KL to the reference when
``add_token_level_kl``) and advantages (§4.3) by :func:`stages.algos.token_chain.token_batch`. The statistics that
span blocks (per-domain whitening moments, the KL controller's current KL) come from additive partials over all
blocks; the KL controller's state travels in the manifest (``kl_ctrl``).

Each task joins its samples file's rows to their ``rewarded`` rows by row_id. When the rewarded table lists the
samples' rows in their order (the agentic rewards stage writes it so), the join reads only that file's range of it
(:class:`RewardRanges`), so a task's memory does not grow with the table; otherwise (RLVR's rewarded rows are sorted
by prompt) each worker indexes the whole rewarded table once (:func:`reward_lookup`).

The ``rewarded`` input (stages/response_rewards.py) says what kind of run it is, as data:

* agentic: ``response_level_rewards`` (and GiGPO/step columns, copied to the output); every row's sample mask is
  §5.5's all-ones ``get_agentic_response_level_mask``; one domain.
* RLVR: also ``sample_mask`` (§3.5) and ``domain``. Advantages are
  whitened per domain, the mask of the advantages is ``final_response_mask = response_mask[1:] × sample_mask``
  (written as a column: the RLVR loss aggregates over it, §6.5), and ``domain``/``scored`` are copied.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from schemas.config import AdvantageSection
from schemas.errors import InvariantError
from schemas.tables import ADVANTAGED, REWARDED, SAMPLES, check_row_invariants
from stages.algos.estimators import estimator
from stages.algos.kl import get_kl_controller, kl_controller_from_state
from stages.algos.ragged import Ragged
from stages.algos.response_rewards import agentic_response_level_mask
from stages.algos.token_chain import (TokenRows, final_response_mask, next_token_mask, stats_from_partials, token_batch,
                                      token_rewards, whiten_partials_by_domain)
from stages.partials import read_partials, sum_partials, write_partials
from stages.stage import Stage, StageContext, slices
from stages.storage import Location, folder_fingerprint

log = logging.getLogger("rollflow.advantages")

REWARD_LOOKUP_CACHE: dict[str, tuple[RowIdIndex, dict[str, np.ndarray]]] = {}
# columns of the rewarded table copied to the output (those it has)
COPIED = ("response_level_rewards", "step_rewards", "episode_rewards_norm", "step_rewards_norm", "state_group_id",
          "domain", "scored")
NEXT_TOKEN_INPUTS = ("old_log_probs", "ref_log_probs", "infer_logprobs", "values")
KEY_CHUNK_ROWS = 65_536  # rows per step when packing ragged row_ids into fixed-width keys (bounds the scratch)


def row_id_keys(ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """n row_ids → n fixed-width byte keys (numpy ``S{w+1}``, w the longest id in bytes): each id's UTF-8 bytes, a
    0x01 terminator, zero padding. Two keys are equal exactly when their ids are; nulls become the empty id."""
    ids = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    ids = ids.cast(pa.large_string()) if not pa.types.is_large_string(ids.type) else ids
    n = len(ids)
    offsets = np.frombuffer(ids.buffers()[1], np.int64)[ids.offset:ids.offset + n + 1] if n else np.zeros(1, np.int64)
    data = np.frombuffer(ids.buffers()[2], np.uint8) if n and ids.buffers()[2] is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    if ids.null_count:
        lengths = np.where(ids.is_null().to_numpy(zero_copy_only=False), 0, lengths)
    width = int(lengths.max()) + 1 if n else 1
    out = np.zeros((n, width), np.uint8)
    for lo in range(0, n, KEY_CHUNK_ROWS):
        hi = min(n, lo + KEY_CHUNK_ROWS)
        ln, start = lengths[lo:hi], offsets[lo:hi]
        row = np.repeat(np.arange(lo, hi), ln)
        col = np.arange(len(row)) - np.repeat(np.cumsum(ln) - ln, ln)
        out[row, col] = data[np.repeat(start, ln) + col]
        out[np.arange(lo, hi), ln] = 1
    return out.view(f"S{width}").reshape(n)


def _key_text(key: bytes) -> str:
    """The row_id of a :func:`row_id_keys` key."""
    return key.rstrip(b"\0")[:-1].decode("utf-8", "replace")


class RowIdIndex:
    """A table's row_ids as a sorted array of :func:`row_id_keys` (w+1 bytes a row, no Python objects; the pandas
    Index of Python strings it replaces took ~7 times that, BENCHMARKS.md issue 49). :meth:`positions` answers in
    key order: :meth:`build` also returns the permutation that puts the table's rows in that order."""

    def __init__(self, sorted_keys: np.ndarray):
        self.keys = sorted_keys

    @classmethod
    def build(cls, ids: pa.Array | pa.ChunkedArray) -> tuple[RowIdIndex, np.ndarray]:
        """n row_ids → (their index, the (n,) int64 row positions in key order)."""
        keys = row_id_keys(ids)
        order = np.argsort(keys, kind="stable")
        return cls(keys[order]), order

    def __len__(self) -> int:
        return len(self.keys)

    def duplicate(self) -> str | None:
        """A row_id that occurs more than once, or None."""
        same = np.flatnonzero(self.keys[1:] == self.keys[:-1])
        return _key_text(self.keys[same[0]]) if len(same) else None

    def positions(self, ids: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``ids``: (its position in the sorted keys, clipped; whether it is there), both shape (n,)."""
        query = row_id_keys(ids)
        if not len(self.keys):
            return np.zeros(len(query), np.int64), np.zeros(len(query), bool)
        pos = np.minimum(np.searchsorted(self.keys, query), len(self.keys) - 1)
        return pos, self.keys[pos] == query


def indexed(table: pa.Table, where: str) -> tuple[RowIdIndex, dict[str, np.ndarray]]:
    """``table`` as (:class:`RowIdIndex` over its row_id, its other columns as numpy in the index's sorted order); a
    row_id that occurs twice is an :class:`InvariantError` naming ``where``."""
    index, order = RowIdIndex.build(table.column("row_id"))
    dup = index.duplicate()
    if dup is not None:
        raise InvariantError(f"{where}: row_id '{dup}' occurs more than once; re-run the stage that wrote it")
    return index, {c: table.column(c).to_numpy(zero_copy_only=False)[order] for c in table.column_names
                   if c != "row_id"}


def reward_lookup(files: list[str], fs, key: str):
    """The table in ``files`` :func:`indexed`, cached per worker process under ``key`` (one table at a time)."""
    if key not in REWARD_LOOKUP_CACHE:
        table = pads.dataset(files, filesystem=fs).to_table()
        where = f"table at {files[0].rsplit('/', 1)[0]}" if files else "table"
        REWARD_LOOKUP_CACHE.clear()
        REWARD_LOOKUP_CACHE[key] = indexed(table, where)
    return REWARD_LOOKUP_CACHE[key]


def take_by_row_id(table: tuple, batch: pa.Table, missing: str) -> dict[str, np.ndarray]:
    """The columns of an :func:`indexed` table for the rows of ``batch``, matched by row_id. A row it lacks raises
    :class:`InvariantError` with ``missing`` (``{row_id}`` is replaced by the row's id)."""
    index, cols = table
    pos, found = index.positions(batch.column("row_id"))
    if not found.all():
        raise InvariantError(missing.format(row_id=batch.column("row_id")[int(np.flatnonzero(~found)[0])].as_py()))
    return {c: v[pos] for c, v in cols.items()}


def joined_rows(lookup: tuple, batch: pa.Table, missing: str) -> dict[str, np.ndarray]:
    """:func:`take_by_row_id` on the table of ``lookup`` (files, filesystem, cache key: :func:`reward_lookup`)."""
    return take_by_row_id(reward_lookup(*lookup), batch, missing)


PATH_COLUMN = "path"  # the column Ray Data's read adds with include_paths: the file of each row


class RewardRanges:
    """Where each samples file's rows lie in a rewarded table that lists the samples' rows in their order (as the
    agentic rewards stage writes it): a task joins its file's rows against that range only — at most a file's rows
    and one row group more — instead of an index of the whole table, which grew with the rows (issue 49). Built
    from the Parquet footers; picklable (it travels with the map function)."""

    def __init__(self, samples: dict[str, tuple[int, int]], rewarded: list[tuple[str, int, int]], fs, folder: str):
        self.samples, self.rewarded, self.fs, self.folder = samples, rewarded, fs, folder

    @classmethod
    def of(cls, samples: Location, rewarded: Location) -> RewardRanges | None:
        """The ranges of the two tables' files, or None when their row counts differ (the rewarded rows cannot be
        the samples' in order)."""
        spans: list[list[tuple[str, int, int]]] = []
        for loc in (samples, rewarded):
            start, files = 0, []
            for path in loc.parquet_files():
                with loc.fs.open_input_file(path) as f:
                    rows = pq.read_metadata(f).num_rows
                files.append((path, start, rows))
                start += rows
            spans.append(files)
        total = [sum(n for _, _, n in files) for files in spans]
        if total[0] != total[1]:
            return None
        return cls({path: (start, n) for path, start, n in spans[0]}, spans[1], rewarded.fs, rewarded.path)

    def rows(self, path: str) -> pa.Table | None:
        """The rewarded rows at the positions of samples file ``path``'s rows (None for a file it does not know)."""
        if path not in self.samples:
            return None
        start, n = self.samples[path]
        parts = []
        for file, first, rows in self.rewarded:
            lo, hi = max(start, first) - first, min(start + n, first + rows) - first
            if lo >= hi:
                continue
            with self.fs.open_input_file(file) as f:
                reader = pq.ParquetFile(f)
                bounds = np.cumsum([0] + [reader.metadata.row_group(g).num_rows
                                          for g in range(reader.metadata.num_row_groups)])
                groups = list(range(int(np.searchsorted(bounds, lo, "right")) - 1,
                                    int(np.searchsorted(bounds, hi, "left"))))
                table = reader.read_row_groups(groups)
            parts.append(table.slice(lo - int(bounds[groups[0]]), hi - lo))
        return pa.concat_tables(parts) if parts else None


def token_rows(batch: pa.Table):
    """The block's :class:`~stages.algos.token_chain.TokenRows` (token mask ``response_mask[1:]``)."""
    cols = {c: Ragged.from_arrow(batch.column(c), np.float32) for c in NEXT_TOKEN_INPUTS if c in batch.column_names}
    return TokenRows(Ragged.from_arrow(batch.column("input_ids"), np.int32),
                     next_token_mask(Ragged.from_arrow(batch.column("response_mask"), np.float32)), cols)


class _AdvantageBatch:
    """The per-block computation, shared by the statistics passes and the output pass. A block (a whole file's rows,
    :meth:`StageContext.read_per_file`) is computed in slices of ``rows`` rows, which bounds the scratch memory;
    no value depends on where a slice starts (every sum runs inside a row)."""

    def __init__(self, section: AdvantageSection, where: str, rewarded: tuple, kl_coef: float, output: Location,
                 rows: int = 1024, ranges: RewardRanges | None = None):
        self.s, self.where, self.rewarded, self.kl_coef, self.output = section, where, rewarded, kl_coef, output
        self.rows, self.ranges = rows, ranges
        self.reward_stats: dict | None = None
        self.advantage_stats: dict | None = None

    def _lookup(self, block: pa.Table) -> tuple[pa.Table, tuple | None]:
        """The block without Ray's path column, and the :func:`indexed` rewarded rows of its file when they hold
        every row of the block (:class:`RewardRanges`); None: join against the whole table (:func:`reward_lookup`)."""
        if PATH_COLUMN not in block.column_names:
            return block, None
        paths = block.column(PATH_COLUMN)
        block = block.drop_columns([PATH_COLUMN])
        if self.ranges is None or not block.num_rows or pc.count_distinct(paths).as_py() != 1:
            return block, None
        rows = self.ranges.rows(paths[0].as_py())
        if rows is None:
            return block, None
        lookup = indexed(rows, f"table at {self.ranges.folder}")
        return block, (lookup if lookup[0].positions(block.column("row_id"))[1].all() else None)

    def _inputs(self, batch: pa.Table, lookup: tuple | None = None):
        """The slice's rewarded values (by row_id; from ``lookup``, else the whole table's), sample mask, domains
        and token rows."""
        check_row_invariants(SAMPLES, batch, self.where)
        missing = (f"samples table at {self.where}: row_id '{{row_id}}' has no response-level reward in the rewarded "
                   "table; re-run the rewards stage on this input")
        rewards = (take_by_row_id(lookup, batch, missing) if lookup is not None
                   else joined_rows(self.rewarded, batch, missing))
        n = batch.num_rows
        sample_mask = rewards["sample_mask"] if "sample_mask" in rewards else agentic_response_level_mask(n)[0]
        domains = rewards["domain"] if "domain" in rewards else np.full(n, "")
        return rewards, np.asarray(sample_mask, np.float32), domains, token_rows(batch)

    def _compute(self, batch: pa.Table, final: bool, lookup: tuple | None):
        rewards, sample_mask, domains, tokens = self._inputs(batch, lookup)
        result = token_batch(tokens, rewards["response_level_rewards"], sample_mask, domains, self.s, self.kl_coef,
                             reward_stats=self.reward_stats, advantage_stats=self.advantage_stats, final=final)
        return rewards, domains, tokens, result

    def reward_partials(self, block: pa.Table) -> pa.Table:
        block, lookup = self._lookup(block)
        return pa.concat_tables([self._reward_partials(batch, lookup) for batch in slices(block, self.rows) or [block]])

    def advantage_partials(self, block: pa.Table) -> pa.Table:
        block, lookup = self._lookup(block)
        return pa.concat_tables([self._advantage_partials(batch, lookup)
                                 for batch in slices(block, self.rows) or [block]])

    def _reward_partials(self, batch: pa.Table, lookup: tuple | None) -> pa.Table:
        rewards, sample_mask, domains, tokens = self._inputs(batch, lookup)
        tok = token_rewards(tokens, rewards["response_level_rewards"], self.s, self.kl_coef)
        fmask = final_response_mask(tokens, sample_mask)
        return _partials_table(whiten_partials_by_domain(tok.token_level_rewards.values, fmask,
                                                         tok.token_level_rewards.offsets, domains))

    def _advantage_partials(self, batch: pa.Table, lookup: tuple | None) -> pa.Table:
        _, domains, _, result = self._compute(batch, False, lookup)
        return _partials_table(whiten_partials_by_domain(result.advantages.values, result.final_mask,
                                                         result.advantages.offsets, domains))

    def __call__(self, block: pa.Table) -> pa.Table:
        """A block → its advantaged rows; the block's additive partials (metrics) are written once, keyed by its
        first row_id (a retried task overwrites its own file)."""
        outs, parts = [], {}
        block, lookup = self._lookup(block)
        for batch in slices(block, self.rows) or [block]:
            out, batch_parts = self._output(batch, lookup)
            outs.append(out)
            for key, value in batch_parts.items():
                parts[key] = parts.get(key, 0.0) + value
        if block.num_rows:
            write_partials(self.output, block.column("row_id")[0].as_py(), parts)
        return pa.concat_tables(outs)

    def _output(self, batch: pa.Table, lookup: tuple | None) -> tuple[pa.Table, dict[str, float]]:
        rewards, _, tokens, result = self._compute(batch, True, lookup)
        out = batch
        for name in COPIED:
            if name in rewards:
                typ = {**REWARDED.required, **REWARDED.optional}[name]
                values = rewards[name]
                out = out.append_column(name, pa.array(values.astype(str) if typ == pa.string() else values, typ))
        for name, ragged in (("token_level_rewards", result.token_level_rewards), ("advantages", result.advantages),
                             ("returns", result.returns), ("raw_advantages", result.raw_advantages)):
            out = out.append_column(name, ragged.to_arrow(pa.float32()))
        if "sample_mask" in rewards:
            out = out.append_column("final_response_mask",
                                    Ragged(result.final_mask, result.advantages.offsets).to_arrow(pa.float32()))
        parts = dict(result.partials)
        parts["mask_tokens"] = float(tokens.token_mask.sum())
        parts["adv_sum"] = float((result.advantages.values.astype(np.float64) * result.final_mask).sum())
        return out.select([f.name for f in ADVANTAGED.arrow_schema(present=out.column_names)]), parts


def _partials_table(parts: dict[str, tuple[float, float, float]]) -> pa.Table:
    names = list(parts)
    return pa.table({"domain": pa.array(names, pa.string()),
                     "partials": pa.array([list(parts[d]) for d in names], pa.list_(pa.float64()))})


def _domain_stats(ds, fn, options: dict) -> dict:
    """Sum per-domain whitening partials over all blocks → ``{domain: (mean, var) | None}`` (``options``: the
    stage's Ray task options)."""
    total: dict[str, list[float]] = {}
    for row in ds.map_batches(fn, batch_format="pyarrow", batch_size=None, **options).take_all():
        acc = total.setdefault(row["domain"], [0.0, 0.0, 0.0])
        for i in range(3):
            acc[i] += row["partials"][i]
    return stats_from_partials({d: tuple(v) for d, v in total.items()})


class AdvantagesStage(Stage):
    """``samples`` + ``rewarded`` → ``advantaged``. State: ``{"kl_ctrl": controller state}`` in and out; one
    controller update per step (the RLVR Q-5 fix)."""

    name = "advantages"
    version = "1"
    output_spec = ADVANTAGED
    section_model = AdvantageSection
    input_specs = {"samples": SAMPLES, "rewarded": REWARDED}

    def required_columns(self, section: AdvantageSection) -> dict[str, tuple[str, ...]]:
        needs: tuple[str, ...] = ("values",) if estimator(section.adv_estimator).needs_critic else ()
        if section.add_token_level_kl:
            needs += ("old_log_probs", "ref_log_probs")
        return {"samples": needs}

    def _controller(self, ctx: StageContext):
        s = ctx.section
        state = ctx.state_in.get("kl_ctrl")
        return kl_controller_from_state(state) if state else get_kl_controller(s.init_kl_coef, s.target_kl,
                                                                                s.kl_horizon)

    def build(self, ctx: StageContext):
        rewarded = ctx.inputs["rewarded"]
        fn = _AdvantageBatch(ctx.section, ctx.inputs["samples"].path,
                             (rewarded.parquet_files(), rewarded.fs, folder_fingerprint(rewarded)),
                             self._controller(ctx).value, ctx.output, ctx.batch_rows,
                             RewardRanges.of(ctx.inputs["samples"], rewarded))
        # each pass re-reads (streaming, bounded memory); the path of each row says which rewarded rows to join
        read = lambda: ctx.read_per_file("samples", include_paths=True)  # noqa: E731
        if ctx.section.whiten_rewards:
            fn.reward_stats = _domain_stats(read(), fn.reward_partials, ctx.task_options())
        if ctx.section.whiten_advantages:
            fn.advantage_stats = _domain_stats(read(), fn.advantage_partials, ctx.task_options())
        return read().map_batches(fn, batch_format="pyarrow", batch_size=None, **ctx.task_options())

    def finalize(self, ctx: StageContext, written: Location):
        total = sum_partials(read_partials(written))
        rows = total.get("rows", 0.0)
        current_kl = total.get("kl_sum", 0.0) / rows if rows else 0.0
        ctrl = self._controller(ctx)
        beta = ctrl.value if ctx.section.add_token_level_kl else 0.0
        ctrl.update(current_kl, int(rows))
        final_tokens, tokens = total.get("final_tokens", 0.0), total.get("mask_tokens", 0.0)
        metrics = {"critic/kl": current_kl, "critic/kl_coef": beta,
                   "critic/advantages/mean": total.get("adv_sum", 0.0) / final_tokens if final_tokens else 0.0}
        if "adv_clipped" in total:
            metrics["critic/advantage_clip_frac"] = total["adv_clipped"] / final_tokens if final_tokens else 0.0
        if "token_reward_clipped" in total:
            metrics["critic/token_reward_clip_frac"] = total["token_reward_clipped"] / tokens if tokens else 0.0
        if "sample_mask" in ctx.schemas["rewarded"].names:  # sample masks can leave a step nothing to train on
            metrics.update({"actor/final_mask_tokens": final_tokens, "rlvr/skip_step": float(final_tokens == 0)})
            if final_tokens == 0 and rows:
                log.warning("advantages: every row is masked (final_response_mask sums to 0); ROLL skips the "
                            "training step for such a batch")
        return metrics, {"kl_ctrl": ctrl.state_dict()}
