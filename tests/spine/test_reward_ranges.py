"""The advantages stage joins each samples file's rows against that file's range of a rewarded table in the samples'
order (stages/advantages.py ``RewardRanges``, issue 49), and against the whole table otherwise. Unit level (no Ray),
on the spine's ``step_set``."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas.config import AdvantageSection, ResponseRewardSection, section
from stages.advantages import PATH_COLUMN, RewardRanges, _AdvantageBatch
from stages.response_rewards import NARROW, read_narrow, response_rewards_table
from stages.storage import Location
from tests.spine.helpers import GRPO, config, read_table, write_samples


def _rewarded(samples: Location) -> pa.Table:
    return response_rewards_table(read_narrow(samples, NARROW + ["state_hash"], None, 1024),
                                  section(config(GRPO), ResponseRewardSection), "w")[0]


def _batch(ranges, rewarded_files, tmp_path) -> _AdvantageBatch:
    return _AdvantageBatch(section(config(GRPO), AdvantageSection), "samples", (rewarded_files, None, "k"), 0.0,
                           Location.of(str(tmp_path / "out")), 64, ranges)


def test_the_advantages_join_reads_only_its_files_range_of_an_aligned_rewarded_table(step_set, tmp_path):
    samples = Location.of(step_set)
    whole = _rewarded(samples)
    folder = tmp_path / "rewarded"
    folder.mkdir()
    for i, lo in enumerate(range(0, whole.num_rows, 150)):  # other file bounds than the samples', small row groups
        pq.write_table(whole.slice(lo, 150), folder / f"part-{i:05d}.parquet", row_group_size=40)
    ranges = RewardRanges.of(samples, Location.of(str(folder)))
    fn = _batch(ranges, [str(p) for p in sorted(folder.glob("*.parquet"))], tmp_path)
    for path in samples.parquet_files():
        block = pq.read_table(path)
        with_path = block.append_column(PATH_COLUMN, pa.array([path] * block.num_rows))
        rest, lookup = fn._lookup(with_path)
        assert rest.equals(block) and lookup is not None and len(lookup[0]) == block.num_rows
        expected = whole.filter(pc.is_in(whole.column("row_id"), block.column("row_id")))
        assert ranges.rows(path).column("row_id").equals(expected.column("row_id"))


def test_a_rewarded_table_in_another_order_is_joined_against_the_whole_table(step_set, tmp_path):
    samples = Location.of(step_set)
    whole = _rewarded(samples)
    folder = write_samples(whole.sort_by("row_id"), tmp_path / "rewarded")
    fn = _batch(RewardRanges.of(samples, Location.of(folder)), [str(p) for p in sorted((tmp_path / "rewarded")
                                                                                     .glob("*.parquet"))], tmp_path)
    path = samples.parquet_files()[0]
    block = pq.read_table(path)
    rest, lookup = fn._lookup(block.append_column(PATH_COLUMN, pa.array([path] * block.num_rows)))
    assert lookup is None and rest.equals(block)
    assert RewardRanges.of(samples, Location.of(folder)) is not None
    assert RewardRanges.of(samples, Location.of(write_samples(whole.slice(1), tmp_path / "short"))) is None
    assert read_table(folder).num_rows == whole.num_rows
