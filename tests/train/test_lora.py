"""LoRA training (model_args.lora_rank) on a real DeepSpeed engine (world of one, CPU, the tiny random model).

What must hold: only the adapters train and the optimizer state holds them alone; a checkpoint's weights are the
merged ``W + (alpha / r) B A`` and load as a plain Hugging Face model with the peft model's log-probs; resuming
from a LoRA checkpoint (with its DeepSpeed state, or weights-only through replay) equals training straight on;
bad options and a changed base are refused with the option or folder named."""

import json
import shutil

import numpy as np
import pytest
import torch

from schemas.config import validate_config
from schemas.errors import ConfigError, RollflowError
from schemas.train_config import TrainStepConfig
from stages.train.batching import TokenRows
from stages.train.checkpoint import read_checkpoint
from stages.train.core import run_training, train_and_save
from stages.train.engine import Engine
from stages.train.forward import forward_rows
from stages.train.lora import merged_state_dict, trainable_parameter_count, wrap
from stages.train.models import load_actor_model
from stages.train.step import train_step
from stages.train.train_table import rows_of_table
from tests.train.tables import advantaged_rows
from tests.train.test_core import section, with_model_log_probs


@pytest.fixture(scope="module")
def table(tiny_model):
    return with_model_log_probs(advantaged_rows(8, lengths=(10, 30), seed=1, multi_turn=True), tiny_model)


def lora_section(**kw):
    return section(**{"actor_train.model_args.lora_rank": 4, "actor_train.model_args.lora_alpha": 16,
                      "actor_train.training_args.per_device_train_batch_size": 4, **kw})


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _close(a: torch.Tensor, b: torch.Tensor, what: str, ulps: float = 8) -> None:
    """Equal within a few float32 ulps of the larger magnitude involved (not a fixed absolute tolerance)."""
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
    diff = float((a.float() - b.float()).abs().max())
    assert diff <= ulps * torch.finfo(torch.float32).eps * scale, f"{what}: differs by {diff:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_only_adapters_train_and_the_optimizer_state_holds_them_alone(zero_stage, dist, tiny_model, table):
    cfg = lora_section(**{"actor_train.strategy_args.zero_stage": zero_stage})
    full = load_actor_model(str(tiny_model))
    total = sum(p.numel() for p in full.parameters())
    model = wrap(full, cfg.actor_train.model_args, "actor", seed=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    targets = set(cfg.actor_train.model_args.lora_target_modules)
    assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n in trainable} == targets
    count = trainable_parameter_count(model)
    # r (d_in + d_out) per adapted layer, summed over layers
    expected = sum(4 * (m.in_features + m.out_features) for name, m in load_actor_model(str(tiny_model)).named_modules()
                   if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)
    assert count == expected < total / 10

    engine = Engine(model, cfg.actor_train, dist, "actor")
    train_step(rows_of_table(table, "t"), engine, None, cfg, dist, 0, 0)
    inner = engine.engine.optimizer
    base_opt = getattr(inner, "optimizer", inner)  # ZeRO wraps the torch optimizer
    moments = [s["exp_avg"] for s in base_opt.state.values()]
    held = sum(m.numel() for m in moments)
    assert count <= held <= count + 64 * len(moments), (held, count)  # ZeRO's flat partition may pad a little


def test_merged_checkpoint_is_base_plus_scaled_BA_and_loads_as_a_plain_model(dist, tiny_model, table, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = lora_section(**{"actor_train.model_args.lora_target_modules": ["q_proj", "down_proj"]})
    out = tmp_path / "c1"
    _, held = train_and_save(table, "t", str(tiny_model), cfg, str(out), dist, committed_as=str(out))
    merged, base = _weights(out), _weights(tiny_model)
    assert merged.keys() == base.keys()
    adapter = load_file(str(out / "lora/actor/adapter_model.safetensors"))
    scale = 16 / 4
    adapted = 0
    for name, w0 in base.items():
        layer = name.removesuffix(".weight")
        a_key = next((k for k in adapter if k.endswith(f"{layer}.lora_A.weight")), None)
        if a_key is None:
            assert torch.equal(merged[name], w0), f"{name} is not adapted and must not change"
            continue
        b = adapter[a_key.replace("lora_A", "lora_B")]
        expected = w0 + scale * b @ adapter[a_key]
        _close(merged[name], expected, name)
        assert not torch.equal(merged[name], w0), f"{name}: the step changed the adapter"
        adapted += 1
    assert adapted == 2 * 2  # two targets in each of the tiny model's two layers

    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rows = TokenRows.from_arrow(table, "t", columns=())
    got = forward_rows(plain, rows, 4096).columns["log_probs"]
    peft_model = held.actor.module.eval()
    want = forward_rows(peft_model, rows, 4096).columns["log_probs"]
    # log-probs are differences of logits and their log-sum-exp: tolerance from the log-sum-exp's magnitude
    scale = float(np.abs(want.values).max()) + np.log(plain.config.vocab_size)
    assert np.abs(got.values - want.values).max() <= 64 * np.finfo(np.float32).eps * scale
    assert json.loads((out / "train_state.json").read_text())["lora"]["actor"]["base"] == str(tiny_model)
    assert (out / "lora/actor/adapter_config.json").is_file()


def test_lora_resume_and_replay_equal_training_straight_on(dist, tiny_model, table, tmp_path):
    """Actor and critic with LoRA (gae): base → c1 (weights only) → c2 (state) → c3 through checkpoint folders
    equals three steps of the same engines in memory; the DeepSpeed state holds adapters (and the value head)
    only."""
    import pyarrow.parquet as pq

    samples = tmp_path / "advantaged"
    samples.mkdir()
    pq.write_table(table, samples / "part-0.parquet")
    where = str(samples)
    cfg = lora_section(**{"adv_estimator": "gae", "critic_train.model_args.lora_rank": 2,
                          "critic_train.model_args.lora_target_modules": "q_proj,v_proj",
                          "critic_train.training_args.per_device_train_batch_size": 4,
                          "critic_train.training_args.learning_rate": 1e-3})
    c1, c2, c3 = (str(tmp_path / n) for n in ("c1", "c2", "c3"))
    first, _ = train_and_save(table, where, str(tiny_model), cfg, c1, dist, full_state=False)
    second = run_training(table, where, c1, cfg, c2, dist)
    third = run_training(table, where, c2, cfg, c3, dist)
    assert second.metrics["train/replayed_steps"] == 1.0 and third.metrics["train/replayed_steps"] == 0.0

    from stages.train.lora import build_actor_model, build_critic_model, lora_bases

    info = read_checkpoint(str(tiny_model))
    bases = lora_bases(info, cfg)
    actor = Engine(build_actor_model(info, cfg.actor_train, bases["actor"]), cfg.actor_train, dist, "actor")
    critic = Engine(build_critic_model(info, cfg.critic_train, bases["critic"]), cfg.critic_train, dist, "critic")
    rows = rows_of_table(table, "t")
    straight = [train_step(rows, actor, critic, cfg, dist, step, 0) for step in (0, 1, 2)]
    for resumed, direct in zip((first, second, third), straight):
        for got, want in zip(resumed.per_step, direct.per_step, strict=True):
            for key in ("actor/pg_loss", "critic/loss", "actor/lr", "actor/grad_norm", "critic/grad_norm"):
                assert got[key] == want[key], key
    saved, live = _weights(tmp_path / "c3"), merged_state_dict(actor.module)
    for name in saved:
        assert torch.equal(saved[name], live[name]), name
    critic_saved, critic_live = _weights(tmp_path / "c3" / "critic"), merged_state_dict(critic.module)
    for name in critic_saved:
        assert torch.equal(critic_saved[name], critic_live[name]), name
    base = _weights(tiny_model)
    assert not torch.equal(saved["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(saved["model.embed_tokens.weight"], base["model.embed_tokens.weight"])

    for role, trained in (("actor", ".lora_"), ("critic", (".lora_", ".modules_to_save."))):
        state = torch.load(tmp_path / "c3" / "deepspeed" / role / "state" / "mp_rank_00_model_states.pt",
                           weights_only=False, map_location="cpu")
        assert state["module"] and all(any(t in k for t in np.atleast_1d(trained)) for k in state["module"]), role
    assert read_checkpoint(c3).lora["critic"]["options"]["lora_target_modules"] == ["q_proj", "v_proj"]


def test_lora_options_and_checkpoints_are_checked(dist, tiny_model, table, tmp_path):
    for bad, words in [({"lora_rank": 0}, ["lora_rank (0) must be > 0"]),
                       ({"lora_rank": 4, "lora_alpha": 0}, ["lora_alpha (0.0) must be > 0"]),
                       ({"lora_rank": 4, "lora_target_modules": []}, ["lora_target_modules ([])", "q_proj"]),
                       ({"lora_alpha": 8}, ["lora_rank is not", "set lora_rank"]),
                       ({"lora_rank": 4, "lora_dropout": 0.1}, ["unknown option"])]:
        with pytest.raises(ConfigError) as err:
            validate_config(TrainStepConfig, {"critic_train": {"model_args": bad}})
        assert "critic_train.model_args" in str(err.value)
        for word in words:
            assert word in str(err.value)
    with pytest.raises(ConfigError, match="lora_target_modules.*no layer"):
        wrap(load_actor_model(str(tiny_model)), lora_section(**{
            "actor_train.model_args.lora_target_modules": ["nope_proj"]}).actor_train.model_args, "actor", 0)

    out = tmp_path / "c1"
    run_training(table, "t", str(tiny_model), lora_section(), str(out), dist)
    with pytest.raises(ConfigError, match="trained with .*lora_rank.*full training"):  # LoRA checkpoint, LoRA off
        run_training(table, "t", str(out), section(), str(tmp_path / "x"), dist)
    with pytest.raises(ConfigError, match="lora_rank"):  # another rank
        run_training(table, "t", str(out), lora_section(**{"actor_train.model_args.lora_rank": 8}),
                     str(tmp_path / "y"), dist)
    moved = tmp_path / "base"
    shutil.copytree(tiny_model, moved)
    run_training(table, "t", str(moved), lora_section(), str(tmp_path / "m1"), dist)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(moved / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight"] += 0.01
    save_file(weights, str(moved / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RollflowError, match="base model folder .* changed"):
        run_training(table, "t", str(tmp_path / "m1"), lora_section(), str(tmp_path / "m2"), dist)


def test_lora_off_dumps_as_before_so_fingerprints_stay():
    """A section without LoRA dumps exactly the fields it had before the options existed (its fingerprint and a
    run's config.json are unchanged); with LoRA the options enter the dump and round-trip."""
    off = validate_config(TrainStepConfig, {})
    assert off.actor_train.model_args.model_dump(mode="json") == {"dtype": "fp32",
                                                                  "disable_gradient_checkpointing": True}
    on = validate_config(TrainStepConfig, {"actor_train": {"model_args": {"lora_rank": 8, "lora_target": "q_proj"}}})
    dumped = on.model_dump(mode="json")["actor_train"]["model_args"]
    assert dumped["lora_rank"] == 8 and dumped["lora_target_modules"] == ["q_proj"]
    assert on.actor_train.model_args.lora_scale == 2.0  # ROLL's default alpha: 2 x rank
    assert validate_config(TrainStepConfig, on.model_dump(mode="json")) == on
    assert validate_config(TrainStepConfig, off.model_dump(mode="json")) == off


# ---- log-probs of a LoRA checkpoint: one model for the policy and its reference ---------------------------------

@pytest.fixture(scope="module")
def lora_checkpoints(dist, tiny_model, table, tmp_path_factory):
    """Two LoRA steps from the tiny model: c1 (its base is the tiny model) and c2 (from c1, same base)."""
    folder = tmp_path_factory.mktemp("lora_logprobs")
    c1, c2 = str(folder / "c1"), str(folder / "c2")
    run_training(table, "t", str(tiny_model), lora_section(), c1, dist)
    run_training(table, "t", c1, lora_section(), c2, dist)
    return c1, c2


def _logprob_jobs(checkpoint: str, reference: str, dtype: str):
    from schemas.train_config import ForwardConfig, LogProbSection
    from stages.train.checkpoint import checkpoint_fingerprint
    from stages.train.stage import LogProbStage

    section = LogProbSection(checkpoint=checkpoint, reference=reference, compute_entropy=True, dtype=dtype,
                             max_tokens_per_microbatch_in_infer=64)
    fingerprints = {"checkpoint": checkpoint_fingerprint(checkpoint), "reference": checkpoint_fingerprint(reference)}
    same = fingerprints["reference"] == fingerprints["checkpoint"]  # as run_logprobs decides
    return LogProbStage(ForwardConfig(), same_reference=same, fingerprints=fingerprints).jobs(section)


def _two_model_jobs(checkpoint: str, reference: str):
    """The log-prob stage's jobs before one model served a LoRA checkpoint: the merged checkpoint, the reference."""
    from stages.train.stage import ForwardJob

    return [ForwardJob("log_probs", checkpoint, "old_log_probs", entropy=True),
            ForwardJob("log_probs", reference, "ref_log_probs")]


def _run_jobs(jobs, dtype: str, table, output, monkeypatch) -> tuple:
    """The log-prob table of ``jobs`` as a worker computes it (each job's model loaded for the request, one
    :func:`stages.train.forward.forward_batch`), the models the loader loaded (counted there) and the jobs' models."""
    import stages.train.models as models
    from stages.storage import Location
    from stages.train.forward import forward_batch, load_forward_model
    from stages.train.stage import LOGPROBS

    loaded = []
    real = models.load_actor_model

    def counting(path, *args, **kwargs):
        model = real(path, *args, **kwargs)
        loaded.append(model)
        return model
    monkeypatch.setattr(models, "load_actor_model", counting)
    used = [load_forward_model(j.path, j.kind, dtype, actor_dir=j.actor_dir, seed=j.seed, adapter=j.adapter)
            for j in jobs]
    out = forward_batch(used, jobs, table, 64, Location.of(str(output)), LOGPROBS, "t")
    monkeypatch.setattr(models, "load_actor_model", real)
    return out, loaded, used


def _values(table, column: str) -> np.ndarray:
    return np.concatenate([np.asarray(r, np.float32) for r in table.column(column).to_pylist()])


def test_lora_logprobs_run_one_model_and_equal_the_two_model_path(lora_checkpoints, tiny_model, table, tmp_path,
                                                                  monkeypatch):
    """A LoRA checkpoint whose reference is its base: one model is loaded (the base plus the adapter) for
    ``old_log_probs`` and ``ref_log_probs`` (adapter off), and the table equals the one of the two-model path (the
    merged checkpoint and the reference loaded apart): the reference bit for bit (the adapter off is the base),
    the policy within rounding — float32: a few ulps of the log-sum-exp's magnitude; bf16: the two paths' own bf16
    rounding (each path's distance to its float32 result; ``W x + s B A x`` and ``(W + s B A) x`` round
    differently)."""
    c1, _ = lora_checkpoints
    base = str(tiny_model)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    tables = {}
    for dtype in ("fp32", "bf16"):
        jobs = _logprob_jobs(c1, base, dtype)
        assert len(jobs) == 1 and jobs[0].adapter and jobs[0].base_column == "ref_log_probs"
        one, loaded, models = _run_jobs(jobs, dtype, table, tmp_path / f"one-{dtype}", monkeypatch)
        assert len(loaded) == 1 and len(models) == 1  # the base, once: no second model for the reference
        assert models[0].get_base_model() is loaded[0]
        two, loaded_two, _ = _run_jobs(_two_model_jobs(c1, base), dtype, table, tmp_path / f"two-{dtype}",
                                       monkeypatch)
        assert len(loaded_two) == 2  # what the one-model path saves
        assert one.column_names == two.column_names
        for name in one.column_names:
            if name not in ("old_log_probs", "ref_log_probs", "entropy"):
                assert one.column(name).equals(two.column(name)), name
        assert one.column("ref_log_probs").equals(two.column("ref_log_probs")), dtype
        tables[dtype] = one, two

    (one32, two32), (one16, two16) = tables["fp32"], tables["bf16"]
    for name in ("old_log_probs", "entropy"):
        scale = float(np.abs(_values(two32, name)).max()) + np.log(vocab)
        tol32 = 64 * np.finfo(np.float32).eps * scale
        diff32 = np.abs(_values(one32, name) - _values(two32, name)).max()
        assert diff32 <= tol32, (name, diff32, tol32)
        # each bf16 path is within its own rounding of its float32 result, so (triangle inequality) the two bf16
        # paths are within the sum of those roundings and the float32 tolerance of each other
        rounding = [np.abs(_values(a, name) - _values(b, name)).max() for a, b in ((one16, one32), (two16, two32))]
        diff16 = np.abs(_values(one16, name) - _values(two16, name)).max()
        assert diff16 <= sum(rounding) + tol32, (name, diff16, rounding)
        assert diff16 <= 4 * float(torch.finfo(torch.bfloat16).eps) * scale  # and that is bf16 rounding
    effect = np.abs(_values(one32, "old_log_probs") - _values(one32, "ref_log_probs")).max()
    assert effect > 1000 * tol32  # the adapter moved the policy: the comparison above is not vacuous


def test_lora_logprobs_load_the_reference_apart_when_it_is_not_the_adapters_base(lora_checkpoints, tiny_model, table,
                                                                                   dist, tmp_path):
    """Another reference model, or the base folder changed since training (its fingerprint differs from the one
    the checkpoint recorded, and base + adapter no longer give the merged weights): the reference is a second
    model, as in full training. A base folder only touched (new fingerprint, same weights) still serves both."""
    import os

    from safetensors.torch import load_file, save_file

    from stages.train.checkpoint import read_checkpoint
    from stages.train.adapter_base import why_not_adapter_base

    c1, _ = lora_checkpoints
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    jobs = _logprob_jobs(c1, str(other), "fp32")
    assert [(j.path, j.column, j.adapter) for j in jobs] == [(c1, "old_log_probs", None),
                                                             (str(other), "ref_log_probs", None)]
    assert "is not the base" in why_not_adapter_base(read_checkpoint(c1), str(other))
    assert len(_logprob_jobs(str(tiny_model), str(tiny_model), "fp32")) == 1  # not LoRA: one pass, as before

    base, checkpoint = tmp_path / "base", str(tmp_path / "c")
    shutil.copytree(tiny_model, base)
    run_training(table, "t", str(base), lora_section(), checkpoint, dist)
    assert len(_logprob_jobs(checkpoint, str(base), "fp32")) == 1  # the recorded fingerprint
    weights_file = base / "model.safetensors"
    os.utime(weights_file, ns=(weights_file.stat().st_atime_ns, weights_file.stat().st_mtime_ns + 10**9))
    assert len(_logprob_jobs(checkpoint, str(base), "fp32")) == 1  # touched: the weights are compared
    weights = load_file(str(weights_file))
    weights["model.layers.1.mlp.down_proj.weight"] += 0.01
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    assert len(_logprob_jobs(checkpoint, str(base), "fp32")) == 2
    assert "changed since training" in why_not_adapter_base(read_checkpoint(checkpoint), str(base))


def test_kept_forward_worker_takes_the_next_adapter_in_place(lora_checkpoints, tiny_model, table):
    """A training flow's kept forward worker holds the LoRA model: the next checkpoint's adapter is copied into it
    (no model load), and its log-probs equal a fresh load's bit for bit."""
    from stages.train.forward import ForwardModels, load_forward_model

    c1, c2 = lora_checkpoints
    rows = TokenRows.from_arrow(table, "t", columns=())
    models = ForwardModels()
    for checkpoint in (c1, c2):
        job = _logprob_jobs(checkpoint, str(tiny_model), "fp32")[0]
        kept = models.get(job.column, job.path, job.kind, "fp32", fingerprint=job.fingerprint, adapter=job.adapter,
                          base_fingerprint=job.base_fingerprint)
    assert models.loads == {"fresh": 1, "in_place": 1, "kept": 0}
    fresh = load_forward_model(job.path, "log_probs", "fp32", adapter=job.adapter)
    got, want = forward_rows(kept, rows, 64).columns["log_probs"], forward_rows(fresh, rows, 64).columns["log_probs"]
    assert np.array_equal(got.values, want.values)
    with kept.disable_adapter(), fresh.disable_adapter():
        assert np.array_equal(forward_rows(kept, rows, 64).columns["log_probs"].values,
                              forward_rows(load_actor_model(str(tiny_model)).eval(), rows, 64).columns[
                                  "log_probs"].values)
