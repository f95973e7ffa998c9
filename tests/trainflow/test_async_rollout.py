"""Asynchronous generation (ROLL's ``async_generation_ratio``, issue 46): the option's load-time rules, its fixed
schedule, and a real tiny run with r = 1 (Prefect, a two-node Ray cluster, HF engine, DeepSpeed) whose rollouts are
played one iteration behind the policy trained, with the train/infer importance weight on by default; the same run on
S3 (a moto server), SIGKILLed at several points of the overlap, resumes to it: the one chain of kills of a training
run, for the overlap and for the object store. The two-node run is also the suite's check of stages pinned to nodes
(runtime.stage_resources) in a training run and, on its cluster, in ``rollflow recompute``."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
from click.testing import Result

from flows.loop import async_lag, played_with
from schemas.config import validate_config
from schemas.errors import ConfigError
from schemas.train_flow_config import TrainFlowConfig
from stages.example import ExampleSpec, generate
from tests.objstore import s3  # noqa: F401  (the module's S3 server, a fixture)
from tests.processes import ray_jobs, rollflow_here, sigkill_when, wait_ray_jobs_gone
from tests.ray_nodes import (HEAD_RESOURCE, TASK_EVENTS_FLUSH_S, NodeSpec, RayNodes, asks_for, names_of,
                             node_with, nodes_of, record_here)
from tests.spine.helpers import read_table
from tests.trainflow.test_train_flow import (STAGES, _assert_same_rows, _float32, _table, _tiny_args,
                                             _weights)

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/train_frozenlake_grpo.yaml"  # _tiny_args' config, relative to the checkout
ITERATIONS = 3


def test_async_option_turns_the_importance_weight_on_unless_the_user_set_a_correction():
    plain = validate_config(TrainFlowConfig, {})
    assert plain.async_generation_ratio == 0 and not plain.train.train_infer_correction.is_weight.enabled
    # r = 0 written out is the run of today: the same training section (the checkpoints' fingerprints hash it)
    assert validate_config(TrainFlowConfig, {"async_generation_ratio": 0}).train == plain.train
    on = validate_config(TrainFlowConfig, {"async_generation_ratio": 0.5}).train
    assert on.train_infer_correction.is_weight.enabled and on.train_infer_correction.is_weight.upper_bound == 1.2
    assert on.train_infer_correction.is_weight.weight_type == "token"
    assert on.model_dump(mode="json")["train_infer_correction"]["is_weight"]["enabled"] is True  # fingerprinted
    own = {"async_generation_ratio": 1, "train": {"train_infer_correction": {"is_weight": {"upper_bound": 2.0}}}}
    mine = validate_config(TrainFlowConfig, own).train.train_infer_correction.is_weight
    assert not mine.enabled and mine.upper_bound == 2.0  # the user's setting wins, whole
    with pytest.raises(ConfigError, match="async_generation_ratio"):
        validate_config(TrainFlowConfig, {"async_generation_ratio": -1})


def test_both_pipelines_take_the_option_and_the_h100_configs_are_refused_with_r_above_0():
    from schemas.config import load_config
    from schemas.rlvr_train_config import RLVRTrainConfig

    rlvr = load_config(RLVRTrainConfig, REPO / "configs/rlvr_train_add2.yaml", {"async_generation_ratio": 2})
    assert async_lag(rlvr) == 2 and rlvr.train.train_infer_correction.is_weight.enabled
    with pytest.raises(ConfigError, match="engines GPUs of their own"):  # colocated on GPU 0
        load_config(TrainFlowConfig, REPO / "configs/train_frozenlake_grpo_h100.yaml", {"async_generation_ratio": 1})
    colocated = {"engine.device_mapping": [0], "engine.num_gpus_per_engine": 1, "engine.sleep_level": 1,
                 "train.runtime.use_gpu": True, "train.runtime.num_workers": 1, "train.runtime.device_mapping": [0]}
    assert load_config(RLVRTrainConfig, REPO / "configs/rlvr_train_math.yaml", colocated).async_generation_ratio == 0
    with pytest.raises(ConfigError, match=r"engine\.device_mapping equals train\.runtime\.device_mapping"):
        load_config(RLVRTrainConfig, REPO / "configs/rlvr_train_math.yaml", {**colocated, "async_generation_ratio": 1})


def test_async_with_engines_colocated_with_training_is_refused_with_the_fix():
    colocated = {"rollout": {"engine": {"device_mapping": [0], "num_gpus_per_engine": 1, "sleep_level": 1}},
                 "train": {"runtime": {"use_gpu": True, "num_workers": 1, "device_mapping": [0]}}}
    validate_config(TrainFlowConfig, colocated)  # in turn: allowed
    with pytest.raises(ConfigError, match="give the engines GPUs of their own"):
        validate_config(TrainFlowConfig, {**colocated, "async_generation_ratio": 1})
    apart = {"rollout": {"engine": {"device_mapping": [1], "num_gpus_per_engine": 1}}, "train": colocated["train"],
             "async_generation_ratio": 1}
    assert validate_config(TrainFlowConfig, apart).async_generation_ratio == 1


def test_the_schedule_is_fixed_by_the_ratio():
    config = validate_config(TrainFlowConfig, {"async_generation_ratio": 1.5})
    assert async_lag(config) == 2 and async_lag(validate_config(TrainFlowConfig, {})) == 0
    assert [played_with(k, 1) for k in range(4)] == [0, 0, 1, 2]
    assert [played_with(k, 2) for k in range(4)] == [0, 0, 0, 1]
    assert [played_with(k, 0) for k in range(4)] == [0, 1, 2, 3]
    # the samples' staleness column: training steps between the scheduled policy and the trained one; none in turn
    assert [config.rollout_staleness(k) for k in range(4)] == [0, 1, 2, 2]
    assert validate_config(TrainFlowConfig, {}).rollout_staleness(3) is None


class _Metrics:
    """A stand-in for the metrics log: keeps what ``record`` logs, by (iteration, stage)."""

    def __init__(self):
        self.values: dict[tuple[int, str], dict] = {}

    def has(self, iteration: int, stage: str) -> bool:
        return (iteration, stage) in self.values

    def log(self, iteration: int, stage: str, metrics: dict, wall_s: float | None = None) -> None:
        self.values[(iteration, stage)] = dict(metrics)


def _toy_loop(lag: int, iterations: int, rollout_s: float, train_s: float):
    """The loop's overlap itself (flows/loop.py ``_iterate_ahead``) with two toy steps, a rollout and a training step
    that sleep, in a real Prefect flow: the events (what started or ended, in order) and the Run."""
    import threading
    import time
    from types import SimpleNamespace

    from prefect import flow

    from flows.loop import IterStep, Run, _iterate_ahead

    events: list[tuple] = []
    lock = threading.Lock()

    def note(*event) -> None:
        with lock:
            events.append(event)

    def rollout(r: Run):
        note("rollout start", r.iteration, r.checkpoint, r.here)
        time.sleep(rollout_s)
        note("rollout end", r.iteration)
        return SimpleNamespace(metrics={"rollout/success_rate": 0.5}, seconds=rollout_s, output=r.out("rollout"))

    def train(r: Run):
        note("train start", r.iteration, r.checkpoint)
        time.sleep(train_s)
        r.trained.append(f"ckpt{r.iteration}")
        note("train end", r.iteration)
        return SimpleNamespace(output=f"ckpt{r.iteration}")

    steps = [IterStep("rollout", rollout, generation=True), IterStep("train", train, trains=True)]
    decl = SimpleNamespace(spec=SimpleNamespace(step_dir=lambda run, k: f"{run}/iter_{k}"))
    r = Run(SimpleNamespace(max_steps=iterations), SimpleNamespace(uri=lambda: "/run"), "base", None,  # type: ignore
            None, _Metrics(), "base")

    @flow
    def toy() -> None:
        ahead = []
        for k in range(iterations):
            r.iteration, r.here, r.results = k, f"/run/iter_{k}", {}
            ahead = _iterate_ahead(decl, steps, r, ahead, lag)  # type: ignore[arg-type]
        assert ahead == []

    toy()
    return events, r


def test_the_loop_plays_the_next_rollout_during_training_with_the_scheduled_checkpoint(capsys):
    """r = 1: the rollout of iteration k + 1 starts before iteration k's training ends, with the checkpoint
    ``played_with`` names, and is recorded with its staleness at iteration k + 1; the flow's own Run is never changed
    by the rollout played ahead."""
    events, r = _toy_loop(1, 3, 0.5, 0.5)
    starts = [e[1:] for e in events if e[0] == "rollout start"]
    assert starts == [(0, "base", "/run/iter_0"), (1, "base", "/run/iter_1"), (2, "ckpt0", "/run/iter_2")]
    assert [e[1:] for e in events if e[0] == "train start"] == [(0, "base"), (1, "ckpt0"), (2, "ckpt1")]
    for k in (1, 2):  # started before the previous iteration's training ended
        assert events.index(("rollout start", *starts[k])) < events.index(("train end", k - 1)), events
    assert {k: m["rollout/staleness"] for (k, stage), m in r.metrics.values.items() if stage == "rollout"} == \
        {0: 0.0, 1: 1.0, 2: 1.0}
    assert r.metrics.values[(2, "rollout")]["rollout/overlap_seconds"] > 0
    # the console's line of each rollout says how far behind it played and how long beside training
    lines = [x for x in capsys.readouterr().out.splitlines() if x.split("]")[-1].split()[:1] == ["rollout"]]
    assert [x.split("(")[-1] for x in lines] == [
        "played with the policy 0 steps behind, 0s beside training)",
        f"played with the policy 1 step behind, {r.metrics.values[(1, 'rollout')]['rollout/overlap_seconds']:.0f}s "
        "beside training)",
        f"played with the policy 1 step behind, {r.metrics.values[(2, 'rollout')]['rollout/overlap_seconds']:.0f}s "
        "beside training)"], lines
    assert r.checkpoint == "ckpt2" and r.iteration == 2


def test_with_ceil_r_above_1_several_rollouts_are_in_flight_one_after_the_other_on_the_engines():
    """r = 2 and a training step slower than a rollout: while iteration 0 trains, the rollouts of iterations 1 and 2
    (both with the initial policy) play, one after the other (they share the engines and their loaded checkpoint);
    iteration j's rollout plays the policy after j - 2 steps, so the staleness is 0, 1, 2, 2."""
    events, r = _toy_loop(2, 4, 0.2, 1.5)
    starts = [e[1:3] for e in events if e[0] == "rollout start"]
    assert starts == [(0, "base"), (1, "base"), (2, "base"), (3, "ckpt0")], events
    for k in (1, 2):  # both before iteration 0's training ended
        assert events.index(("rollout start", k, "base", f"/run/iter_{k}")) < events.index(("train end", 0)), events
    rollouts = [e for e in events if e[0].startswith("rollout")]
    assert [e[0] for e in rollouts] == ["rollout start", "rollout end"] * 4, events  # never two at once
    assert {k: m["rollout/staleness"] for (k, stage), m in r.metrics.values.items() if stage == "rollout"} == \
        {0: 0.0, 1: 1.0, 2: 2.0, 3: 2.0}
    assert all(r.metrics.values[(k, "rollout")]["rollout/overlap_seconds"] > 0 for k in (1, 2, 3))
    assert r.checkpoint == "ckpt3" and r.trained == ["ckpt0", "ckpt1", "ckpt2", "ckpt3"]


def _benchmark():
    """benchmarks/async_rollout.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("async_rollout", REPO / "benchmarks/async_rollout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_predicts_the_disaggregated_speedup_from_the_stage_times_of_the_run_in_turn(tmp_path):
    """benchmarks/async_rollout.py: generation and later-stage seconds per iteration from a run's metrics table (the
    first iteration, the evaluation and any stage's non-time metrics left out), and (gen + rest) / max(gen, rest)."""
    from stages.metrics import MetricsLog

    with MetricsLog(tmp_path, tensorboard=False) as log:
        for it, (gen, later) in enumerate([(30.0, (9.0, 9.0)), (4.0, (1.0, 2.0)), (6.0, (2.0, 3.0))]):
            log.log(it, "rollout", {"rollout/success_rate": 0.5}, wall_s=gen)
            for stage, seconds in zip(("logprobs", "train"), later):
                log.log(it, stage, {"actor/pg_loss": 7.0}, wall_s=seconds)
            log.log(it, "eval", {"rollout/success_rate": 0.5}, wall_s=100.0)
    bench = _benchmark()
    assert bench.stage_times(tmp_path) == {"gen_s": 5.0, "rest_s": 4.0}
    assert bench.predicted_speedup(5.0, 4.0) == pytest.approx(9 / 5)
    assert bench.predicted_speedup(3.0, 3.0) == 2.0  # the most the overlap gives: both halves equally long


def _async_args(runs_dir: Path, name: str) -> list[str]:
    """The tiny run of tests/trainflow/test_train_flow.py, three iterations, generating one iteration ahead; evaluated
    before training and after iteration 1 (the evaluation waits for the rollout in flight). The actor's learning rate
    is high enough (0.05; the shipped 1e-5 moves the tiny model's log-probs by less than the float32 noise between
    the engine and the forward workers) that a policy one step behind samples with other log-probs."""
    return [*_tiny_args(runs_dir, name), "--set", f"max_steps={ITERATIONS}", "--set", "eval.eval_steps=2",
            "--set", "train.actor_train.training_args.learning_rate=0.05", "--set", "async_generation_ratio=1",
            "--set", "reward_normalization.grouping=batch"]  # identity reads no group (schemas/config.py refuses one)


# the two-node run's stages pinned to the two nodes of its cluster (runtime.stage_resources): the advantages' map
# tasks to the head, the training workers (which also compute the log-probs, issue 44) to the second node
PINS = "runtime.stage_resources={advantages: {rollflow_head: 1}, train_step: {rollflow_pinned: 1}}"
# the recompute on the same cluster: the reward stage's tasks to the head, the advantage stage's to the second node
RECOMPUTE_PINS = "runtime.stage_resources={response_rewards: {rollflow_head: 1}, advantages: {rollflow_pinned: 1}}"
RECOMPUTE_CONFIG = str(REPO / "configs/recompute_gigpo.yaml")


@dataclass(frozen=True)
class TwoNodeRun:
    """The finished run and what was read of its two-node cluster while the cluster was up."""

    run: Path  # the run folder
    run_record: dict  # Ray's record of the run's tasks and actors (tests/ray_nodes.py record_here)
    samples: Path  # the example samples the recompute read
    recomputed: Result  # `rollflow recompute --input SAMPLES ...` on the same cluster
    recompute_out: Path  # its output folder (rewarded/, advantaged/)
    recompute_record: dict  # Ray's record of the recompute's tasks


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, prefect_server, ray_cluster) -> TwoNodeRun:
    """The uninterrupted run, the reference of the kill chain, on a real two-node Ray cluster on this machine (issue
    14, item 3): the session's own cluster (tests/conftest.py ``ray_cluster``: 2 CPUs, the custom resource
    ``rollflow_head``) joined by a second node (tests/ray_nodes.py: a ``ray start --address`` of one CPU with the
    custom resource ``rollflow_pinned``); its advantages' tasks pinned to the head and its training workers to the
    second node (``PINS``), reporting to the session's Prefect server; then, on the same cluster, ``rollflow
    recompute`` of a small example set with each of its two stages pinned to one node; Ray's record of where the
    tasks of each ran. Ray may also place unpinned tasks on either node. Both commands run in this process, which is
    connected to the cluster, as ``rollflow`` with RAY_ADDRESS set to it is (``rollflow_here``). The chain's runs are
    local (and on S3): the equality of its tables and weights with these is also the equality of a two-node run with
    a local one, rollouts, log-probs, advantages and weights. (A cluster of two ``ray start`` nodes of its own, the
    run and the recompute in child processes with RAY_ADDRESS, cost about 25 CPU-s more: the head's daemons, Ray
    Data's helper actors on it, two command start-ups.) The second node is stopped, its processes alone, as soon as
    the recompute and the records are done, also on failure; the session's cluster goes on with its own node."""
    import time

    if HEAD_RESOURCE not in ray.cluster_resources():
        pytest.skip("the session joined the Ray cluster at RAY_ADDRESS instead of starting one: no node to pin to")
    root = tmp_path_factory.mktemp("async")
    samples, recompute_out = root / "samples", root / "recomputed"
    # ~400 step-level FrozenLake rows in groups of 8, several Parquet files, short responses
    generate(ExampleSpec(samples=400, seed=1, rows_per_file=120, response_len=(8, 32), prompt_len=(4, 12)),
             str(samples))
    args = _async_args(root, "a")
    args[args.index(CONFIG)] = str(REPO / CONFIG)  # whatever the working directory
    with RayNodes([NodeSpec(1, {"rollflow_pinned": 4})], join=ray.get_runtime_context().gcs_address) as nodes:
        started = time.time()
        # no report: no test reads this run's (the chain's last resume writes and checks the S3 run's)
        done = rollflow_here(*args, "--set", PINS, "--no-report", api_url=prefect_server.api_url)
        assert done.exit_code == 0, done.output[-3000:]
        between = time.time()
        recomputed = rollflow_here("recompute", "--input", str(samples), "--config", RECOMPUTE_CONFIG, "--output",
                                   str(recompute_out), "--set", RECOMPUTE_PINS, api_url=prefect_server.api_url)
        time.sleep(TASK_EVENTS_FLUSH_S)
        ended = time.time()
        records = record_here(started, between, ended)
    assert nodes.alive() == [], "the second node's processes are gone"
    return TwoNodeRun(root / "a", records[0], samples, recomputed, recompute_out, records[1])


@pytest.fixture(scope="module")
def async_run(two_node_run) -> Path:
    """The two-node run's folder (read-only)."""
    return two_node_run.run


@pytest.mark.slow
def test_the_two_node_run_trained_on_the_second_node_and_scored_on_the_head(two_node_run):
    """Ray's own record of the cluster (its GCS): the run's advantages tasks asked for the head's resource and ran
    there, its training workers asked for the second node's and ran there — placed by runtime.stage_resources, not
    by chance; the training workers computed the log-probs (no forward workers). (It was test_train_flow.py's, on
    the two-node run in turn it had then.)"""
    record, run = two_node_run.run_record, two_node_run.run
    head, second = node_with(record, "rollflow_head"), node_with(record, "rollflow_pinned")
    assert head != second
    assert nodes_of(record, "rollflow_head") == {head} and nodes_of(record, "rollflow_pinned") == {second}, record
    pinned = {name: names_of(record, name) for name in ("rollflow_head", "rollflow_pinned")}
    assert pinned["rollflow_pinned"] == {"TrainWorker"} and pinned["rollflow_head"], pinned
    # every training worker actor of the run is one of the pinned group's: no forward group of its own
    workers = [t for t in record["tasks"] if t["name"].split(".")[0].split(":")[-1] == "TrainWorker"]
    assert {t["actor"] for t in workers} == {t["actor"] for t in workers if asks_for(t, "rollflow_pinned")}, workers
    logprobs = json.loads((run / "iter_0000" / "logprobs" / "manifest.json").read_text())
    # on the training workers: on their engine, or (log-probs in bf16 where the CPU has it natively, training in
    # fp32) on a model in the pass's dtype beside it (stages/train/actor_forward.py)
    ran = logprobs["metrics"]["logprobs/jobs_on_held_engines"] + logprobs["metrics"]["logprobs/jobs_on_loaded_models"]
    assert ran >= 1, logprobs["metrics"]
    frozen = json.loads((run / "config.json").read_text())
    assert frozen["runtime"]["stage_resources"]["train_step"] == {"rollflow_pinned": 1.0}


@pytest.mark.slow
def test_recompute_on_the_two_node_cluster_equals_the_local_run(two_node_run, prefect_server, ray_cluster, tmp_path):
    """``rollflow recompute`` on a real two-node Ray cluster (the module's: the session's cluster and a second node
    joined to it, each with its own custom resource), each stage pinned to one node by
    runtime.stage_resources: Ray's own record shows the reward stage's tasks on the head and the advantage stage's on
    the second node, and both tables equal the local run's (the same command in this process, on the session's
    cluster), fingerprints included (where a stage runs is not part of them). (It was tests/spine/test_cli.py's, on a
    cluster of its own, then test_train_flow.py's, on its two-node run's cluster.)"""
    done, out = two_node_run.recomputed, two_node_run.recompute_out
    assert done.exit_code == 0, done.output[-3000:]
    record = two_node_run.recompute_record
    head, second = node_with(record, "rollflow_head"), node_with(record, "rollflow_pinned")
    assert head != second
    assert nodes_of(record, "rollflow_head") == {head}, record["tasks"]
    assert nodes_of(record, "rollflow_pinned") == {second}, record["tasks"]
    pinned = {name: names_of(record, name) for name in ("rollflow_head", "rollflow_pinned")}
    assert any("whole_table" in n for n in pinned["rollflow_head"]), pinned  # the reward stage's map task
    assert any("AdvantageBatch" in n for n in pinned["rollflow_pinned"]), pinned  # the advantage stage's
    local = tmp_path / "local"
    here = rollflow_here("recompute", "--input", str(two_node_run.samples), "--config", RECOMPUTE_CONFIG, "--output",
                         str(local), api_url=prefect_server.api_url)
    assert here.exit_code == 0, here.output[-3000:]
    for name in ("rewarded", "advantaged"):
        assert read_table(out / name).equals(read_table(local / name)), name
        fingerprints = [json.loads((folder / name / "manifest.json").read_text())["fingerprint"]
                        for folder in (out, local)]
        assert fingerprints[0] == fingerprints[1], name


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


@pytest.mark.slow
def test_rollouts_play_one_iteration_behind_and_training_weighs_the_stale_tokens(async_run, prefect_server):
    import numpy as np
    import pyarrow.dataset as pads

    from stages.generation.model_store import tiny_random_model_dir

    run = async_run
    base = str(Path(tiny_random_model_dir()).resolve())
    policy = [base] + [str((run / f"iter_{k:04d}/checkpoint").resolve()) for k in range(ITERATIONS)]
    for k in range(ITERATIONS):
        played = _manifest(run / f"iter_{k:04d}/rollout/episodes")["state_in"]["checkpoint"]["path"]
        trained = _manifest(run / f"iter_{k:04d}/logprobs")["section"]["checkpoint"]
        assert played == policy[max(0, k - 1)] and Path(trained).resolve() == Path(policy[k]), (k, played, trained)
        for turn in (run / f"iter_{k:04d}/rollout/turns").iterdir():  # every turn with the same weights
            assert _manifest(turn)["state_in"]["checkpoint"]["path"] == played, (k, turn)
    metrics = pads.dataset(str(run / "metrics")).to_table().to_pylist()
    stale = {m["iteration"]: m["value"] for m in metrics if m["name"] == "rollout/staleness"}
    assert stale == {0: 0.0, 1: 1.0, 2: 1.0}, stale
    # ... and a column of every sample, from the rollout's table to the one training reads
    for stage in ("rollout/samples", "logprobs", "advantaged"):
        column = {k: set(_table(run / f"iter_{k:04d}" / stage).column("staleness").to_pylist())
                  for k in range(ITERATIONS)}
        assert column == {0: {0}, 1: {1}, 2: {1}}, (stage, column)
    assert {m["iteration"] for m in metrics if m["name"] == "rollout/overlap_seconds"} == {0, 1, 2}
    assert not [m for m in metrics if m["stage"] == "engine"], "engines of their own never sleep"
    assert {m["iteration"] for m in metrics if m["stage"] == "eval"} == {0, 2}
    # the training section of every step weighs the tokens by e^(old - infer), clamped to 1.2 (ROLL's is_weight)
    for k in range(ITERATIONS):
        section = _manifest(run / f"iter_{k:04d}/checkpoint")["section"]
        assert section["train_infer_correction"]["is_weight"] == {"enabled": True, "weight_type": "token",
                                                                  "upper_bound": 1.2}, (k, section)
    # ... against the engine's recorded log-probs (infer_logprobs), which differ from the trained policy's (old) by
    # float32 noise alone when the rollout played that policy (iteration 0), and by the step between when it played
    # the policy one step behind
    def mismatch(k: int) -> float:
        table = _table(run / f"iter_{k:04d}/advantaged").select(["old_log_probs", "infer_logprobs"]).to_pylist()
        old = np.concatenate([r["old_log_probs"] for r in table])
        infer = np.concatenate([r["infer_logprobs"] for r in table])
        sampled = infer != 0  # next-token aligned, 0 off the response
        assert sampled.any()
        return float(np.abs(old - infer)[sampled].mean())

    assert mismatch(1) > 20 * mismatch(0) and mismatch(2) > 20 * mismatch(0), [mismatch(k) for k in range(3)]

    shown = rollflow_here("lineage", str(run / "iter_0002/rollout/samples"), api_url=prefect_server.api_url)
    assert shown.exit_code == 0, shown.output[-2000:]
    assert f"played with {policy[1]}" in shown.stdout, shown.stdout


# Where the overlap is SIGKILLed, in order (issue 46: "a SIGKILL at several points of the overlap"): (the file whose
# commit is the kill point, what must not be committed yet at the kill, what the point is)
KILL_POINTS = (
    ("iter_0001/rollout/turns/turn_000", "iter_0000/checkpoint",
     "iteration 1's rollout, played ahead, has committed its first turn while iteration 0 trains"),
    ("iter_0001/eval/turns/turn_000", "iter_0001/eval/samples",
     "the evaluation after iteration 1 (which waited for iteration 2's rollout, played ahead with iteration 0's "
     "checkpoint while iteration 1 trained) has committed its first turn"),
)


@pytest.mark.slow
def test_a_run_on_s3_sigkilled_at_several_points_of_the_overlap_resumes_to_the_uninterrupted_result(
        async_run, s3, prefect_server, ray_cluster, cli_env, tmp_path, monkeypatch):
    """The run with ``runs_dir=s3://...`` (issue 14, item 4), started from an empty working directory, SIGKILLed whole
    at each point of ``KILL_POINTS`` in turn — the run, then its ``rollflow train --resume s3://...`` — and resumed
    to the end: the in-flight rollout continues from its committed turns with the checkpoint the schedule names, the
    evaluation from its own, and every table and weight of the three iterations equals the uninterrupted two-node
    run's (seeded sampling; ``async_run``). The first launch is killed before its training workers start (its engine
    alone); the resume trains iterations 0 and 1, plays iteration 2's rollout ahead with iteration 0's checkpoint
    beside iteration 1's training, and is killed in the evaluation of iteration 1's checkpoint; the last resume finds
    both and must take, for each stage, the one the schedule names, and trains iteration 2 on engines rebuilt by
    replaying steps 0 and 1 (weights-only checkpoints) from the initial model on the stored tables, its workers
    without the command's AWS variables. (A kill between iteration 1's checkpoint and the evaluation, once a third
    launch, resumed through the same skips as the evaluation's kill: iteration 2's rollout had ended by then in the
    runs timed here.) The object store's part (it was test_train_flow.py's own SIGKILL of the run in turn, once
    iteration 0's weights-only checkpoint was committed: 110 CPU-s for a run of its own): everything of the run is in
    the bucket, nothing in the working directory, no killed attempt is left in a folder with a manifest, no metric is
    logged twice, and ``--resume`` again skips every stage and rewrites no manifest. One chain of kills, so the points
    cost one run and a start-up each. Both launches join the session's Ray cluster and Prefect server (``cli_env``),
    as a command on a shared cluster does: the kill takes the driver, Ray ends the job's engines and training workers
    with it, and the last resume (in this process) starts them again — not a Ray cluster and a Prefect server more
    for each kill (about 30 CPU-s each). The first launch started its own, as on a laptop, until issue 44's last
    cut: that the watchdog of a SIGKILLed command takes down the local cluster and the ephemeral server it started
    is tests/spine/test_cluster.py's test_a_sigkilled_driver_leaves_no_ray_process_behind and
    tests/spine/test_resume.py's test_sigkill_mid_run_then_rerun_gives_the_uninterrupted_output."""
    import shutil

    import numpy as np

    from stages.generation.model_store import tiny_random_model_dir
    from stages.metrics import read_metrics
    from stages.storage import ATTEMPT_KEY, Location, local_side, read_manifest
    from tests.objstore import BUCKET, objects, read_s3_table

    run = f"s3://{BUCKET}/runs/{async_run.name}"  # the run name the samples' ids derive from
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    args = _async_args(f"s3://{BUCKET}/runs", async_run.name)  # type: ignore[arg-type]
    args[args.index(CONFIG)] = str(REPO / CONFIG)
    command = [sys.executable, "-m", "flows.cli", *args]
    logs = []
    try:
        for n, (point, not_yet, what) in enumerate(KILL_POINTS):
            logs.append(tmp_path / f"killed{n}.log")
            jobs = ray_jobs()
            committed = Location.of(f"{run}/{point}")  # asked by reading its manifest: one HEAD while missing
            sigkill_when(command, _every(0.2, lambda: read_manifest(committed) is not None), logs[-1],
                         env={**cli_env, **s3, "PYTHONPATH": str(REPO)}, cwd=str(cwd), what=what, whole_group=True)
            assert not Location.of(f"{run}/{not_yet}/manifest.json").exists(), \
                f"killed after {not_yet} committed, not when {what}"
            assert not objects(f"{run}/report"), "killed before the end"
            wait_ray_jobs_gone(jobs)  # on the session's cluster: the killed driver's engines and workers too
            command = [sys.executable, "-m", "flows.cli", "train", "--resume", run, "--no-report"]
        # the last resume: the command in this process (the s3 fixture set its AWS_* variables here), on the
        # session's Ray cluster and Prefect server, from the same empty working directory
        monkeypatch.chdir(cwd)
        resumed = rollflow_here("train", "--resume", run, api_url=prefect_server.api_url)
        assert resumed.exit_code == 0, resumed.output[-3000:]
        replayed = [x for x in logs[1].read_text().splitlines() if x.startswith("[iteration 1] rollout turn 0:")]
        assert replayed and replayed[0].endswith("(committed earlier, skipped)"), logs[1].read_text()[-3000:]
        evaluated = [x for x in resumed.stdout.splitlines() if x.startswith("[eval] eval turn 0:")]
        assert evaluated and all(x.endswith("(committed earlier, skipped)") for x in evaluated), resumed.stdout
        stored = objects(run)
        # every rollout and its turns played the checkpoint the schedule names: the initial one for iterations 0
        # and 1 (iteration 1's turns before and after the kill), iteration 0's for iteration 2
        base = str(Path(tiny_random_model_dir()).resolve())
        for k, scheduled in enumerate((base, base, f"{run}/iter_0000/checkpoint")):
            rollout = f"iter_{k:04d}/rollout"
            turns = sorted({n.rsplit("/", 1)[0] for n in stored if n.startswith(f"{rollout}/turns/")
                            and n.endswith("/manifest.json")})
            played = {_s3_manifest(f"{run}/{t}")["state_in"]["checkpoint"]["path"] for t in turns}
            assert _s3_manifest(f"{run}/{rollout}/episodes")["state_in"]["checkpoint"]["path"] == scheduled and \
                played == {scheduled}, (k, played)
        for k in range(ITERATIONS):
            for stage in ("rollout/samples", "logprobs", "rewarded", "advantaged"):
                _assert_same_rows(read_s3_table(f"{run}/iter_{k:04d}/{stage}").sort_by("row_id"),
                                  _table(async_run / f"iter_{k:04d}" / stage), (k, stage))
            got, want = _s3_weights(f"{run}/iter_{k:04d}/checkpoint"), _weights(async_run / f"iter_{k:04d}/checkpoint")
            assert got.keys() == want.keys()
            for key in got:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"iter {k} {key}")
        for stage in ("eval_base/samples", "iter_0001/eval/samples"):
            _assert_same_rows(read_s3_table(f"{run}/{stage}").sort_by("row_id"), _table(async_run / stage), stage)
        # every object of a folder with a manifest is the manifest, one it lists or one of an inner folder with a
        # manifest of its own: no killed attempt is left (the stages, the rollouts' and the evaluation's turns). A
        # record of parts (a rollout, its turns; stages/commit.py commit_record) lists no objects: its parts are
        # folders with manifests of their own
        folders = {n[:-len("manifest.json")] for n in stored if n.endswith("/manifest.json")}
        assert {f"iter_{k:04d}/{stage}/" for k in range(ITERATIONS) for stage in STAGES if stage != "eval/samples"} \
            <= folders
        for prefix in folders:
            manifest = read_manifest(Location.of(f"{run}/{prefix}"))
            listed = {f"{prefix}{o['name']}" for o in (manifest["objects"] if ATTEMPT_KEY in manifest else [])}
            inner = [f for f in folders if f != prefix and f.startswith(prefix)]
            left = {n for n in stored if n.startswith(prefix) and n != f"{prefix}manifest.json"
                    and not any(n.startswith(f) for f in inner)} - listed
            assert not left, (prefix, sorted(left))
        last = read_manifest(Location.of(f"{run}/iter_0002/checkpoint"))
        listed = {f"iter_0002/checkpoint/{o['name']}": o["bytes"] for o in last["objects"]}
        assert listed.items() <= stored.items()  # every object its manifest lists, at its size
        assert any("/deepspeed/actor/" in n for n in listed) and any(n.endswith(".safetensors") for n in listed)
        # iterations 0 and 1 hold weights only, so the last resume rebuilt the engines by replaying steps 0 and 1 on
        # the stored tables: the log-prob request of iteration 2 to the actor group built them (issue 44), and the
        # training step found them kept; the weights above equal the uninterrupted run's
        for k in (0, 1):
            weights_only = read_manifest(Location.of(f"{run}/iter_{k:04d}/checkpoint"))
            assert not any("deepspeed/actor/" in o["name"] for o in weights_only["objects"]), k
        assert last["metrics"]["train/engines_kept"] == 1.0 and last["metrics"]["train/replayed_steps"] == 0
        assert {"logs/rollflow.log", "report/index.html"} <= stored.keys()
        assert any(n.startswith("tensorboard/events.out.tfevents") for n in stored)
        metrics = read_metrics(run).to_pylist()
        keys = [(m["iteration"], m["stage"], m["name"]) for m in metrics]
        assert len(keys) == len(set(keys)), "no metric is logged twice"
        assert {m["iteration"] for m in metrics if m["stage"] == "train"} == {0, 1, 2}
        assert list(cwd.iterdir()) == [], "nothing is written into the working directory"

        manifests = {n: Location.of(f"{run}/{n}").read_text() for n in stored if n.endswith("manifest.json")}
        again = rollflow_here("train", "--resume", run, "--no-report", api_url=prefect_server.api_url)  # no work
        assert again.exit_code == 0, again.output[-3000:]
        assert "[iteration 2] train            committed earlier, skipped" in again.stdout, again.stdout
        assert {n: Location.of(f"{run}/{n}").read_text() for n in manifests} == manifests
        assert json.loads(Location.of(f"{run}/config.json").read_text())["max_steps"] == ITERATIONS
        assert list(cwd.iterdir()) == []
    finally:
        shutil.rmtree(local_side(Location.of(run)), ignore_errors=True)


def _every(seconds: float, check):
    """``check``, asked at most every ``seconds`` (a listing of the object store is not free)."""
    import time

    last = [0.0]

    def ready() -> bool:
        if time.monotonic() - last[0] < seconds:
            return False
        last[0] = time.monotonic()
        return check()
    return ready


def _s3_manifest(uri: str) -> dict:
    from stages.storage import Location, read_manifest

    manifest = read_manifest(Location.of(uri))
    assert manifest is not None, f"no manifest in {uri}"
    return manifest


def _s3_weights(uri: str) -> dict:
    """name -> float32 array of the weights beside a checkpoint's manifest on the object store (as ``_weights``
    reads a local one)."""
    from safetensors.torch import load

    from stages.storage import ATTEMPT_KEY, Location, read_manifest

    loc = Location.of(uri)
    manifest = read_manifest(loc)
    out = {}
    for o in manifest["objects"]:  # named inside the attempt's folder
        name = o["name"].split("/", 1)[1] if o["name"].startswith(f"{manifest[ATTEMPT_KEY]}/") else o["name"]
        if name.endswith(".safetensors") and "/" not in name:
            with loc.fs.open_input_file(f"{loc.path}/{o['name']}") as f:  # one GET (a stream's read(): 256 KiB each)
                out.update(_float32(load(f.read())))
    assert out, f"no weights in {uri}"
    return out
