"""The forward workers of a run without a kept training group (keep_workers: false) fail with a diagnosis instead of
waiting forever (stages/train/stage.py ForwardWorkers), under the run's train.runtime limits: workers Ray never
places fail with what each asks and what is free; a worker that stalls in a batch is named with its process.

Placement is real: the worker asks for a GPU this cluster does not have. The stall is a real Ray actor of the
workers' class (a ForwardServer subclass) that sleeps in the call the stage waits on, run by the log-prob stage."""

from __future__ import annotations

import time

import pytest

from schemas.train_config import ForwardConfig
from stages.ray_errors import unwrap_error
from stages.train.group import Limits
from stages.train.stage import ForwardServer, ForwardStalled, ForwardWorkers, run_logprobs
from tests.train.tables import advantaged_rows, write_table

pytestmark = pytest.mark.usefixtures("ray_cluster")
ONE = ForwardConfig(rows_per_batch=4, num_actors=1)


class StallingServer(ForwardServer):
    """A forward worker that loads nothing and sleeps in every batch."""

    def __init__(self, threads: int):
        pass

    def run(self, *args, **kwargs):
        time.sleep(60)


class StallingWorkers(ForwardWorkers):
    server_class = StallingServer


def test_workers_never_placed_fail_with_what_they_ask():
    workers = ForwardWorkers(ONE, gpus_per_actor=1, limits=Limits(placement=0.5, build=None, step=None))
    with pytest.raises(ForwardStalled, match=r"1 of 1 forward workers \(worker\(s\) \[0\]\) were not placed by Ray "
                                             r"within train.runtime.placement_timeout_s \(0.5 s\): each asks "
                                             r"\{'CPU': 0.0, 'GPU': 1\} and the cluster has .* free now"):
        workers.actors()
    assert workers._actors == [] and workers.placed == []


def test_a_worker_that_stalls_in_a_batch_is_named(tiny_model, tmp_path):
    samples = write_table(advantaged_rows(4, lengths=(6, 12), seed=3), tmp_path / "samples")
    workers = StallingWorkers(ONE, limits=Limits(placement=None, build=None, step=0.5))
    try:
        workers.actors()
        (pid, _), = workers.placed
        with pytest.raises(Exception) as caught:
            run_logprobs(str(samples), str(tiny_model), ONE, str(tmp_path / "lp"), workers=workers)
    finally:
        workers.close()
    error = unwrap_error(caught.value)
    assert isinstance(error, ForwardStalled), caught.value
    assert str(error).startswith(f"forward worker 0 (pid {pid} on ")
    assert "has not answered a batch of 4 rows of" in str(error)
    assert "within train.runtime.step_timeout_s (0.5 s); py-spy dump --pid" in str(error)
