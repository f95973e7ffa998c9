"""A training step that cannot progress fails with a diagnosis instead of waiting forever (stages/train/group.py):
workers Ray never places fail with what they ask and what is free; a worker that stalls is named with its process.

The stall is real: a Ray actor checks in with the group's real mailbox as a worker would, then sleeps."""

from __future__ import annotations

import os
import time

import pytest

from schemas.train_config import TrainRuntimeConfig
from stages.train.group import (BUILDING, IDLE, TRAINING, Limits, Mailbox, TrainerGroup, TrainingStalled, _checkin,
                                stall)

LIMITS = Limits(placement=60.0, build=120.0, step=30.0)


def test_nothing_is_wrong_within_the_limits():
    states = {0: (TRAINING, 11, "a", 29.0), 1: (BUILDING, 12, "a", 149.0), 2: (IDLE, 13, "b", 1e6)}
    assert stall(states, 3, 1e6, LIMITS) is None
    assert stall({0: (TRAINING, 11, "a", 1.0)}, 2, 59.0, LIMITS) is None


def test_unplaced_workers_past_the_placement_limit_are_counted():
    problem = stall({0: (TRAINING, 11, "a", 1.0)}, 3, 61.0, LIMITS)
    assert "2 of 3 training workers (rank(s) [1, 2])" in problem and "placement_timeout_s (60 s)" in problem


def test_a_stalled_worker_is_named_with_its_process_and_limit():
    problem = stall({0: (IDLE, 11, "a", 500.0), 1: (TRAINING, 12, "node-b", 31.0)}, 2, 500.0, LIMITS)
    assert "rank 1 (pid 12 on node-b) has been training for 31 s" in problem and "step_timeout_s (30 s)" in problem
    building = stall({0: (BUILDING, 11, "a", 151.0)}, 1, 151.0, LIMITS)
    assert "building its engines" in building and "engine_build_timeout_s + step_timeout_s (150 s)" in building


def test_no_limits_wait_forever():
    assert stall({0: (TRAINING, 1, "a", 1e9)}, 2, 1e9, Limits(None, None, None)) is None


def _group(ranks: int, **limits) -> TrainerGroup:
    import ray

    group = TrainerGroup(TrainRuntimeConfig(num_workers=ranks, **limits))
    group._mailbox = ray.remote(num_cpus=0, max_concurrency=4)(Mailbox).remote(ranks)
    group._started = time.monotonic()
    return group


def test_a_worker_that_sleeps_in_its_step_is_named(ray_cluster):
    import ray

    @ray.remote(num_cpus=0)
    class SleepingWorker:
        def work(self, mailbox, rank: int) -> int:
            _checkin(mailbox, rank, TRAINING)
            time.sleep(60)
            return os.getpid()

        def pid(self) -> int:
            return os.getpid()

    group = _group(2, step_timeout_s=0.2)
    worker = SleepingWorker.remote()
    try:
        pid = ray.get(worker.pid.remote())
        _checkin(group._mailbox, 0, IDLE)
        worker.work.remote(group._mailbox, 1)
        group._check_progress()  # nothing stalled yet, or the worker has not checked in
        deadline = time.monotonic() + 30
        with pytest.raises(TrainingStalled, match=rf"rank 1 \(pid {pid} on .*\) has been training"):
            while time.monotonic() < deadline:
                group._check_progress()
                time.sleep(0.1)
    finally:
        ray.kill(worker)
        ray.kill(group._mailbox)


def test_workers_never_placed_fail_with_what_they_ask(ray_cluster):
    import ray

    group = _group(2, placement_timeout_s=0.1)
    try:
        _checkin(group._mailbox, 0, IDLE)
        time.sleep(0.2)
        with pytest.raises(TrainingStalled, match=r"1 of 2 training workers \(rank\(s\) \[1\]\) were not placed.*"
                                                  r"each asks .*'CPU': 0.*free now"):
            group._check_progress()
    finally:
        ray.kill(group._mailbox)
