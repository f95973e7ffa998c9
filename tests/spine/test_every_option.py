"""Every boolean and enumerated option of every command's config is exercised (issue 48: "an option that validates and
then crashes cannot exist"), and an option set where nothing reads it is refused at load time.

The options are walked from the config models themselves (``schemas.config.COMMAND_CONFIGS`` and every section
model under them), each named by the model that declares it, so a shared option (``AdvantageOptions.kl_penalty``)
counts once and a new option or a new value is picked up without an edit here. Each option is covered in exactly one
of three ways, and :func:`test_every_option_is_covered_once` fails naming any option that is not:

* ``AGENTIC_STAGES``: run here, value by value, through the two stages that read them (response_rewards and
  advantages, the recompute chain) on a tiny step-level table; every value other than the base one either changes
  the stages' output or is refused by the config with a ConfigError naming the option;
* ``ROLLOUT_STAGES``: the same through the rollout's stages (reset, turns, samples) on the tiny random model, the
  samples table compared;
* ``RLVR_STAGES``: the same through RLVR's chain (``rollflow score --advantages``) on 24 shipped math prompts' answers;
* ``ELSEWHERE``: the module that runs the stage reading it (the rollout and its engines, the log-prob and training
  workers, the trackers, the RLVR chain); the module must exist and name the option;
* ``ONE_VALUE``: a literal of one value (nothing to choose).
"""

from __future__ import annotations

import inspect
import json
import shutil
import types
import typing
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pydantic import BaseModel

from schemas.config import COMMAND_CONFIGS, RecomputeConfig, validate_config
from schemas.errors import ConfigError
from schemas.rlvr_config import RLVRConfig
from schemas.rollout_config import EngineConfig
from stages.example import ExampleSpec, generate
from tests.spine.conftest import SMALL
from tests.spine.helpers import REPO, read_table, run_recompute, write_samples

# ---- the options, from the models ------------------------------------------------------------------------------------


def _choices(annotation) -> tuple | None:
    """The values of a boolean or enumerated annotation (None included when optional), else None."""
    if annotation is bool:
        return (True, False)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return args
    if origin is typing.Annotated:
        return _choices(args[0])
    if origin in (typing.Union, types.UnionType):
        found = [_choices(a) for a in args if a is not type(None)]
        if len(found) == 1 and found[0] is not None:
            return (*found[0], *((None,) if type(None) in args else ()))
    if origin in (list, tuple) and args and _choices(args[0]) is not None:  # a list of names: each name
        return _choices(args[0])
    return None


def _submodels(annotation):
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        if not isinstance(arg, (str, int, float, bool)) and arg is not None:
            yield from _submodels(arg)


def _owner(model: type[BaseModel], name: str) -> type:
    """The class of ``model``'s hierarchy that declares field ``name`` (the most derived one)."""
    return next(k for k in model.__mro__ if name in k.__dict__.get("__annotations__", {}))


def option_choices() -> dict[str, tuple]:
    """``Owner.field`` -> its values, for every boolean or enumerated option under every command's config."""
    options: dict[str, tuple] = {}
    seen: set[type] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            values = _choices(field.annotation)
            if values is not None:
                options.setdefault(f"{_owner(model, name).__name__}.{name}", values)
            for sub in _submodels(field.annotation):
                walk(sub)

    for kind in COMMAND_CONFIGS:
        walk(kind.resolve())
    return options


# ---- how each is covered ---------------------------------------------------------------------------------------------

# run here through the recompute chain: option -> (its path in RecomputeConfig, the base it is varied from: the
# options it needs to be read at all)
AGENTIC_STAGES = {
    "AdvantageOptions.adv_estimator": ("adv_estimator", {}),
    "AdvantageOptions.whiten_rewards": ("whiten_rewards", {}),
    "AdvantageOptions.whiten_advantages": ("whiten_advantages", {}),
    "AdvantageOptions.add_token_level_kl": ("add_token_level_kl", {}),
    "AdvantageOptions.kl_penalty": ("kl_penalty", {"add_token_level_kl": True}),
    "AdvantageOptions.roll_compat": ("roll_compat", {}),
    "RewardNormalizationConfig.grouping": ("reward_normalization.grouping",
                                           {"reward_normalization": {"method": "mean_std"}}),
    "RewardNormalizationConfig.method": ("reward_normalization.method", {}),
    "RewardNormalizationConfig.norm_mean_type": ("reward_normalization.norm_mean_type", {}),
    "RewardNormalizationConfig.norm_std_type": ("reward_normalization.norm_std_type", {}),
}
# run here through RLVR's reward, samples, response-rewards and advantages stages (rollflow score --advantages):
# option -> (its path in RLVRConfig, the base it is varied from); the base has max_new_tokens at the longest response
# (so max_len_mask finds some) and an error_max_len_threshold below it (so error_max_len_clip drops some)
RLVR_STAGES = {
    "RLVRRewardOptions.max_len_mask": ("max_len_mask", {}),
    "RLVRRewardOptions.difficulty_mask": ("difficulty_mask", {}),
    "RLVRRewardOptions.error_max_len_clip": ("error_max_len_clip", {}),
    "RLVRRewardOptions.norm_mean_type": ("norm_mean_type", {}),
    "RLVRRewardOptions.norm_std_type": ("norm_std_type", {}),
}
# run here through the rollout's stages (reset, turns, samples) on the tiny random model with the HF engine, one engine
# pool for all: option -> (its path in RolloutConfig, the base it is varied from, over ROLLOUT_BASE: FrozenLake, 2
# groups of 2, 3 turns; action_order orders the actions a prompt lists, so its base lists them)
LISTS_ACTIONS = {"prompt": {"first_user": "{observation}\nAnswer with one of {answer_options}.",
                            "next_user": "{observation}\nAnswer with one of {answer_options}."}}
ROLLOUT_STAGES = {
    "EpisodeOptions.sample_level": ("sample_level", {}),
    "EpisodeOptions.on_invalid_action": ("on_invalid_action", {}),
    "PromptConfig.action_order": ("prompt.action_order", LISTS_ACTIONS),
}
ROLLOUT_BASE = {"sequence_length": 1024, "seed": 7, "env": {"num_env_groups": 2, "group_size": 2, "max_steps": 3},
                "generating_args": {"max_new_tokens": 8, "temperature": 1.0},
                "engine": {"backend": "hf", "dtype": "float32", "threads": 1, "options": {"max_batch_size": 8}}}
# exercised by the stage that reads it in another module (the tiny model, the HF and vLLM engines, DeepSpeed): the
# module's path; it must name the option
ELSEWHERE = {
    # the rollout's engines (the values build engines of their own: vLLM, the dtypes, sleep between rollouts)
    "EngineConfig.backend": "tests/rollout/test_vllm_rollout.py",
    "EngineConfig.flashinfer_sampler": "tests/schemas/test_toolchain.py",
    "EngineConfig.dtype": "tests/schemas/test_precision.py",
    "EngineConfig.sleep_level": "tests/trainflow/test_train_flow.py",
    # the log-prob / values workers
    "ForwardConfig.enable_reference": "tests/train/test_stage.py",
    "ForwardConfig.compute_entropy": "tests/train/test_done_when.py",
    "ForwardConfig.dtype": "tests/schemas/test_precision.py",
    "ForwardConfig.device": "tests/train/test_stage.py",
    "ForwardConfig.use_sequence_packing": "tests/train/test_stage.py",
    "ForwardConfig.attn_implementation": "tests/train/test_forward.py",
    "ForwardConfig.fused_output_layer": "tests/train/test_forward.py",
    # the policy loss and the training step (the losses on ROLL's golden vectors, the step on DeepSpeed)
    "LossOptions.use_pg_clip_range": "tests/losses/test_actor_properties.py",
    "LossOptions.dual_clip_loss": "tests/losses/test_actor_properties.py",
    "LossOptions.loss_agg_mode": "tests/train/test_conformance.py",
    "LossOptions.use_kl_loss": "tests/losses/test_actor_properties.py",
    "LossOptions.kl_loss_type": "tests/losses/test_actor_properties.py",
    "LossOptions.ratio_type": "tests/losses/test_actor_properties.py",
    "LossOptions.importance_sampling": "tests/losses/test_actor_properties.py",
    "LossOptions.difficulty_loss_weight": "tests/train/test_difficulty_weight.py",
    "LossOptions.length_loss_weight": "tests/train/test_conformance.py",
    "IsWeightConfig.enabled": "tests/losses/test_train_infer.py",
    "IsWeightConfig.weight_type": "tests/losses/test_train_infer.py",
    "IsWeightConfig.detach": "tests/losses/test_train_infer.py",
    "FilterConfig.enabled": "tests/losses/test_train_infer.py",
    "FilterConfig.agg_type": "tests/losses/test_train_infer.py",
    "FilterConfig.ratio_enabled": "tests/losses/test_train_infer.py",
    "FilterConfig.diff_enabled": "tests/losses/test_train_infer.py",
    "LossOptions.roll_compat": "tests/losses/test_actor_properties.py",
    "TrainSection.adv_estimator": "tests/train/test_done_when.py",
    "TrainOptions.policy_loss": "tests/train/test_difficulty_weight.py",
    "TrainOptions.compute_entropy_metric": "tests/train/test_core.py",
    "ModelArgs.dtype": "tests/schemas/test_precision.py",
    "ModelArgs.disable_gradient_checkpointing": "tests/train/test_lora.py",
    "ModelArgs.attn_implementation": "tests/train/test_core.py",
    "TrainingArgs.lr_scheduler_type": "tests/train/test_core.py",
    "StrategyArgs.zero_stage": "tests/train/test_core.py",
    "StrategyArgs.torch_compile": "tests/flows/test_gpu_preflight.py",
    "StrategyArgs.optimizer": "tests/train/test_core.py",
    "WorkerTrainConfig.use_dynamic_batching_in_train": "tests/spine/test_every_option.py",
    "WorkerTrainConfig.use_sequence_packing": "tests/train/test_core.py",
    "WorkerTrainConfig.fused_output_layer": "tests/train/test_core.py",
    "TrainRuntimeConfig.use_gpu": "tests/flows/test_plan.py",
    "TrainRuntimeConfig.keep_workers": "tests/flows/test_plan.py",
    # where a run's metrics go
    "TrackingOptions.track_with": "tests/flows/test_trackers.py",
    "WandbOptions.mode": "tests/flows/test_trackers.py",
}
ONE_VALUE = {"TrainFlowConfig.pipeline", "RLVRTrainConfig.pipeline", "StrategyArgs.strategy_name"}


def test_every_option_is_covered_once():
    options = option_choices()
    covered = [*AGENTIC_STAGES, *RLVR_STAGES, *ROLLOUT_STAGES, *ELSEWHERE, *ONE_VALUE]
    missing = sorted(set(options) - set(covered))
    assert not missing, (f"options no test exercises: {missing}; add each to AGENTIC_STAGES, RLVR_STAGES or "
                         "ROLLOUT_STAGES (run here) or ELSEWHERE (the test module that runs the stage reading it)")
    assert not sorted(set(covered) - set(options)), "entries of no option (renamed or removed?)"
    assert len(covered) == len(set(covered)), "an option is listed twice"
    assert all(len(options[name]) == 1 for name in ONE_VALUE)


@pytest.mark.parametrize("name", sorted(ELSEWHERE))
def test_the_module_that_exercises_an_option_names_it(name):
    text = (REPO / ELSEWHERE[name]).read_text()
    assert name.split(".")[1] in text, f"{ELSEWHERE[name]} does not name {name}"


def test_dynamic_batching_decides_how_the_training_step_forms_micro_batches():
    """use_dynamic_batching_in_train (no other test names it): a token budget per micro-batch, or a fixed number of
    rows (stages/train/batching.py batching_policy, what the training step plans its micro-batches with)."""
    from schemas.train_config import WorkerTrainConfig
    from stages.train.batching import batching_policy

    on, off = (batching_policy(WorkerTrainConfig(use_dynamic_batching_in_train=flag)) for flag in (True, False))
    assert on != off
    assert on.max_tokens == WorkerTrainConfig().max_tokens_per_microbatch_in_train


def test_sequence_packing_packs_fixed_row_micro_batches_too():
    """With fixed row counts per micro-batch the policy says packed too, as the forward runs them
    (TrainEngine.forward reads use_sequence_packing itself); the flag only changes the split under dynamic batching
    (real tokens against the budget)."""
    from schemas.train_config import WorkerTrainConfig
    from stages.train.batching import batching_policy

    policy = batching_policy(WorkerTrainConfig(use_dynamic_batching_in_train=False, use_sequence_packing=True))
    assert policy.packed


# ---- the agentic data-side options through the recompute stages -----------------------------------------------------

COLUMNS = ("response_level_rewards", "token_level_rewards", "advantages", "returns", "sample_mask",
           "final_response_mask")


def _with(data: dict, path: str, value) -> dict:
    data = json.loads(json.dumps(data))
    node = data
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return data


def _outputs(out: Path) -> dict[str, np.ndarray]:
    rewarded, advantaged = read_table(out / "rewarded"), read_table(out / "advantaged")
    result = {}
    for name in COLUMNS:
        table = advantaged if name in advantaged.column_names else rewarded
        if name not in table.column_names:
            continue
        values = table.column(name).to_pylist()
        result[name] = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values]) if values and \
            isinstance(values[0], list) else np.asarray([np.nan if v is None else v for v in values], np.float64)
    return result


def _cases(table: dict) -> list:
    """One test case per value of each option of ``table`` (option name -> how its stage runs it)."""
    options = option_choices()
    return [pytest.param(name, value, id=f"{name}={value}") for name in table for value in options[name]]


def _differs(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() != b.keys() or any(a[k].shape != b[k].shape or not np.allclose(a[k], b[k], equal_nan=True)
                                       for k in a)


@pytest.fixture(scope="module")
def tiny_steps(tmp_path_factory, ray_cluster) -> str:
    """48 step-level FrozenLake rows in groups of 8 (with old/ref log-probs and values), the groups under two tags (so
    that grouping by tag differs from the batch)."""
    root = tmp_path_factory.mktemp("options")
    generate(ExampleSpec(samples=48, seed=1, rows_per_file=100, **SMALL), str(root / "generated"))
    table = read_table(root / "generated")
    groups = sorted(set(table.column("group_id").to_pylist()))
    tags = [f"FrozenLake{groups.index(g) % 2}" for g in table.column("group_id").to_pylist()]
    table = table.set_column(table.schema.get_field_index("tag"), "tag", pa.array(tags, table.schema.field("tag").type))
    return write_samples(table, root / "steps")


@pytest.fixture(scope="module")
def chain(tiny_steps, tmp_path_factory):
    """Runs the recompute chain of a config (cached by config): its output columns, or the ConfigError."""
    root, done = tmp_path_factory.mktemp("runs"), {}

    def run(data: dict):
        key = json.dumps(data, sort_keys=True)
        if key not in done:
            try:
                cfg = validate_config(RecomputeConfig, data)
            except ConfigError as err:
                done[key] = err
            else:
                out = root / f"run{len(done)}"
                run_recompute(tiny_steps, str(out), cfg)
                done[key] = _outputs(out)
        return done[key]

    return run


@pytest.mark.parametrize("name, value", _cases(AGENTIC_STAGES))
def test_an_agentic_option_value_changes_the_stages_output_or_is_refused(name, value, chain):
    path, base = AGENTIC_STAGES[name]
    current = RecomputeConfig.model_validate(base)
    for key in path.split("."):
        current = getattr(current, key)
    _check_value(name, value, path, base, chain, current)


def _check_value(name: str, value, path: str, base: dict, chain, current) -> None:
    """``value`` of option ``name`` (at ``path``), from ``base`` where it is ``current``: refused naming the option, or
    the chain's output differs from the base's."""
    if value == current:
        return  # the base itself
    reference = chain(base)
    assert not isinstance(reference, ConfigError), reference
    result = chain(_with(base, path, value))
    if isinstance(result, ConfigError):
        assert path.split(".")[-1] in str(result) and "; " in str(result), f"{name}={value}: unclear refusal {result}"
        return
    assert _differs(result, reference), (f"{name}={value} changed nothing in the stages' output (from "
                                         f"{base or 'the defaults'}): refuse it at load time or make it work")


# ---- the RLVR data-side options through the RLVR chain --------------------------------------------------------------

@pytest.fixture(scope="module")
def rlvr_chain(tmp_path_factory, ray_cluster):
    """Runs ``rollflow score --advantages``'s stages (flows/rlvr.py score_responses) on 24 answers to 6 shipped math
    prompts (4 each; correct, wrong and garbage) under a config of RLVR_BASE plus the given options: the output
    columns, or the ConfigError. The reward workers' and the token table's outputs of the first run are copied into
    each later run's folder: the runner skips them, as a resumed run does, where their fingerprint (the routes, the
    responses) is the same, and runs them again where an option changed it; the options varied here are read by the
    response-rewards and advantages stages, which run for every config (a new actor pool of reward workers per run
    would cost a process start each)."""
    from flows.rlvr import score_responses
    from stages.rlvr.example import RLVRExampleSpec, write_rlvr_example

    root, done, first = tmp_path_factory.mktemp("rlvr-options"), {}, []
    responses = str(root / "responses")
    write_rlvr_example(RLVRExampleSpec(domains=("math",), n=4, limit=6, seed=3), responses)
    lengths = sorted(len(ids) for ids in read_table(responses, ["response_ids"]).column("response_ids").to_pylist())
    base = {"rewards": {"routes": {"math": {"worker": "math_rule"}}}, "num_return_sequences_in_group": 4,
            "adv_estimator": "reinforce", "max_new_tokens": lengths[-1],
            "error_max_len_threshold": lengths[len(lengths) // 2]}

    def run(data: dict):
        key = json.dumps(data, sort_keys=True)
        if key not in done:
            try:
                cfg = validate_config(RLVRConfig, {**base, **data})
            except ConfigError as err:
                done[key] = err
            else:
                out = root / f"run{len(done)}"
                for name in ("scored", "samples") if first else ():
                    shutil.copytree(first[0] / name, out / name)
                score_responses(responses, str(out), cfg, advantages=True)
                if not first:
                    first.append(out)  # the run whose reward-worker and token tables the later runs start from
                done[key] = _outputs(out)
        return done[key]

    return run


@pytest.mark.parametrize("name, value", _cases(RLVR_STAGES))
def test_an_rlvr_option_value_changes_the_chains_output_or_is_refused(name, value, rlvr_chain):
    path, base = RLVR_STAGES[name]
    _check_value(name, value, path, base, rlvr_chain, RLVRConfig.model_fields[path].default)


# ---- the rollout's options through the rollout's stages -------------------------------------------------------------

@pytest.fixture(scope="module")
def rollout_chain(tmp_path_factory, tiny_model, ray_cluster):
    """Runs a rollout (stages/rollout/driver.py run_rollout: reset, turns, samples) of ROLLOUT_BASE plus the given
    options on the tiny random model, all on one HF engine pool: the samples' columns, or the ConfigError."""
    from schemas.rollout_config import RolloutConfig
    from stages.rollout.driver import run_rollout
    from stages.rollout.engine_pool import EnginePool

    root, done = tmp_path_factory.mktemp("rollout-options"), {}
    base = RolloutConfig.model_validate(ROLLOUT_BASE)
    pool = EnginePool(base.engine, str(tiny_model), base.engine.window(base.sequence_length))

    def run(data: dict):
        key = json.dumps(data, sort_keys=True)
        if key not in done:
            try:
                cfg = validate_config(RolloutConfig, _merged(ROLLOUT_BASE, data))
            except ConfigError as err:
                done[key] = err
            else:
                out = root / f"run{len(done)}"
                run_rollout(cfg, str(out), str(tiny_model), pool=pool)
                samples = read_table(out / "samples", ["input_ids", "response_mask"])
                done[key] = {name: np.concatenate([np.asarray(v, np.float64) for v in samples.column(name)
                                                   .to_pylist()] + [np.array([samples.num_rows], np.float64)])
                             for name in samples.column_names}
        return done[key]

    yield run
    pool.close()


def _merged(base: dict, data: dict) -> dict:
    out = json.loads(json.dumps(base))
    for key, value in data.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.mark.parametrize("name, value", _cases(ROLLOUT_STAGES))
def test_a_rollout_option_value_changes_the_samples_or_is_refused(name, value, rollout_chain):
    from schemas.rollout_config import RolloutConfig

    path, base = ROLLOUT_STAGES[name]
    current = RolloutConfig.model_validate(_merged(ROLLOUT_BASE, base))
    for key in path.split("."):
        current = getattr(current, key)
    _check_value(name, value, path, base, rollout_chain, current)


# ---- the combinations that would change nothing are refused at load time --------------------------------------------

RLVR_ROUTES = {"rewards": {"routes": {"*": {"worker": "math_rule"}}}, "num_return_sequences_in_group": 4}


@pytest.mark.parametrize("model, data, option, fix", [
    (RecomputeConfig, {"kl_penalty": "k3"}, "kl_penalty 'k3'", "set add_token_level_kl: true, or remove kl_penalty"),
    (RLVRConfig, {**RLVR_ROUTES, "adv_estimator": "grpo", "norm_std_type": "running"},
     "norm_std_type 'running' is ignored with adv_estimator grpo", "remove norm_std_type, or use adv_estimator "
                                                                    "reinforce"),
    (EngineConfig, {"backend": "hf", "flashinfer_sampler": True}, "flashinfer_sampler: true chooses vLLM's",
     "set flashinfer_sampler: auto (or false), or backend: vllm"),
], ids=["kl_penalty-without-token-kl", "rlvr-norm-type-with-grpo", "flashinfer-with-hf"])
def test_an_option_nothing_reads_is_refused(model, data, option, fix):
    with pytest.raises(ConfigError) as err:
        validate_config(model, data)
    assert option in str(err.value) and fix in str(err.value)


def test_the_same_options_where_something_reads_them_are_accepted():
    validate_config(RecomputeConfig, {"add_token_level_kl": True, "kl_penalty": "k3"})
    validate_config(RecomputeConfig, {"reward_normalization": {"grouping": "tags", "norm_std_type": "group"}})
    # a grouping that no normalisation reads (method identity) stays valid: the shipped configs name their grouping,
    # a run started with `--set reward_normalization.method=identity` froze that pair, and it must resume
    validate_config(RecomputeConfig, {"reward_normalization": {"grouping": "traj_group_id", "method": "identity"}})
    validate_config(RLVRConfig, {**RLVR_ROUTES, "adv_estimator": "grpo", "norm_mean_type": "group"})
    validate_config(RLVRConfig, {**RLVR_ROUTES, "adv_estimator": "reinforce", "norm_std_type": "running"})
    assert validate_config(EngineConfig, {"backend": "hf"}).flashinfer_sampler is False  # auto: false for hf


def test_a_judge_that_no_route_calls_is_refused_for_a_new_run_and_a_frozen_run_still_resumes(tmp_path):
    """The LLM judge's settings (judge.*) were accepted where no reward route calls a model, and nothing read them.
    They are refused for a new run (the route sets of the run and its validation: rollflow eval reads the latter);
    a judge a validation route calls, an empty judge section and a config with every default spelled out (a run's
    config.json) pass; a run folder frozen with such a judge before the refusal passes the run's checks and resumes."""
    from flows.pipeline_specs import PIPELINE_SPECS
    from schemas.config import load_config
    from schemas.rlvr_train_config import RLVRTrainConfig
    from stages.run_folder import check_run, run_folder, save_run_config

    spec = PIPELINE_SPECS.get("rlvr")

    def train(**options) -> RLVRTrainConfig:
        return load_config(RLVRTrainConfig, REPO / "configs/rlvr_train_math.yaml", {"runs_dir": str(tmp_path),
                                                                                   **options})

    judged = train(**{"judge.model": "judge_folder", "judge.engine.options": {"max_batch_size": 2}})
    with pytest.raises(ConfigError) as err:
        check_run(judged, judged.model_dump(mode="json"), spec)
    assert "judge.model, judge.engine.options are set, but no reward route calls a model" in str(err.value)
    assert "remove them, or route a domain to the judge" in str(err.value)
    assert not (tmp_path / judged.run_name).exists()
    spec.refuse_unread(train(**{"judge.model": "m", "validation.rewards.routes.mcq": {"worker": "llm_judge"}}))
    spec.refuse_unread(train(judge=None))
    spec.refuse_unread(validate_config(RLVRTrainConfig, train().model_dump(mode="json")))
    save_run_config(run_folder(judged), judged, judged.model_dump(mode="json"))  # a run started before the refusal
    resumed = validate_config(RLVRTrainConfig, json.loads((tmp_path / judged.run_name / "config.json").read_text()))
    check_run(resumed, resumed.model_dump(mode="json"), spec)
