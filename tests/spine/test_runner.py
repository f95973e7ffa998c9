"""The one runner (stages/runner.py): skip on a matching fingerprint, --force, refusing to overwrite another
config's output, atomic commit (nothing of a failed run stays, a previous output is untouched), clean-up after a
crash, and the manifest's content."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from schemas.config import AdvantageSection, Frozen, ResponseRewardSection, section
from schemas.errors import InvariantError, RollflowError, SchemaError
from schemas.tables import SAMPLES
from stages.advantages import AdvantagesStage, indexed, take_by_row_id
from stages.parquet_parts import ROW_GROUP_ROWS, ordered_parquet_sink
from stages.response_rewards import ResponseRewardsStage
from stages.runner import run_stage, stage_fingerprint
from stages.stage import Stage, StageContext
from stages.storage import Location
from tests.spine.helpers import (GIGPO, config, read_table, run_recompute, siblings, tree_digest)


# ---- a tiny test stage: copies the samples, optionally failing in its second batch -----------------------------
class CopySection(Frozen):
    fail: str | None = None  # None | "runtime" | "rollflow" | "schema"
    tag: str = "a"


class FailingCopy:
    """Ray Data batch function; a module-level class so Ray workers import it by reference."""

    def __init__(self, fail: str | None):
        self.fail = fail

    def __call__(self, batch: pa.Table) -> pa.Table:
        first = batch.column("row_id")[0].as_py()
        if self.fail and first != self.first_row_id:
            if self.fail == "runtime":
                raise RuntimeError("boom in a later batch")
            if self.fail == "rollflow":
                raise InvariantError("samples table at somewhere: column 'score' is nan in row 3; fix it")
        if self.fail == "schema":
            return batch.drop_columns(["score"])
        return batch


class CopyStage(Stage):
    name = "copy"
    version = "1"
    output_spec = SAMPLES
    section_model = CopySection
    input_specs = {"samples": SAMPLES}

    def build(self, ctx: StageContext):
        fn = FailingCopy(ctx.section.fail)
        fn.first_row_id = read_table(ctx.inputs["samples"].path, ["row_id"]).column(0)[0].as_py()
        return ctx.read("samples").map_batches(fn, batch_format="pyarrow", batch_size=ctx.batch_rows)


def copy_run(samples: str, out: str, fail: str | None = None, tag: str = "a", force: bool = False,
             batch_rows: int = 64):
    return run_stage(CopyStage(), CopySection(fail=fail, tag=tag), {"samples": samples}, out, force=force,
                     batch_rows=batch_rows)


# ---- skip / force / changed config ----------------------------------------------------------------------------
def _parts(digest: dict) -> dict:
    return {k: v for k, v in digest.items() if k.endswith(".parquet")}


def test_skip_refuse_and_force(step_set, tmp_path, ray_cluster):
    out = str(tmp_path / "run")
    first = run_recompute(step_set, out, GIGPO)
    assert not first["rewarded"].skipped and not first["advantaged"].skipped
    before = tree_digest(out)

    # the same run again: both stages skip, nothing is rewritten (same bytes, same mtimes)
    second = run_recompute(step_set, out, GIGPO)
    assert second["rewarded"].skipped and second["advantaged"].skipped
    assert second["advantaged"].fingerprint == first["advantaged"].fingerprint
    assert second["advantaged"].rows == first["advantaged"].rows
    assert second["advantaged"].metrics == pytest.approx(first["advantaged"].metrics)
    assert tree_digest(out) == before

    # another config without --force: an error naming the folder and the fix; the old output stays
    changed = config(GIGPO, advantage_clip=5.0)  # only the advantages section changes
    with pytest.raises(RollflowError) as err:
        run_recompute(step_set, out, changed)
    msg = str(err.value)
    assert "advantaged" in msg and "--force" in msg and "another config" in msg
    assert tree_digest(out) == before
    assert siblings(Path(out) / "advantaged") == ["advantaged"]

    # --force recomputes every stage: the unchanged one gets the same fingerprint and the same bytes
    forced = run_recompute(step_set, out, changed, force=True)
    assert not forced["rewarded"].skipped and not forced["advantaged"].skipped
    assert forced["rewarded"].fingerprint == first["rewarded"].fingerprint
    assert forced["advantaged"].fingerprint != first["advantaged"].fingerprint
    after = tree_digest(out)
    rewarded_parts = {k: v for k, v in _parts(before).items() if k.startswith("rewarded/")}
    assert all(after[k][1] != v[1] and after[k][0] == v[0] for k, v in rewarded_parts.items()), \
        "--force rewrites the files; recomputing is deterministic"
    manifest = json.loads((Path(out) / "advantaged/manifest.json").read_text())
    assert manifest["section"]["advantage_clip"] == 5.0
    adv = pc.list_flatten(read_table(Path(out) / "advantaged", ["advantages"]).column(0)).to_numpy()
    assert np.abs(adv).max() <= 5.0
    assert sorted(os.listdir(out)) == ["advantaged", "rewarded"]


def test_output_folder_without_manifest_is_not_overwritten(step_set, tmp_path, ray_cluster):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RollflowError, match="without a rollflow manifest"):
        copy_run(step_set, str(out))
    assert (out / "notes.txt").read_text() == "mine"
    assert os.listdir(out) == ["notes.txt"]


# ---- failures leave nothing behind ------------------------------------------------------------------------------
def test_failing_stage_commits_nothing_and_keeps_previous_output(step_set, tmp_path, ray_cluster):
    out = tmp_path / "copy"
    good = copy_run(step_set, str(out))
    assert good.rows == read_table(step_set).num_rows
    before = tree_digest(out)

    # not ours: Ray's exception, left as it is (with the worker's traceback)
    with pytest.raises(Exception, match="boom in a later batch"):
        copy_run(step_set, str(out), fail="runtime", force=True)
    assert tree_digest(out) == before, "the previous output must be untouched"
    assert siblings(out) == ["copy"], "no temporary folder may remain"

    # ours, raised in a Ray task: it comes out of Ray's wrappers as its own class with its own message
    with pytest.raises(InvariantError) as err:
        copy_run(step_set, str(out), fail="rollflow", force=True)
    assert type(err.value) is InvariantError
    assert str(err.value) == "samples table at somewhere: column 'score' is nan in row 3; fix it"
    assert tree_digest(out) == before and siblings(out) == ["copy"]

    # an output that breaks the output schema (checked after writing, before committing)
    with pytest.raises(SchemaError) as err:
        copy_run(step_set, str(out), fail="schema", force=True)
    assert "missing column 'score'" in str(err.value) and "output of copy" in str(err.value)
    assert tree_digest(out) == before and siblings(out) == ["copy"]


def test_failing_first_run_leaves_no_folder(step_set, tmp_path, ray_cluster):
    out = tmp_path / "nested" / "copy"
    with pytest.raises(Exception, match="boom in a later batch"):
        copy_run(step_set, str(out), fail="runtime")
    assert siblings(out) == []
    assert not out.parent.exists(), "the folder created for the output is removed again"


# ---- crash leftovers ----------------------------------------------------------------------------------------------
def test_leftovers_of_a_crash_are_cleaned_and_an_interrupted_replace_is_restored(step_set, tmp_path, ray_cluster):
    out = tmp_path / "copy"
    first = copy_run(step_set, str(out))
    before = tree_digest(out)

    # a crash while writing: a temporary folder with half a file
    tmp = tmp_path / f".copy.tmp-{os.getpid()}-0badc0de"
    tmp.mkdir()
    (tmp / "half.parquet").write_bytes(b"PAR1 not finished")
    again = copy_run(step_set, str(out))
    assert again.skipped and again.fingerprint == first.fingerprint
    assert siblings(out) == ["copy"] and tree_digest(out) == before

    # a crash between "move the old output aside" and "move the new one in": old restored, tmp dropped
    old = tmp_path / ".copy.old-12345678"
    out.rename(old)
    tmp.mkdir()
    (tmp / "manifest.json").write_text("{}")
    again = copy_run(step_set, str(out))
    assert again.skipped
    assert siblings(out) == ["copy"] and tree_digest(out) == before

    # a crash after the new output was moved in but before the old one was deleted: the stale copy goes
    stale = tmp_path / ".copy.old-87654321"
    stale.mkdir()
    (stale / "part-00000.parquet").write_bytes(b"old")
    assert copy_run(step_set, str(out)).skipped
    assert siblings(out) == ["copy"] and tree_digest(out) == before


def test_many_small_batches_keep_row_order(step_set, tmp_path, ray_cluster):
    """~100 batches per write task: Ray's own Parquet writer (pyarrow's threaded dataset writer) put them into the
    file out of order in about 1 run in 10; the runner's writer keeps the dataset order. Only this output's
    leftovers are cleaned (``.copy0.tmp-*``), not a sibling's (``.copy.tmp-*``)."""
    other_tmp = tmp_path / ".copy.tmp-1-abcdef12"
    other_tmp.mkdir()
    expected = read_table(step_set)
    for k in range(3):
        copy_run(step_set, str(tmp_path / f"copy{k}"), tag=str(k), batch_rows=4)
        assert read_table(tmp_path / f"copy{k}").equals(expected), f"run {k}: rows reordered"
    assert other_tmp.exists()


# ---- manifest content --------------------------------------------------------------------------------------------
def _manifest(folder) -> dict:
    return json.loads((Path(folder) / "manifest.json").read_text())


def test_manifest_records_rows_files_schema_fingerprint(base_run, step_set):
    samples_rows = read_table(step_set, ["row_id"]).num_rows
    for name, stage, sec in (("rewarded", ResponseRewardsStage(), ResponseRewardSection),
                             ("advantaged", AdvantagesStage(), AdvantageSection)):
        folder = Path(base_run) / name
        m = _manifest(folder)
        assert m["stage"] == stage.name and m["version"] == stage.version and m["table"] == stage.output_spec.name
        assert m["rows"] == samples_rows
        on_disk = sorted(p.name for p in folder.glob("*.parquet"))
        assert [f["name"] for f in m["files"]] == on_disk == [f"part-{i:05d}.parquet" for i in range(len(on_disk))]
        for f in m["files"]:
            path = folder / f["name"]
            assert f["rows"] == pq.read_metadata(path).num_rows and f["bytes"] == path.stat().st_size
        assert sum(f["rows"] for f in m["files"]) == m["rows"]
        schema = pq.read_schema(folder / on_disk[0])
        assert m["schema"] == [f"{f.name}: {f.type}" for f in schema]
        stage.output_spec.check_schema(schema, str(folder))
        inputs = {k: Location.of(v["path"]) for k, v in m["inputs"].items()}
        assert set(inputs) == set(stage.inputs_for(section(config(GIGPO), sec)))
        expected_fp = stage_fingerprint(stage, section(config(GIGPO), sec), inputs, m["state_in"])
        assert m["fingerprint"] == expected_fp
        assert m["section"] == section(config(GIGPO), sec).model_dump(mode="json")
        assert sorted(os.listdir(folder)) == sorted(on_disk + ["manifest.json"]), "no _partials or stray files"
    assert _manifest(Path(base_run) / "advantaged")["inputs"]["rewarded"]["fingerprint"] == \
        _manifest(Path(base_run) / "rewarded")["fingerprint"]


def test_manifest_metrics_match_the_written_table(base_run, step_set):
    """The metrics summed from per-block partials equal the statistics of the whole written table."""
    table = read_table(Path(base_run) / "advantaged")
    m = _manifest(Path(base_run) / "advantaged")["metrics"]
    mask = pc.list_flatten(pc.list_slice(table.column("response_mask"), 1)).to_numpy().astype(np.float64)
    adv = pc.list_flatten(table.column("advantages")).to_numpy().astype(np.float64)
    assert m["critic/advantages/mean"] == pytest.approx((adv * mask).sum() / mask.sum(), rel=1e-9, abs=1e-12)
    assert m["critic/advantage_clip_frac"] == pytest.approx(
        ((np.abs(adv) >= 20.0) & (mask > 0)).sum() / mask.sum())
    # critic/kl: mean over rows of the masked row-mean of kl = old - ref (kl_penalty "kl")
    old = table.column("old_log_probs")
    kl = (pc.list_flatten(old).to_numpy().astype(np.float64)
          - pc.list_flatten(table.column("ref_log_probs")).to_numpy().astype(np.float64))
    rows = np.repeat(np.arange(table.num_rows), pc.list_value_length(old).to_numpy())
    row_mean = np.bincount(rows, kl * mask, table.num_rows) / np.maximum(np.bincount(rows, mask, table.num_rows), 1)
    assert m["critic/kl"] == pytest.approx(row_mean.mean(), rel=1e-6)
    assert m["critic/kl_coef"] == 0.0
    state = _manifest(Path(base_run) / "advantaged")["state"]
    assert state["kl_ctrl"]["value"] == 0.0

    rewarded = _manifest(Path(base_run) / "rewarded")["metrics"]
    r = read_table(Path(base_run) / "rewarded", ["response_level_rewards"]).column(0).to_numpy()
    assert rewarded["critic/response_level_rewards/mean"] == pytest.approx(r.mean(), abs=1e-6)
    assert rewarded["critic/response_level_rewards/max"] == pytest.approx(r.max())
    assert {"system/state_batch_size/max", "system/state_batch_size/mean"} <= set(rewarded)


def test_output_keeps_input_row_order_and_adds_columns(base_run, step_set):
    samples = read_table(step_set)
    advantaged = read_table(Path(base_run) / "advantaged")
    rewarded = read_table(Path(base_run) / "rewarded")
    assert advantaged.column("row_id").equals(samples.column("row_id"))
    assert rewarded.column("row_id").equals(samples.column("row_id"))
    for name in samples.column_names:  # a stage adds columns and never mutates its input
        assert advantaged.column(name).equals(samples.column(name)), name


def test_row_id_lookup_matches_ids_of_any_length_exactly():
    """The advantages stage's join (a sorted array of fixed-width keys): ids of different lengths, ones that differ
    only by a trailing NUL or 0x01 byte, non-ASCII and empty ids each find their own row; a missing or longer id and a
    repeated id are errors naming it."""
    ids = ["b", "a", "ccc", "a\x01", "a\x00", "", "dé", "a\x00\x01"]
    lookup = indexed(pa.table({"row_id": pa.array(ids), "v": np.arange(len(ids), dtype=np.float64)}), "t")
    query = ids[::-1] + ["a", "dé"]
    got = take_by_row_id(lookup, pa.table({"row_id": pa.chunked_array([query[:3], query[3:]])}), "missing {row_id}")
    assert got["v"].tolist() == [float(ids.index(q)) for q in query]
    for absent in ("zzzzzzzz", "a\x02", "aa"):
        with pytest.raises(InvariantError, match=f"missing {absent}"):
            take_by_row_id(lookup, pa.table({"row_id": ["a", absent]}), "missing {row_id}")
    with pytest.raises(InvariantError, match="t: row_id 'x' occurs more than once"):
        indexed(pa.table({"row_id": ["x", "y", "x"]}), "t")


def test_the_sink_types_a_column_that_is_all_none_in_its_first_blocks(tmp_path):
    """A write task's first blocks may hold a column only as None (Arrow type null); the file takes the type of the
    first block that has values, as it did when the sink unified every block's schema; blocks are written in order,
    in row groups of at most ROW_GROUP_ROWS rows."""
    from types import SimpleNamespace

    blocks = [pa.table({"row_id": ["a"], "x": pa.nulls(1)}), pa.table({"row_id": ["b"], "x": pa.nulls(1)}),
              pa.table({"row_id": ["c"], "x": pa.array([1.5])}),
              pa.table({"row_id": [f"d{i}" for i in range(ROW_GROUP_ROWS + 1)], "x": pa.nulls(ROW_GROUP_ROWS + 1)})]
    sink = ordered_parquet_sink(Location.of(str(tmp_path)))
    assert sink.write(iter(blocks), SimpleNamespace(task_idx=3)) == ROW_GROUP_ROWS + 4
    written = pq.ParquetFile(tmp_path / "00000003.parquet")
    assert written.schema_arrow.field("x").type == pa.float64()
    assert max(written.metadata.row_group(i).num_rows for i in range(written.num_row_groups)) <= ROW_GROUP_ROWS
    table = written.read()
    assert table.column("row_id").to_pylist()[:4] == ["a", "b", "c", "d0"]
    assert table.column("x").to_pylist()[:4] == [None, None, 1.5, None]


