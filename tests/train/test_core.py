"""The training core on a real DeepSpeed engine (world of one, CPU, the tiny random model; no Ray).

The engine's step is checked against a bare torch loop (AdamW, clipping, LR schedule) on the same mini-batches,
so micro-batching, gradient accumulation and the global normalisers are tested by what they must equal."""

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from schemas.config import validate_config
from schemas.errors import ConfigError, RollflowError, SchemaError
from schemas.tables import FLOATS
from schemas.train_config import TrainSection, TrainStepConfig
from stages.train.batching import TokenRows, batching_policy, pad_micro_batch, plan_step
from stages.train.checkpoint import check_complete, check_trainable, copy_tokenizer, read_checkpoint
from stages.train.core import run_training, train_and_save
from stages.train.distributed import compile_on_first_call, no_shm_comm_op
from stages.train.engine import Engine
from stages.train.engine_config import lr_lambda
from stages.train.forward import forward_rows
from stages.train.models import load_actor_model, load_critic_model
from stages.train import packed_attention
from stages.train.objectives import ActorObjective
from stages.train.resume import load_engines
from stages.train.step import train_step
from stages.train.train_table import rows_of_table
from tests.train.tables import advantaged_rows


def section(**kw) -> TrainSection:
    base = {"adv_estimator": "grpo", "compute_entropy_metric": False,
            "actor_train": {"training_args": {"learning_rate": 1e-3, "per_device_train_batch_size": 8},
                            "max_tokens_per_microbatch_in_train": 96}}
    for key, value in kw.items():
        node = base
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return validate_config(TrainStepConfig, base)


def with_model_log_probs(table: pa.Table, model_dir) -> pa.Table:
    """``old_log_probs`` = the model's own log-probs (ratio 1 at the first step), as the log-prob stage writes."""
    model = load_actor_model(str(model_dir), None).eval()
    rows = TokenRows.from_arrow(table, "t", columns=())
    lp = forward_rows(model, rows, 4096).columns["log_probs"]
    cols = [c for c in table.column_names if c != "old_log_probs"]
    return table.select(cols).append_column(pa.field("old_log_probs", FLOATS), lp.to_arrow(pa.float32()))


@pytest.fixture(scope="module")
def table(tiny_model):
    return with_model_log_probs(advantaged_rows(8, lengths=(10, 30), seed=1, multi_turn=True), tiny_model)


def bare_torch_loop(model_dir, rows: TokenRows, cfg: TrainSection, step: int = 0):
    """The reference: plain HF model + torch AdamW + clip_grad_norm_ + LambdaLR, each mini-batch as ONE padded
    batch. Returns (per-step (loss, grad norm, lr), the model)."""
    model = load_actor_model(str(model_dir), None)
    t = cfg.actor_train.training_args
    opt = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                            eps=t.adam_epsilon, weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t.lr_scheduler_type, t.warmup_steps, t.max_steps))
    objective = ActorObjective.from_section(cfg)
    plans = plan_step(rows.lengths, rows.loss_tokens(), policy=batching_policy(cfg.actor_train), world_size=1,
                      rank=0, ppo_epochs=cfg.ppo_epochs, seed=t.seed, step=step)
    out = []
    for plan in plans:
        index = np.concatenate(plan.micro_batches)
        mb = pad_micro_batch(rows, index)
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
        loss, _ = objective(logits, mb, index, plan)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm or float("inf"))
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        out.append((float(loss.detach()), float(norm), lr))
    return out, model


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, atol=1e-5):
    """Equal up to float noise: Adam moves near-zero gradients by up to lr x g / (|g| + eps)."""
    sa, sb = a.state_dict(), b.state_dict()
    for name, value in sa.items():
        torch.testing.assert_close(value.float(), sb[name].float(), atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_engine_step_equals_bare_torch_on_one_padded_batch(zero_stage, dist, tiny_model, table):
    """Micro-batches of <= 96 tokens with accumulation = one padded batch with plain AdamW and clipping."""
    cfg = section(**{"actor_train.strategy_args.zero_stage": zero_stage,
                     "actor_train.training_args.max_grad_norm": 0.5})
    rows = rows_of_table(table, "t")
    engine = Engine(load_actor_model(str(tiny_model), None), cfg.actor_train, dist, "actor")
    report = train_step(rows, engine, None, cfg, dist, step=0, pad_token_id=0)
    reference, model = bare_torch_loop(tiny_model, rows, cfg)
    (loss, norm, lr), = reference
    assert len(report.per_step) == 1 and report.padded_tokens < 8 * rows.lengths.max()  # several micro-batches
    assert norm > 0.5  # clipping was active
    assert report.per_step[0]["actor/pg_loss"] == pytest.approx(loss, abs=1e-6)
    assert report.per_step[0]["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert report.per_step[0]["actor/lr"] == pytest.approx(lr)
    assert_same_weights(engine.module, model)
    probed = vars(sys.modules["deepspeed.ops"])["__compatible_ops__"]
    assert "async_io" not in probed, "DeepSpeed probed its ops (a gcc test build per process): see no_shm_comm_op"


def test_the_shm_comm_op_is_turned_off_without_probing_every_op():
    """DeepSpeed computes ``ops.__compatible_ops__`` on first read by probing every op (gcc against libaio):
    setting the shared-memory entry must not read it; an already probed dict keeps its other entries."""
    def probe(name):
        raise AssertionError(f"probed: {name}")

    fresh = types.ModuleType("ops")
    fresh.__getattr__ = probe
    no_shm_comm_op(fresh)
    assert vars(fresh)["__compatible_ops__"] == {"deepspeed_shm_comm": False}
    probed = types.ModuleType("ops")
    probed.__compatible_ops__ = {"deepspeed_shm_comm": True, "cpu_adam": True}
    no_shm_comm_op(probed)
    assert probed.__compatible_ops__ == {"deepspeed_shm_comm": False, "cpu_adam": True}


DEEPSPEED_WITHOUT_MLFLOW = """
import importlib.util, sys
from stages.train.distributed import import_deepspeed
import_deepspeed()
assert "deepspeed.autotuning.autotuner" in sys.modules, "DeepSpeed no longer imports its autotuner: update the test"
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "mlflow")
assert not loaded, f"importing DeepSpeed loaded {loaded[:5]}: see stages.train.distributed.import_deepspeed"
assert not sys.modules["deepspeed.autotuning.autotuner"].has_mlflow, "DeepSpeed's autotuner imported mlflow"
assert "deepspeed.runtime.zero.muon.original_muon" in sys.modules  # imported by ZeRO's optimizer check
assert "torch._inductor.compile_fx" not in sys.modules, "Muon's kernels were compiled at import: see import_muon"
assert sys.modules["deepspeed.runtime.compiler"].compile() is __import__("torch").compile
assert importlib.util.find_spec("mlflow") is not None  # the tracker's check (stages.trackers._require)
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
import torch
from stages.train.lora import is_lora
assert not is_lora(torch.nn.Linear(2, 2)) and "peft" not in sys.modules, "is_lora imported peft for a plain model"
print("mlflow", sys.modules["mlflow"].__version__)
"""


def test_deepspeed_is_imported_without_mlflow_and_mlflow_still_imports_after():
    """In a fresh process (this one may hold either already): our one import of DeepSpeed loads no MLflow (its
    autotuner's ``try: import mlflow``, 1.1-1.6 CPU-s per training process), and leaves nothing behind that stops
    the MLflow tracker's imports later in the same process; its Muon module is loaded without torch's inductor
    (1.1 CPU-s) and DeepSpeed's ``compiler.compile`` is torch's again after; a model without LoRA is told apart
    without importing peft (the LoRA tests check a peft model)."""
    done = subprocess.run([sys.executable, "-c", DEEPSPEED_WITHOUT_MLFLOW], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("mlflow "), done.stdout


def test_compile_on_first_call_compiles_once_at_the_first_call(monkeypatch):
    """Muon's kernels (stages.train.distributed.import_muon): torch.compile of the function itself, made at the first
    call and reused; the result is the compiled function's."""
    made = []

    def fake_compile(fn):
        made.append(fn)
        return lambda x: ("compiled", fn(x))

    def double(x):
        return 2 * x

    monkeypatch.setattr(torch, "compile", fake_compile)
    lazy = compile_on_first_call(double)
    assert not made and lazy.__wrapped__ is double and lazy.__name__ == "double"
    assert lazy(3) == ("compiled", 6) and lazy(4) == ("compiled", 8)
    assert made == [double]


@pytest.mark.parametrize("attn_implementation", ["auto", "fa2"])
def test_a_packed_step_equals_bare_torch_on_one_padded_batch(dist, tiny_model, table, attn_implementation):
    """use_sequence_packing: each micro-batch (<= 96 real tokens, so other groupings than the padded path's) runs as
    one row without padding, forward and backward; the step still equals the bare loop's one padded batch, with
    Hugging Face's sdpa (auto on CPU: its block-diagonal mask) and with the packed attention (model_args.
    attn_implementation fa2: on CPU causal SDPA per packed row, whose function runs once per layer and micro-batch).
    (Adam's first update of a weight is lr·g/(|g| + eps): where |g| is near eps it turns float rounding of g into up
    to lr·rounding/eps, so eps is 1e-6 here and in the critic's test, not the default 1e-8.)"""
    cfg = section(**{"actor_train.use_sequence_packing": True, "actor_train.training_args.max_grad_norm": 0.5,
                     "actor_train.training_args.adam_epsilon": 1e-6,
                     "actor_train.model_args.attn_implementation": attn_implementation})
    rows = rows_of_table(table, "t")
    engine = Engine(load_actor_model(str(tiny_model), None), cfg.actor_train, dist, "actor")
    before = packed_attention.calls.copy()
    report = train_step(rows, engine, None, cfg, dist, step=0, pad_token_id=0)
    ran = packed_attention.calls - before
    layers = engine.module.config.num_hidden_layers
    if attn_implementation == "fa2":
        assert engine.module.config._attn_implementation == packed_attention.PACKED_ATTENTION
        assert ran["segments"] >= 2 * layers and set(ran) == {"segments"}  # every micro-batch, every layer
    else:
        assert engine.module.config._attn_implementation == "sdpa" and not ran
    steps, reference = bare_torch_loop(tiny_model, rows, cfg)
    (loss, norm, lr), = steps
    plans = plan_step(rows.lengths, rows.loss_tokens(), policy=batching_policy(cfg.actor_train), world_size=1,
                      rank=0, ppo_epochs=1, seed=cfg.actor_train.training_args.seed, step=0)
    assert all(rows.lengths[mb].sum() <= 96 for mb in plans[0].micro_batches) and len(plans[0].micro_batches) > 1
    assert report.padded_tokens == report.tokens == rows.lengths.sum()  # nothing padded
    assert report.per_step[0]["actor/pg_loss"] == pytest.approx(loss, abs=1e-6)
    assert report.per_step[0]["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert report.per_step[0]["actor/lr"] == pytest.approx(lr)
    assert_same_weights(engine.module, reference)


@pytest.mark.parametrize("packed", [False, True])
def test_a_fused_output_layer_step_equals_bare_torch(dist, tiny_model, table, packed):
    """fused_output_layer: true (log-probs and entropy straight from the output layer, tied to the embedding in the
    tiny model, its backward recomputing the logits) with an entropy loss: the step equals the bare loop's, whose
    objective gets the full logits: the same gradient norm and weights (the bare loop's loss includes the entropy
    term, the step's pg_loss metric does not). adam_epsilon 1e-6 as in the packed test above."""
    cfg = section(**{"actor_train.fused_output_layer": True, "actor_train.use_sequence_packing": packed,
                     "actor_train.training_args.max_grad_norm": 0.5, "actor_train.training_args.adam_epsilon": 1e-6,
                     "entropy_loss_coef": 0.01})
    rows = rows_of_table(table, "t")
    engine = Engine(load_actor_model(str(tiny_model), None), cfg.actor_train, dist, "actor")
    assert cfg.actor_train.fused_output_layer and engine.forward(pad_micro_batch(rows, np.arange(2))).hidden.dim() == 2
    report = train_step(rows, engine, None, cfg, dist, step=0, pad_token_id=0)
    (_, norm, _), = (steps := bare_torch_loop(tiny_model, rows, cfg))[0]
    assert report.per_step[0]["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert_same_weights(engine.module, steps[1])


def test_fused_output_layer_auto_is_off_on_cpu_and_left_out_of_the_dump():
    """auto: false on this CPU host, so the config dumps (and hashes) as before the option; true is dumped; with
    ZeRO-3, true is refused with the fix."""
    default = section()
    assert default.actor_train.fused_output_layer is False
    assert "fused_output_layer" not in json.dumps(default.model_dump(mode="json"))
    on = section(**{"actor_train.fused_output_layer": True})
    assert on.model_dump(mode="json")["actor_train"]["fused_output_layer"] is True
    with pytest.raises(ConfigError, match="fused_output_layer: false"):
        section(**{"actor_train.fused_output_layer": True, "actor_train.strategy_args.zero_stage": 3})


def test_a_packed_critic_step_equals_a_padded_one(dist, tiny_model, table):
    """The critic's value head through a packed row: the same losses and weights as the padded step."""
    def run(packed: bool):
        cfg = section(**{"adv_estimator": "gae", "ppo_epochs": 2, "critic_train.training_args.learning_rate": 1e-3,
                         "critic_train.use_sequence_packing": packed, "critic_train.training_args.adam_epsilon": 1e-6})
        critic = Engine(load_critic_model(None, str(tiny_model), seed=3), cfg.critic_train, dist, "critic")
        return train_step(rows_of_table(table, "t"), None, critic, cfg, dist, 0, 0), critic

    (packed, a), (padded, b) = run(True), run(False)
    assert packed.padded_tokens < padded.padded_tokens
    for got, want in zip(packed.per_step, padded.per_step, strict=True):
        assert got["critic/loss"] == pytest.approx(want["critic/loss"], rel=1e-5)
        assert got["critic/grad_norm"] == pytest.approx(want["critic/grad_norm"], rel=1e-4)
    assert_same_weights(a.module, b.module)


class _Ticker:
    """Records what the training step tells its progress bar (stages.progress.Ticker's interface)."""

    def __init__(self):
        self.announced, self.done = None, 0

    def total(self, n: int) -> None:
        self.announced = n

    def add(self, n: int = 1) -> None:
        self.done += n


def test_epochs_and_mini_batches_follow_the_plan_like_a_bare_loop(dist, tiny_model, table):
    cfg = section(**{"ppo_epochs": 2, "actor_train.training_args.per_device_train_batch_size": 3,
                     "actor_train.training_args.lr_scheduler_type": "cosine",
                     "actor_train.training_args.warmup_steps": 2, "actor_train.training_args.max_steps": 6})
    rows = rows_of_table(table, "t")
    engine = Engine(load_actor_model(str(tiny_model), None), cfg.actor_train, dist, "actor")
    ticker = _Ticker()
    report = train_step(rows, engine, None, cfg, dist, step=0, pad_token_id=0, progress=ticker)
    reference, model = bare_torch_loop(tiny_model, rows, cfg)
    assert len(report.per_step) == len(reference) == 6  # 2 epochs x ceil(8 / 3)
    plans = plan_step(rows.lengths, rows.loss_tokens(), policy=batching_policy(cfg.actor_train), world_size=1,
                      rank=0, ppo_epochs=2, seed=cfg.actor_train.training_args.seed, step=0)
    assert ticker.announced == ticker.done == sum(len(p.micro_batches) for p in plans)  # the bar counts micro-batches
    for got, (loss, norm, lr) in zip(report.per_step, reference):
        assert got["actor/pg_loss"] == pytest.approx(loss, abs=1e-5)
        assert got["actor/grad_norm"] == pytest.approx(norm, rel=1e-3)
        assert got["actor/lr"] == pytest.approx(lr)
    # Hugging Face's cosine with 2 warmup steps over 6 steps, by hand
    peak = 1e-3
    expected = [0.0, 0.5, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert [s["actor/lr"] for s in report.per_step] == pytest.approx([peak * e for e in expected])
    assert_same_weights(engine.module, model, atol=3e-5)


def test_loss_decreases_on_a_fixed_batch_and_parameters_change(dist, tiny_model, table):
    cfg = section(**{"ppo_epochs": 4, "actor_train.training_args.learning_rate": 3e-4})
    rows = rows_of_table(table, "t")
    model = load_actor_model(str(tiny_model), None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = Engine(model, cfg.actor_train, dist, "actor")
    report = train_step(rows, engine, None, cfg, dist, step=0, pad_token_id=0)
    losses = [s["actor/pg_loss"] for s in report.per_step]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert report.per_step[0]["actor/ratio_max"] == pytest.approx(1.0, abs=1e-5)  # old = the model's own
    changed = [k for k, v in engine.module.state_dict().items() if not torch.equal(v, before[k])]
    assert changed


def test_without_old_log_probs_the_first_epoch_has_ratio_one_and_later_epochs_use_the_cache(dist, tiny_model):
    cfg = section(**{"ppo_epochs": 2, "actor_train.training_args.per_device_train_batch_size": 4})
    rows = rows_of_table(advantaged_rows(8, seed=2), "t")
    assert "old_log_probs" not in rows.next_token
    engine = Engine(load_actor_model(str(tiny_model), None), cfg.actor_train, dist, "actor")
    steps = train_step(rows, engine, None, cfg, dist, step=0, pad_token_id=0).per_step
    for s in steps[:2]:  # epoch 1: old = detach(log_probs), ratio exactly 1 (spec §6.3 step 2)
        assert s["actor/ratio_max"] == 1.0 and s["actor/ratio_min"] == 1.0 and s["actor/clipfrac"] == 0.0
    assert any(s["actor/ratio_max"] != 1.0 for s in steps[2:])  # epoch 2: cached old vs updated policy


def test_train_infer_filter_masks_tokens_before_the_counts(dist, tiny_model, table):
    from stages.train.step import apply_train_infer_correction

    rng = np.random.default_rng(0)
    old = table.column("old_log_probs").to_pylist()
    infer = [[v + float(rng.normal(0, 0.3)) if v else 0.0 for v in row] for row in old]
    t = table.append_column(pa.field("infer_logprobs", FLOATS), pa.array(infer, FLOATS))
    cfg = section(train_infer_correction={"is_weight": {"enabled": True, "upper_bound": 2.0},
                                          "filters": [{"enabled": True, "ratio_low": 0.8, "ratio_high": 1.2}]})
    rows = rows_of_table(t, "t")
    corrected, metrics = apply_train_infer_correction(rows, cfg)
    assert corrected.loss_tokens().sum() < rows.loss_tokens().sum()
    assert metrics and all(np.isfinite(v) for v in metrics.values()), metrics
    w = corrected.next_token["train_infer_is_weight"]
    assert (w.lengths == rows.lengths - 1).all() and w.values.max() <= 2.0
    engine = Engine(load_actor_model(str(tiny_model), None), cfg.actor_train, dist, "actor")
    step = train_step(rows, engine, None, cfg, dist, 0, 0).metrics
    assert np.isfinite(step["actor/pg_loss"]) and metrics.items() <= step.items()  # the step reports the correction


def test_critic_head_is_seeded_and_the_critic_learns_the_returns(dist, tiny_model, table):
    a = load_critic_model(None, str(tiny_model), seed=3)
    b = load_critic_model(None, str(tiny_model), seed=3)
    assert torch.equal(a.score.weight, b.score.weight)
    assert not torch.equal(a.score.weight, load_critic_model(None, str(tiny_model), seed=4).score.weight)
    a.train()
    ids = torch.arange(12).unsqueeze(0)
    assert torch.equal(a(input_ids=ids).logits, a(input_ids=ids).logits)  # no dropout in the value head
    cfg = section(**{"adv_estimator": "gae", "ppo_epochs": 5, "critic_train.training_args.learning_rate": 1e-3,
                     "critic_train.training_args.per_device_train_batch_size": 8})
    rows = rows_of_table(table, "t")
    critic = Engine(a, cfg.critic_train, dist, "critic")
    steps = train_step(rows, None, critic, cfg, dist, 0, 0).per_step
    losses = [s["critic/loss"] for s in steps]
    assert losses[-1] < losses[0] and {"critic/grad_norm", "critic/lr", "critic/vpred"} <= set(steps[0])


def test_bf16_engine_trains(dist, tiny_model, table):
    cfg = section(**{"actor_train.model_args.dtype": "bf16"})
    engine = Engine(load_actor_model(str(tiny_model), None), cfg.actor_train, dist, "actor")
    report = train_step(rows_of_table(table, "t"), engine, None, cfg, dist, 0, 0)
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    assert np.isfinite(report.metrics["actor/pg_loss"]) and report.metrics["actor/grad_norm"] > 0


# ---- checkpoints: one chain of steps serves the resume, kept-engine and replay tests ---------------------------

CHAIN = {"adv_estimator": "gae", "ppo_epochs": 1, "actor_train.training_args.per_device_train_batch_size": 4,
         "actor_train.training_args.lr_scheduler_type": "linear", "actor_train.training_args.max_steps": 12,
         "actor_train.training_args.warmup_steps": 1, "critic_train.training_args.learning_rate": 1e-3,
         "critic_train.training_args.per_device_train_batch_size": 4}


@pytest.fixture(scope="module")
def chain(dist, tiny_model, table, tmp_path_factory) -> dict:
    """The checkpoints of one section (GAE: actor and critic; one epoch of 2 mini-batches, 2 optimizer steps a
    training step; a linear schedule over 12), each step taken once for the three tests below:

    - f1 -> f2 -> f3: each from the full DeepSpeed state of the one before, f1 from the tiny model, its engines kept
      (``held``) as a training worker keeps them;
    - with ``held`` offered, in this order: w1 from the tiny model (another input checkpoint: not kept), s2 from f1
      under another learning rate (another section: not kept), k2 from f1 under the same section (kept: the held
      engines' second step);
    - w1 -> w2: weights and a replay record only.

    The samples are a Parquet folder (a replay record names and fingerprints it). Returns the section, the folder,
    the checkpoint paths and the step reports by name."""
    root = tmp_path_factory.mktemp("chain")
    (root / "advantaged").mkdir()
    pq.write_table(table, root / "advantaged" / "part-0.parquet")
    where = str(root / "advantaged")
    cfg = section(**CHAIN)
    other_rate = section(**{**CHAIN, "actor_train.training_args.learning_rate": 1e-4})
    path = {name: str(root / name) for name in ("f1", "f2", "f3", "w1", "w2", "s2", "k2")}
    report = {}
    report["f1"], held = train_and_save(table, where, str(tiny_model), cfg, path["f1"], dist, committed_as=path["f1"])
    report["w1"], _ = train_and_save(table, where, str(tiny_model), cfg, path["w1"], dist, held=held,
                                     full_state=False)
    report["s2"], _ = train_and_save(table, where, path["f1"], other_rate, path["s2"], dist, held=held,
                                     full_state=False)
    report["k2"], _ = train_and_save(table, where, path["f1"], cfg, path["k2"], dist, held=held, full_state=False)
    del held
    report["f2"] = run_training(table, where, path["f1"], cfg, path["f2"], dist)
    report["f3"] = run_training(table, where, path["f2"], cfg, path["f3"], dist)
    report["w2"], _ = train_and_save(table, where, path["w1"], cfg, path["w2"], dist, full_state=False)
    return {"cfg": cfg, "where": where, "path": path, "report": report}


def test_resume_from_checkpoint_reproduces_the_next_step(dist, tiny_model, table, chain):
    """tiny model → f1 → f2 through checkpoint folders (the chain's) equals two steps of one engine built here:
    same losses, LRs, weights."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cfg, path, report = chain["cfg"], chain["path"], chain["report"]
    rows = rows_of_table(table, "t")
    actor = Engine(load_actor_model(str(tiny_model), None), cfg.actor_train, dist, "actor")
    critic = Engine(load_critic_model(None, str(tiny_model), cfg.critic_train.training_args.seed), cfg.critic_train,
                    dist, "critic")
    straight = [train_step(rows, actor, critic, cfg, dist, step, 0) for step in (0, 1)]
    for resumed, direct in ((report["f1"], straight[0]), (report["f2"], straight[1])):
        assert len(resumed.per_step) == len(direct.per_step) == 2
        for got, want in zip(resumed.per_step, direct.per_step):
            for key in ("actor/pg_loss", "critic/loss", "actor/lr", "critic/lr", "actor/grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(AutoModelForCausalLM.from_pretrained(path["f2"]), actor.module, atol=1e-6)
    assert_same_weights(AutoModelForTokenClassification.from_pretrained(Path(path["f2"]) / "critic"), critic.module,
                        atol=1e-6)
    info = read_checkpoint(path["f2"])
    assert info.global_step == 2 and info.optimizer_steps == 4 and info.critic_state and info.actor_state
    state = json.loads((Path(path["f2"]) / "train_state.json").read_text())
    assert state["world_size"] == 1 and len(state["per_step"]) == 2


def test_engines_kept_across_steps_equal_engines_loaded_from_the_checkpoint(chain):
    """A kept worker's second step (engines still in memory: the chain's k2) equals a step on engines loaded from
    the first step's checkpoint (f2) — DeepSpeed's saved state is the whole state; kept engines are used only for
    the checkpoint they wrote, under the same section (w1 and s2 were offered them first)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    path, report = chain["path"], chain["report"]
    assert (report["f1"].metrics["train/engines_kept"], report["k2"].metrics["train/engines_kept"],
            report["f2"].metrics["train/engines_kept"]) == (0.0, 1.0, 0.0)
    for got, want in zip(report["k2"].per_step, report["f2"].per_step, strict=True):
        for key in ("actor/pg_loss", "critic/loss", "actor/lr", "actor/grad_norm", "critic/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(AutoModelForCausalLM.from_pretrained(path["k2"]),
                        AutoModelForCausalLM.from_pretrained(path["f2"]), atol=1e-6)
    assert_same_weights(AutoModelForTokenClassification.from_pretrained(Path(path["k2"]) / "critic"),
                        AutoModelForTokenClassification.from_pretrained(Path(path["f2"]) / "critic"), atol=1e-6)
    # not reused for another input checkpoint (w1), nor under another section (s2): both were offered the engines
    # while they still held f1
    assert report["w1"].metrics["train/engines_kept"] == report["s2"].metrics["train/engines_kept"] == 0.0


def test_a_resume_under_another_learning_rate_trains_at_that_rate(chain):
    """A step from a full state (f1) under another learning rate (the chain's s2, 1e-4 where f1 used 1e-3) trains at
    the configured rate x the schedule's factor at the saved optimizer step, not at the saved run's rate: its actor
    LRs are 1e-4 x factor(2), x factor(3), and its actor moved otherwise than the same-rate step's (k2); the critic,
    whose rate did not change, equals k2's."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cfg, path, report = chain["cfg"], chain["path"], chain["report"]
    t = cfg.actor_train.training_args
    factor = lr_lambda(t.lr_scheduler_type, t.warmup_steps, t.max_steps)
    assert [s["actor/lr"] for s in report["s2"].per_step] == pytest.approx([1e-4 * factor(2), 1e-4 * factor(3)],
                                                                           rel=1e-6)
    assert [s["actor/lr"] for s in report["k2"].per_step] == pytest.approx([1e-3 * factor(2), 1e-3 * factor(3)],
                                                                           rel=1e-6)
    other, same = (AutoModelForCausalLM.from_pretrained(path[name]) for name in ("s2", "k2"))
    with torch.no_grad():
        assert max(float((a - b).abs().max()) for a, b in zip(other.parameters(), same.parameters())) > 1e-5
    assert_same_weights(AutoModelForTokenClassification.from_pretrained(Path(path["s2"]) / "critic"),
                        AutoModelForTokenClassification.from_pretrained(Path(path["k2"]) / "critic"), atol=1e-6)


def test_a_weights_only_checkpoint_is_rebuilt_by_replay_and_trains_like_a_full_one(dist, tiny_model, table, chain,
                                                                                    tmp_path):
    """Steps that write weights and a replay record only (the chain's w1 -> w2): training from such a checkpoint
    replays its steps from the newest state and then equals training from a checkpoint that holds its state (f2 ->
    f3: losses, LR, weights of actor and critic); the replayed weights equal the saved ones; a changed table is
    refused."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cfg, where, path, report = chain["cfg"], chain["where"], chain["path"], chain["report"]
    w2 = read_checkpoint(path["w2"])
    assert w2.actor_state is None and w2.critic_state is None and not (Path(path["w2"]) / "deepspeed").exists()
    assert w2.replay["from"] == str(tiny_model) and [s["samples"] for s in w2.replay["steps"]] == [where, where]
    check_complete(path["w2"], with_critic=True)
    check_trainable(w2)
    second = report["w2"]
    assert second.metrics["train/replayed_steps"] == 1.0 and second.metrics["train/full_state_saved"] == 0.0
    assert_same_weights(AutoModelForCausalLM.from_pretrained(path["w2"]),
                        AutoModelForCausalLM.from_pretrained(path["f2"]), atol=1e-6)

    r3 = str(tmp_path / "r3")
    replayed = run_training(table, where, path["w2"], cfg, r3, dist)
    assert replayed.metrics["train/replayed_steps"] == 2.0 and replayed.metrics["train/engines_kept"] == 0.0
    for got, want in zip(replayed.per_step, report["f3"].per_step, strict=True):
        for key in ("actor/pg_loss", "critic/loss", "actor/lr", "actor/grad_norm", "critic/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(AutoModelForCausalLM.from_pretrained(r3), AutoModelForCausalLM.from_pretrained(path["f3"]),
                        atol=1e-6)
    assert_same_weights(AutoModelForTokenClassification.from_pretrained(tmp_path / "r3" / "critic"),
                        AutoModelForTokenClassification.from_pretrained(Path(path["f3"]) / "critic"), atol=1e-6)
    assert read_checkpoint(r3).optimizer_steps == read_checkpoint(path["f3"]).optimizer_steps

    # a replay under ZeRO-3 cannot hand the replayed ZeRO-2 state over (refused after the replay, before loading)
    zero3 = {**cfg.model_dump(mode="json")}
    zero3["actor_train"]["strategy_args"]["zero_stage"] = 3
    with pytest.raises(ConfigError, match="ZeRO stage 2, and strategy_args.zero_stage is 3"):
        load_engines(read_checkpoint(path["w1"]), TrainStepConfig.model_validate(zero3), dist)

    # the table the replay needs changed (last: no test reads the chain's folder after this one's checks)
    pq.write_table(table.slice(0, 4), Path(where) / "part-0.parquet")
    with pytest.raises(RollflowError, match="changed since"):
        run_training(table, where, path["w2"], cfg, str(tmp_path / "x"), dist)


def test_checkpoint_is_an_hf_folder_with_tokenizer(dist, tiny_model, table, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = section()
    run_training(table, "t", str(tiny_model), cfg, str(tmp_path / "c"), dist)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    assert model.config.use_cache is not False  # training settings do not leak into the generation model
    tok = AutoTokenizer.from_pretrained(tmp_path / "c")
    assert tok.chat_template and tok.eos_token == AutoTokenizer.from_pretrained(tiny_model).eos_token
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the model's files, copied
        assert (tmp_path / "c" / name).read_bytes() == (tiny_model / name).read_bytes(), name
    assert not (tmp_path / "c" / "critic").exists()  # grpo: no critic


def test_bad_checkpoints_and_configs_are_rejected(tmp_path):
    with pytest.raises(SchemaError, match="not a Hugging Face model folder"):
        read_checkpoint(str(tmp_path))
    with pytest.raises(SchemaError, match=f"model folder {tmp_path} has no tokenizer"):
        copy_tokenizer(str(tmp_path), str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="max_steps"):
        validate_config(TrainStepConfig, {"actor_train": {"training_args": {"lr_scheduler_type": "cosine"}}})
    with pytest.raises(ConfigError, match="constant_with_warmup"):
        validate_config(TrainStepConfig, {"actor_train": {"training_args": {"warmup_steps": 3}}})
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        validate_config(TrainStepConfig, {"actor_train": {"model_args": {"dtype": "fp16"}}})
    with pytest.raises(ConfigError, match="unknown option"):
        validate_config(TrainStepConfig, {"actor_train": {"training_args": {"lr": 1.0}}})
    with pytest.raises(ConfigError, match="dual_clip_c"):
        validate_config(TrainStepConfig, {"dual_clip_c": 0.5})
    with pytest.raises(ConfigError, match="agg_type"):
        validate_config(TrainStepConfig, {"train_infer_correction": {"filters": [{"agg_type": "bogus"}]}})
    assert validate_config(TrainStepConfig, {"adv_estimator": "gae"}).needs_critic
    assert not validate_config(TrainStepConfig, {"adv_estimator": "grpo"}).needs_critic


@pytest.mark.parametrize(("saved", "wanted"), [(2, 3), (3, 2)])
def test_a_zero3_state_and_a_zero_0_2_state_are_not_read_as_each_other(saved, wanted, tiny_model, tmp_path):
    """Refused before any engine is built, with the stage to resume with."""
    import shutil

    from stages.train.resume import check_zero_stage

    folder = Path(shutil.copytree(tiny_model, tmp_path / "ckpt"))
    (folder / "deepspeed/actor/state").mkdir(parents=True)
    (folder / "train_state.json").write_text(json.dumps({"global_step": 1, "world_size": 2, "zero_stage": saved}))
    with pytest.raises(ConfigError, match=f"ZeRO stage {saved}, and strategy_args.zero_stage is {wanted}.*Resume "
                                          f"with zero_stage: {saved}"):
        check_zero_stage(read_checkpoint(str(folder)), wanted)
    check_zero_stage(read_checkpoint(str(folder)), saved)  # the same stage loads
