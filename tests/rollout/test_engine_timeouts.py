"""An engine pool that cannot progress fails with a diagnosis instead of waiting forever (stages/rollout/
engine_pool.py): engines Ray never places fail with what each asks and what is free; an engine that stalls while it
builds, loads new weights or wakes is named with its process and host.

Placement is real: the engine asks for a GPU this cluster does not have. The stalls are real Ray actors of the pool
(EngineActor subclasses) that sleep in the method the pool waits on."""

from __future__ import annotations

import time

import pytest

from schemas.rollout_config import EngineConfig
from stages.rollout.engine_pool import EngineActor, EnginePool, EngineStalled


def test_the_limits_are_left_out_of_the_dump_at_their_defaults():
    """Configs that do not set them dump, and hash, as before the options existed."""
    assert not {"placement_timeout_s", "build_timeout_s", "reload_timeout_s"} & set(EngineConfig().model_dump())
    assert EngineConfig(build_timeout_s=None).model_dump()["build_timeout_s"] is None


def test_engines_never_placed_fail_with_what_they_ask(ray_cluster, tiny_model):
    pool = EnginePool(EngineConfig(backend="hf", placement_timeout_s=0.5), tiny_model, 64, gpus_per_engine=1)
    with pytest.raises(EngineStalled, match=r"1 of 1 hf engine\(s\) \(engine\(s\) \[0\]\) were not placed by Ray "
                                            r"within engine.placement_timeout_s \(0.5 s\): each asks \{'CPU': 1.0, "
                                            r"'GPU': 1.0\} and the cluster has .* free now"):
        pool.handles()
    assert not pool.built


def test_an_engine_that_stalls_in_its_build_is_named(ray_cluster, tiny_model):
    class StallingBuild(EngineActor):
        def build(self):
            time.sleep(60)

    class Pool(EnginePool):
        actor_class = StallingBuild

    pool = Pool(EngineConfig(backend="hf", build_timeout_s=0.5), tiny_model, 64)
    with pytest.raises(EngineStalled, match=r"hf engine 0 \(pid \d+ on .+\) has been building its engine on "
                                            r".+ for more than engine.build_timeout_s \(0.5 s\); py-spy dump --pid"):
        pool.handles()
    assert not pool.built


def test_an_engine_that_stalls_loading_weights_or_waking_is_named(ray_cluster, tiny_model, tmp_path):
    class StallingReload(EngineActor):
        def build(self):
            return self.info()  # no model: the engine's own work is not what is tested

        def load_weights(self, checkpoint_dir):
            time.sleep(5)  # past the limit; the actor then serves the next call

        def sleep(self, level):
            return {"released_bytes": 0, "offloaded_bytes": 0}

        def wake(self, checkpoint_dir):
            time.sleep(5)

    class Pool(EnginePool):
        actor_class = StallingReload

    pool = Pool(EngineConfig(backend="hf", sleep_level=1, reload_timeout_s=0.5), tiny_model, 64)
    try:
        pool.handles()
        with pytest.raises(EngineStalled, match=rf"hf engine 0 \(pid \d+ on .+\) has been loading the weights of "
                                                rf"{tmp_path.resolve()} for more than engine.reload_timeout_s \(0.5 s\)"):
            pool.use_checkpoint(tmp_path)
        pool.actor_info()  # once the stalled call has ended
        pool.sleep()
        with pytest.raises(EngineStalled, match=r"hf engine 0 \(pid \d+ on .+\) has been waking for more than "
                                                r"engine.reload_timeout_s"):
            pool.wake()
    finally:
        pool.close()
