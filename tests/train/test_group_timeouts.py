"""A training step that cannot progress fails with a diagnosis instead of waiting forever (stages/train/group.py):
workers Ray never places fail with what they ask and what is free; a worker that stalls is named with its process.

The stall is real: the group's real actors, placement group and waiting, with workers that sleep in their step."""

from __future__ import annotations

import time

import pytest

from schemas.train_config import TrainRuntimeConfig
from stages.ray_errors import unwrap_error
from stages.train.group import (BUILDING, IDLE, TRAINING, Limits, Placed, TrainerGroup, TrainingStalled, TrainWorker,
                                actor_options, process_group_env, stall)

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


class SleepingWorker(TrainWorker):
    """A rank that joins no process group and sleeps in its request: a worker stuck in a step."""

    def join(self, env: dict[str, str], threads: int) -> None:
        self.env = env

    def run(self, request: dict) -> None:
        time.sleep(60)


class SleepingGroup(TrainerGroup):
    worker_class = SleepingWorker

    def _drop(self) -> None:
        self.dropped = self._placement
        super()._drop()


def test_a_worker_that_sleeps_in_its_step_is_named_and_the_group_dropped(ray_cluster):
    import ray

    group = SleepingGroup(TrainRuntimeConfig(num_workers=2, engine_build_timeout_s=0.5, step_timeout_s=0.5))
    with pytest.raises(TrainingStalled, match=r"rank 0 \(pid \d+ on .*\) has been building its engines for \d+ s, "
                                              r"past runtime.engine_build_timeout_s \+ step_timeout_s \(1 s\)"):
        group.step({}, unwrap_error)
    assert group._workers == []  # dropped: the next step starts a fresh group
    assert ray.util.placement_group_table(group.dropped)["state"] == "REMOVED"  # not left reserved


def test_workers_never_placed_fail_with_what_they_ask(ray_cluster):
    runtime = TrainRuntimeConfig(num_workers=2, placement_timeout_s=0.5, stage_resources={"train_step": {"nowhere": 1}})
    group = TrainerGroup(runtime)
    with pytest.raises(TrainingStalled, match=r"2 of 2 training workers \(rank\(s\) \[0, 1\]\) were not placed.*"
                                              r"each asks .*'CPU': 0.*'nowhere': 1.*free now"):
        group.step({}, unwrap_error)
    assert group._placement is None


def test_the_process_group_environment_of_one_node():
    placed = [Placed("n0", "10.0.0.1", (), 11, "a"), Placed("n0", "10.0.0.1", (), 12, "a")]
    envs = process_group_env(placed, 29500)
    assert envs == [{"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": str(r), "WORLD_SIZE": "2",
                     "NODE_RANK": "0", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(r)} for r in range(2)]


def test_the_process_group_environment_over_nodes_and_gpus():
    # rank order is the placement group's; a node's workers see the node's training GPUs, each its own as LOCAL_RANK
    placed = [Placed("n1", "10.0.0.2", ("3",), 1, "b"), Placed("n0", "10.0.0.1", ("10",), 2, "a"),
              Placed("n1", "10.0.0.2", ("1",), 3, "b"), Placed("n0", "10.0.0.1", ("2",), 4, "a")]
    envs = process_group_env(placed, 7000)
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.2"} and [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["NODE_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1,3", "2,10", "1,3", "2,10"]
    assert [e["LOCAL_RANK"] for e in envs] == ["1", "1", "0", "0"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"} and {e["WORLD_SIZE"] for e in envs} == {"4"}


def test_a_bundle_becomes_the_options_of_one_actor():
    bundle = {"CPU": 0, "memory": 64 * 2**20, "GPU": 0.5, "trainer_node": 1.0}
    assert actor_options(bundle) == {"num_cpus": 0, "memory": 64 * 2**20, "num_gpus": 0.5,
                                     "resources": {"trainer_node": 1.0}}
    assert actor_options({"CPU": 1}) == {"num_cpus": 1}  # no empty custom resources
