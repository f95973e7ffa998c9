"""The local cluster's read settings (stages/cluster.py) take effect in Ray Data's Parquet reader."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stages.cluster import READ_UNIT_MB


def test_each_file_over_the_read_unit_is_its_own_read_task(tmp_path, ray_cluster):
    """Three files of ~0.6 read units each: Ray's default 128 MiB unit would read them as one task on one CPU;
    ours reads them as three (both CPUs busy, a third of the memory per task)."""
    import ray.data

    rows = int(0.6 * READ_UNIT_MB * 2**20 / 8)
    rng = np.random.default_rng(0)
    files = [str(tmp_path / f"part-{i}.parquet") for i in range(3)]
    for f in files:
        pq.write_table(pa.table({"x": rng.random(rows)}), f, compression="none", use_dictionary=False,
                       row_group_size=rows)
    assert all(0.5 * READ_UNIT_MB * 2**20 < pq.read_metadata(f).row_group(0).total_byte_size for f in files)
    ds = ray.data.read_parquet(files).materialize()
    assert ds.num_blocks() == 3
    assert ds.count() == 3 * rows
