"""One runtime section per run (issue 12): the top-level ``runtime`` of a training config is what every stage of the
run reads; a section's own ``runtime`` may only repeat it, and a frozen config of an earlier version (which spells
out every section's default runtime) still validates to the same run."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from schemas.config import RuntimeConfig, load_config, validate_config
from schemas.errors import ConfigError
from schemas.rlvr_train_config import RLVRTrainConfig
from schemas.train_config import ForwardConfig
from schemas.train_flow_config import TrainFlowConfig

REPO = Path(__file__).resolve().parents[2]
RUNTIME = {"num_cpus": 2, "batch_rows": 256, "data_memory_mb": 128.0, "ray_address": "ray://head:10001",
           "stage_resources": {"train_step": {"trainer_node": 1.0}, "advantages": {"head_node": 0.5}}}
CLUSTER_FIELDS = tuple(RuntimeConfig.model_fields)


def _sections(config) -> dict:
    """Every runtime a stage of the run reads, by section: what the run's accessors hand the stages (issue 43)."""
    found = {"logprobs": config.logprobs_config().runtime, "train": config.train_step_config().runtime}
    if isinstance(config, TrainFlowConfig):
        found["rollout"] = config.rollout_for(0).runtime
    return found


@pytest.mark.parametrize("model, path", [(TrainFlowConfig, "configs/train_frozenlake_quickstart.yaml"),
                                         (RLVRTrainConfig, "configs/rlvr_train_math.yaml")])
def test_the_top_level_runtime_reaches_every_section(model, path):
    config = load_config(model, REPO / path, {"runtime": RUNTIME})
    for name, runtime in _sections(config).items():
        assert {f: getattr(runtime, f) for f in CLUSTER_FIELDS} == RUNTIME, name
    assert config.train.runtime.num_workers == 1  # the training section keeps its own worker settings
    assert validate_config(model, config.model_dump(mode="json")) == config  # the frozen copy round-trips


@pytest.mark.parametrize("model, path", [(TrainFlowConfig, "configs/train_frozenlake_quickstart.yaml"),
                                         (RLVRTrainConfig, "configs/rlvr_train_math.yaml")])
def test_the_run_declares_its_cluster_settings_once_and_dumps_them_as_before(model, path):
    """The run's model holds the cluster settings once, at its top level (issue 43: no copy into the sections at
    load time); the evaluation's rollout reads them too. Its dump (config.json, the hashes of it) still spells them
    out under each section's runtime, first, as the copies of earlier versions did, and loads back to the run."""
    config = load_config(model, REPO / path, {"runtime": RUNTIME})
    default = RuntimeConfig()
    dump = config.model_dump(mode="json")
    for name in _sections(config):
        own = getattr(config, name).runtime
        assert {f: getattr(own, f) for f in CLUSTER_FIELDS} == {f: getattr(default, f) for f in CLUSTER_FIELDS}
        written = dump[name]["runtime"]
        assert list(written)[:len(CLUSTER_FIELDS)] == list(CLUSTER_FIELDS), name
        assert {f: written[f] for f in CLUSTER_FIELDS} == RUNTIME, name
    if isinstance(config, TrainFlowConfig):
        assert {f: getattr(config.eval_rollout().runtime, f) for f in CLUSTER_FIELDS} == RUNTIME
    assert validate_config(model, dump) == config


@pytest.mark.parametrize("data, digest", [
    ({"runtime": RUNTIME}, "0a2ee5b1cb84989f2f15346fee9188f1d625d6b35b3e0e225c335b45872254e6"),
    ({}, "c0f06d323f7edfad05f1215e3ab40251a663e7407e5316922c700caee35aeda7")])
def test_the_dump_is_byte_for_byte_that_of_the_copying_versions(data, digest):
    """The digests of the config.json text that the versions which copied the runtime into each section wrote (a
    run folder resumes without re-running anything, and it loads back to the run)."""
    config = validate_config(TrainFlowConfig, data)
    text = json.dumps(config.model_dump(mode="json"))
    assert hashlib.sha256(text.encode()).hexdigest() == digest
    assert validate_config(TrainFlowConfig, json.loads(text)) == config


@pytest.mark.parametrize("model, path", [(TrainFlowConfig, "configs/train_frozenlake_quickstart.yaml"),
                                         (RLVRTrainConfig, "configs/rlvr_train_math.yaml")])
def test_a_frozen_config_with_default_section_runtimes_is_the_same_run(model, path):
    """Earlier versions froze each section's own (default) runtime beside a top-level one that differed."""
    config = load_config(model, REPO / path, {"runtime": RUNTIME})
    frozen = config.model_dump(mode="json")
    for name in _sections(config):
        frozen[name] = {**frozen[name], "runtime": {**frozen[name]["runtime"], **RuntimeConfig().model_dump()}}
    assert validate_config(model, frozen) == config


@pytest.mark.parametrize("section", ["rollout", "logprobs", "train"])
def test_a_section_runtime_that_differs_is_refused_with_the_fix(section):
    with pytest.raises(ConfigError) as err:
        validate_config(TrainFlowConfig, {"runtime": {"num_cpus": 2}, section: {"runtime": {"num_cpus": 4}}})
    for words in (f"{section}.runtime.num_cpus (4) differs from runtime.num_cpus (2)",
                  "set runtime.num_cpus at the top level"):
        assert words in str(err.value)


def test_rlvr_section_runtime_that_differs_is_refused():
    data = load_config(RLVRTrainConfig, REPO / "configs/rlvr_train_math.yaml").model_dump(mode="json")
    data["train"]["runtime"]["batch_rows"] = 7
    with pytest.raises(ConfigError, match=r"train.runtime.batch_rows \(7\) differs from runtime.batch_rows"):
        validate_config(RLVRTrainConfig, data)


@pytest.mark.parametrize("pins, words", [
    ({"rollout": {"gpu_node": 1}}, ["names stage 'rollout'", "use one of response_rewards, advantages, logprobs, "
                                    "train_step"]),
    ({"train_step": {"GPU": 1}}, ["runtime.stage_resources.train_step.GPU: 'GPU' is not a custom resource",
                                  "ray start --resources"]),
    ({"advantages": {"node:10.0.0.2": 0.01}}, ["'node:10.0.0.2' is not a custom resource"]),
    ({"logprobs": {"head_node": 0}}, ["runtime.stage_resources.logprobs.head_node is 0", "positive amount",
                                      "remove the entry"]),
])
def test_stage_resources_name_a_pinnable_stage_and_a_positive_custom_resource(pins, words):
    with pytest.raises(ConfigError) as err:
        validate_config(TrainFlowConfig, {"runtime": {"stage_resources": pins}})
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("model, path", [(TrainFlowConfig, "configs/train_frozenlake_quickstart.yaml"),
                                         (RLVRTrainConfig, "configs/rlvr_train_math.yaml")])
def test_a_bad_top_level_runtime_is_reported_once_where_it_was_written(model, path):
    """Not also under each section it would have been copied into (fields the user never wrote)."""
    with pytest.raises(ConfigError) as err:
        load_config(model, REPO / path, {"runtime.batch_rows": 0, "runtime.bogus": 1})
    fields = [line.split(":")[0].strip() for line in str(err.value).splitlines()[1:]]
    assert fields == ["field 'runtime.batch_rows'", "field 'runtime.bogus'"], str(err.value)


KEPT_GROUP_IGNORES = [
    ({"logprobs": {"cpus_per_actor": 2}}, ["logprobs.cpus_per_actor is 2, but no forward worker reserves it",
                                           "train.runtime.cpus_per_worker"]),
    ({"logprobs": {"device": "cuda"}}, ["logprobs.device is cuda, but the log-probs run on the CPU training workers",
                                        "set train.runtime.use_gpu: true"]),
    ({"runtime": {"stage_resources": {"logprobs": {"head_node": 1}}}},
     ["runtime.stage_resources.logprobs pins forward workers", "pin them with runtime.stage_resources.train_step"]),
]


@pytest.mark.parametrize("model, path", [(TrainFlowConfig, "configs/train_frozenlake_quickstart.yaml"),
                                         (RLVRTrainConfig, "configs/rlvr_train_math.yaml")])
@pytest.mark.parametrize("overrides, words", KEPT_GROUP_IGNORES)
def test_forward_worker_options_are_refused_when_the_actor_group_computes_the_log_probs(model, path, overrides,
                                                                                        words):
    """A kept training group computes the log-probs (issue 44): no forward worker exists to reserve CPUs, a GPU or a
    pinned node, so such an option is a ConfigError naming it and the fix, not ignored; with keep_workers: false
    the run keeps forward workers of their own and takes it."""
    with pytest.raises(ConfigError) as err:
        load_config(model, REPO / path, overrides)
    for text in [*words, "or set train.runtime.keep_workers: false"]:
        assert text in str(err.value)
    per_step = {**overrides, "train": {"runtime": {"keep_workers": False}}}
    config = load_config(model, REPO / path, per_step)
    assert not config.train.runtime.keep_workers


def test_no_run_code_reads_a_cluster_setting_from_a_section_runtime():
    """Inside a run a section's own ``runtime`` holds the defaults of the cluster settings (the run declares them once,
    at the top level, and hands them over through ``train_step_config()``, ``logprobs_config()``, ``rollout_for()``
    and ``eval_rollout()``); code that read ``config.train.runtime.batch_rows`` would silently get the default. No
    module of flows/ or stages/ does."""
    fields = "|".join(CLUSTER_FIELDS)
    pattern = re.compile(rf"\.(?:train|logprobs|rollout|eval)\.runtime\.(?:{fields})\b")
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for folder in ("flows", "stages") for path in sorted((REPO / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "read the run's runtime through its accessors instead:\n" + "\n".join(found)


def test_a_log_prob_stage_run_on_its_own_gets_the_runtime_of_its_actor_group_from_its_section():
    """rollflow logprobs / values start an actor group (stages/train/stage.py forward_group) whose runtime is the
    forward section's, made in one place (ForwardConfig.group_runtime): the ranks, their CPUs, threads and GPUs,
    not kept, the cluster settings as given, pinned by the logprobs entry of stage_resources."""
    forward = ForwardConfig(num_actors=3, cpus_per_actor=0.5, threads=2, device="cuda", gpus_per_actor=0.25,
                            runtime={**RUNTIME, "stage_resources": {"logprobs": {"gpu_node": 1.0}}})
    group = forward.group_runtime()
    assert (group.num_workers, group.cpus_per_worker, group.torch_threads(), group.use_gpu, group.keep_workers) == (
        3, 0.5, 2, True, False)
    assert {f: getattr(group, f) for f in CLUSTER_FIELDS if f != "stage_resources"} == {
        f: v for f, v in RUNTIME.items() if f != "stage_resources"}
    assert group.resources_for("train_step") == {"gpu_node": 1.0} and forward.gpus_per_actor_reserved() == 0.25
    cpu = ForwardConfig(cpus_per_actor=2).group_runtime()
    assert (cpu.use_gpu, cpu.torch_threads(), cpu.stage_resources) == (False, 2, {})
