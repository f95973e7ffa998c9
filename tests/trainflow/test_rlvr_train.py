"""The RLVR training flow (``pipeline: rlvr``): its config rules, the prompt order, and a real three-step run on the
tiny random model (HF engine, Ray Data stages, the real reward workers, DeepSpeed), generating one step ahead, that
a second call resumes with every stage skipped."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from schemas.config import load_config, validate_config
from schemas.errors import ConfigError
from schemas.rlvr_config import rlvr_reward_section
from schemas.rlvr_train_config import RLVRTrainConfig
from stages.algos.intervals import wilson
from stages.rlvr.generate import prompts_section, read_prompt_rows, step_prompt_ids
from tests.processes import rollflow_here

REPO = Path(__file__).resolve().parents[2]
# one step's stages in ROLL's order (values too, for GAE)
STAGES = ("responses", "scored", "samples", "logprobs", "rewarded", "advantaged", "checkpoint")


def test_shipped_rlvr_config_validates():
    cfg = load_config(RLVRTrainConfig, REPO / "configs/rlvr_train_math.yaml")
    assert cfg.pipeline == "rlvr" and cfg.train_step_config().adv_estimator == cfg.adv_estimator == "grpo"
    # the max_len_mask budget is the generation's
    assert rlvr_reward_section(cfg).max_new_tokens == cfg.generating_args.max_new_tokens
    assert validate_config(RLVRTrainConfig, cfg.model_dump(mode="json")) == cfg


@pytest.mark.parametrize("data, words", [
    ({"add_token_level_kl": True, "logprobs": {"enable_reference": False}}, ["enable_reference: true"]),
    ({"max_new_tokens": 7, "generating_args": {"max_new_tokens": 9}}, ["differs", "generating_args.max_new_tokens"]),
    ({"train": {"use_kl_loss": True}, "logprobs": {"enable_reference": False}}, ["enable_reference: true"]),
    ({"num_return_sequences_in_group": 1}, ["at least 2"]),
])
def test_rlvr_run_rules_give_the_fix(data, words):
    base = {"rewards": {"routes": {"math": {"worker": "math_rule"}}}, "num_return_sequences_in_group": 4,
            "adv_estimator": "grpo"}
    with pytest.raises(ConfigError) as err:
        validate_config(RLVRTrainConfig, {**base, **data})
    for word in words:
        assert word in str(err.value)


def test_step_prompts_cover_each_epoch_once_and_are_reproducible():
    ids = [f"p{i}" for i in range(10)]
    epoch0 = [p for k in range(3) for p in step_prompt_ids(ids, k, 3, seed=1)]
    assert len(epoch0) == len(set(epoch0)) == 9  # 3 full batches, the last partial batch of the epoch dropped
    assert step_prompt_ids(ids, 3, 3, seed=1) != step_prompt_ids(ids, 0, 3, seed=1)  # a new epoch, a new order
    assert step_prompt_ids(ids, 2, 3, seed=1) == step_prompt_ids(ids, 2, 3, seed=1)
    assert len(step_prompt_ids(ids[:2], 0, 3, seed=1)) == 2  # a data set smaller than a batch: all of it


def test_prompt_files_errors_name_the_file_line_and_fix(tmp_path):
    with pytest.raises(ConfigError, match="found: none"):
        prompts_section(str(tmp_path), ("math",), None)
    (tmp_path / "math.jsonl").write_text('{"id": "a", "prompt": "1+1?", "ground_truth": "2"}\n{"id": "a"}\n')
    with pytest.raises(ConfigError, match=r"math.jsonl, line 2: .*'prompt'"):  # the pre-flight reads the rows
        prompts_section(str(tmp_path), ("math",), None)
    section = prompts_section(str(tmp_path), ("math",), 1)  # the rows a limit leaves out are not read
    assert [row["prompt_id"] for row in read_prompt_rows(section)] == ["a"]
    (tmp_path / "math.jsonl").write_text('{"id": "a", "prompt": "x", "ground_truth": "2"}\n' * 2)
    with pytest.raises(ConfigError, match="occurs twice"):
        prompts_section(str(tmp_path), ("math",), None)
    (tmp_path / "math.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="math.jsonl holds no prompts"):
        prompts_section(str(tmp_path), ("math",), None)


def test_the_prompts_folder_is_recorded_relative_to_the_checkout(tmp_path, monkeypatch):
    """The shipped data set (and any folder inside the checkout, however it is named) is recorded as data/rlvr, the
    same from every clone; a folder elsewhere by its absolute path; prompts_dir reads both back."""
    from stages.rlvr.generate import prompts_dir

    shipped = prompts_section(None, ("math",), 2)
    assert shipped.data_dir == "data/rlvr" and prompts_dir(shipped.data_dir) == REPO / "data/rlvr"
    monkeypatch.chdir(REPO / "data")
    assert prompts_section("rlvr", ("math",), 2) == shipped  # relative to the working directory, inside the checkout
    assert prompts_section(str(REPO / "data/rlvr"), ("math",), 2) == shipped
    (tmp_path / "math.jsonl").write_bytes((REPO / "data/rlvr/math.jsonl").read_bytes())
    elsewhere = prompts_section(str(tmp_path), ("math",), 2)
    assert elsewhere.data_dir == str(tmp_path.resolve()) and prompts_dir(elsewhere.data_dir) == tmp_path.resolve()
    assert elsewhere.digest == shipped.digest and read_prompt_rows(elsewhere) == read_prompt_rows(shipped)


def test_a_prompts_table_recorded_with_a_checkout_that_moved_resumes(tmp_path, ray_cluster):
    """A run folder of an earlier version recorded the shipped prompts by the absolute path of its checkout: after
    the checkout moved (here: the old copy is gone), the run's committed prompts table resumes with its own record
    (the same files, by digest) instead of being refused as written with another config; other files still are."""
    from flows.rlvr import prompts_task
    from schemas.errors import RollflowError
    from schemas.rlvr_train_config import PromptSetConfig
    from stages.rlvr.generate import PromptsSection, PromptsStage
    from stages.runner import run_stage

    old_checkout = tmp_path / "old-clone/data/rlvr"
    old_checkout.mkdir(parents=True)
    (old_checkout / "math.jsonl").write_bytes((REPO / "data/rlvr/math.jsonl").read_bytes())
    recorded = {**prompts_section(None, ("math",), 3).model_dump(), "data_dir": str(old_checkout)}
    output = str(tmp_path / "run/prompts")
    first = run_stage(PromptsStage(), PromptsSection(**recorded), {}, output)
    (old_checkout / "math.jsonl").unlink()
    with pytest.raises(RollflowError, match="another config"):  # the record alone, without the resume rule
        run_stage(PromptsStage(), prompts_section(None, ("math",), 3), {}, output)
    resumed = prompts_task.fn(PromptSetConfig(domains=("math",), limit=3), output)
    assert resumed.skipped and resumed.fingerprint == first.fingerprint
    with pytest.raises(RollflowError, match="another config"):
        prompts_task.fn(PromptSetConfig(domains=("math",), limit=2), output)


def test_a_run_folder_of_the_two_pass_layout_is_refused_with_the_fix(tmp_path):
    """RLVR runs written before the one-pipeline change (advantages on the responses, step_*/first_pass) are
    refused before anything starts, naming the folder and the way out; a new or current run folder passes."""
    from flows.rlvr import refuse_old_layout
    from schemas.errors import RollflowError
    from stages.storage import Location

    refuse_old_layout(Location.of(str(tmp_path / "new")))
    (tmp_path / "old/step_0000/first_pass").mkdir(parents=True)
    with pytest.raises(RollflowError, match=r"old was written by an earlier rollflow.*Start a new run"):
        refuse_old_layout(Location.of(str(tmp_path / "old")))
    advantaged = tmp_path / "old2/step_0000/advantaged"
    advantaged.mkdir(parents=True)
    (advantaged / "manifest.json").write_text(json.dumps({"stage": "rlvr_advantages"}))
    with pytest.raises(RollflowError, match="rlvr_advantages"):
        refuse_old_layout(Location.of(str(tmp_path / "old2")))
    (advantaged / "manifest.json").write_text(json.dumps({"stage": "advantages"}))
    refuse_old_layout(Location.of(str(tmp_path / "old2")))
    (tmp_path / "old2/step_0000/rlvr_rewarded").mkdir()  # rewards by the separate RLVR stage
    with pytest.raises(RollflowError, match=r"separate RLVR stage \(step_\*/rlvr_rewarded.*Start a new run"):
        refuse_old_layout(Location.of(str(tmp_path / "old2")))


def _read(folder: Path):
    """A committed table folder (its Parquet parts, not the manifest)."""
    return pads.dataset(sorted(str(p) for p in folder.glob("*.parquet")), format="parquet").to_table()


STEPS = 3  # the run's steps: the third plays the policy after one step, one step behind


def _tiny_run(tmp_path: Path, *sets: str) -> list[str]:
    """``rollflow train`` arguments of a three-step RLVR run on the tiny random model (HF engine)."""
    from stages.generation.model_store import tiny_random_model_dir

    args = ["train", "--config", str(REPO / "configs/rlvr_train_math.yaml"), "--set", "run_name=r",
            "--set", f"runs_dir={tmp_path}", "--set", f"max_steps={STEPS}",
            "--set", f"pretrain={tiny_random_model_dir()}",
            "--set", "engine.backend=hf", "--set", "engine.options={}", "--set", "rollout_batch_size=2",
            "--set", "num_return_sequences_in_group=2",
            "--set", "generating_args.max_new_tokens=8", "--set", "train.actor_train.model_args.dtype=fp32",
            "--set", "train.actor_train.training_args.per_device_train_batch_size=2"]
    for item in sets:
        args += ["--set", item]
    return args


# validation before training and after every second step, on 2 MCQ prompts scored by the general validation rule
VALIDATION = ("validation.eval_steps=2", "validation.prompts.limit=2")


@dataclass(frozen=True)
class RLVRRun:
    """The module's one RLVR run and how it was started."""

    tmp: Path  # its runs_dir (the run folder is tmp/r)
    args: list[str]  # its ``rollflow train`` arguments
    stdout: str  # its console


@pytest.fixture(scope="module")
def rlvr_run(tmp_path_factory, prefect_server, ray_cluster) -> RLVRRun:
    """One three-step RLVR run that takes every path the two run tests check, in ROLL's order: GAE (the critic's
    values and its training), the token-level KL reward (old and reference log-probs), validation before training
    and after step 1, and generation one step ahead (``async_generation_ratio: 1``) with the train/infer importance
    weight. The actor's learning rate is 0.05, so that a policy one step behind samples with other log-probs: GAE's
    advantages (the critic's values; the tiny random model never answers a math prompt right, so every score is 0)
    move the tiny policy. The command runs in this process (``rollflow_here``, on the session's Ray cluster and
    Prefect server); ``rollflow`` as a process (its exit status and console) is the same entry point for both flows,
    run as one in tests/trainflow/test_async_rollout.py (its two-node run)."""
    tmp = tmp_path_factory.mktemp("rlvr")
    args = _tiny_run(tmp, "adv_estimator=gae", "add_token_level_kl=true", "init_kl_coef=0.1",
                     "logprobs.enable_reference=true", "train.critic_train.model_args.dtype=fp32",
                     "train.critic_train.training_args.per_device_train_batch_size=2", *VALIDATION,
                     "async_generation_ratio=1", "train.actor_train.training_args.learning_rate=0.05")
    done = rollflow_here(*args, api_url=prefect_server.api_url)
    assert done.exit_code == 0, done.output[-3000:]
    return RLVRRun(tmp, args, done.stdout)


@pytest.mark.slow
def test_rlvr_run_with_gae_and_token_kl_end_to_end_then_resume_skips_everything(rlvr_run, prefect_server):
    """The module's run takes both RLVR paths which need the token table's forward passes, in ROLL's order and one
    pass: the token-level KL reward (log-probs, old under the step's policy and ref under the initial one, on the
    step's samples before the advantages) and GAE (the critic's values — a new seeded head at step 0, the trained
    critic after — returns = raw advantages + values on every response token, and each step trains the actor and
    the critic). ``rollflow eval`` on a checkpoint gives the run's own validation of it, and a second call resumes
    with every stage skipped."""
    import numpy as np

    tmp_path, args = rlvr_run.tmp, rlvr_run.args
    run = tmp_path / "r"
    assert (run / "prompts/manifest.json").exists()
    prompts = _read(run / "prompts")
    assert prompts.num_rows == 50 and set(prompts.column("domain").to_pylist()) == {"math"}
    for k in range(STEPS):
        step = run / f"step_{k:04d}"
        for stage in (*STAGES, "values"):
            assert (step / stage / "manifest.json").exists(), (k, stage)
        responses = _read(step / "responses")
        assert responses.num_rows == 4 and len(set(responses.column("prompt_id").to_pylist())) == 2
        assert set(responses.column("prompt_id").to_pylist()) <= set(prompts.column("prompt_id").to_pylist())
        scored = _read(step / "scored")
        assert set(scored.column("reward_worker").to_pylist()) == {"math_rule"}
        logprobs = _read(step / "logprobs").sort_by("row_id")
        values = _read(step / "values").sort_by("row_id")
        trained = _read(step / "advantaged").sort_by("row_id")
        assert {"final_response_mask", "old_log_probs", "ref_log_probs", "advantages"} <= set(trained.column_names)
        assert trained.column("row_id").to_pylist() == logprobs.column("row_id").to_pylist()
        for name in ("old_log_probs", "ref_log_probs"):  # one pass: the log-prob stage's columns, as they are
            assert trained.column(name).to_pylist() == logprobs.column(name).to_pylist(), name
        assert trained.column("values").to_pylist() == values.column("values").to_pylist()
        samples = _read(step / "samples").sort_by("row_id")
        assert samples.column("input_ids").to_pylist() == trained.column("input_ids").to_pylist()
        for v, ret, raw, mask in zip(*(trained.column(c).to_pylist() for c in ("values", "returns", "raw_advantages",
                                                                               "final_response_mask"))):
            on = np.asarray(mask) > 0
            assert np.allclose(np.asarray(ret)[on], np.asarray(raw)[on] + np.asarray(v)[on], atol=1e-5)
        manifest = json.loads((step / "checkpoint/manifest.json").read_text())
        assert {"actor/pg_loss", "critic/loss"} <= set(manifest["metrics"])
        assert (step / "checkpoint/critic").is_dir()
    first_values = _read(run / "step_0000/values").sort_by("row_id").column("values")
    assert first_values.to_pylist() != _read(run / "step_0001/values").sort_by("row_id").column("values").to_pylist()
    kl = json.loads((run / "step_0001/advantaged/manifest.json").read_text())
    assert kl["metrics"]["critic/kl_coef"] == pytest.approx(0.1) and "kl_ctrl" in kl["state"]
    metrics = pads.dataset(str(run / "metrics"), format="parquet").to_table().to_pylist()
    assert {m["stage"] for m in metrics} >= {"generate", "rewards", "advantages", "logprobs", "train"}

    # validation: before training and after step 1 (eval_steps 2), the general validation rule scoring MCQ answers
    for folder in (run / "val_base", run / "step_0001/validation"):
        scored = _read(folder / "scored")
        assert scored.num_rows == 2 and set(scored.column("reward_worker").to_pylist()) == {"general_val_rule"}
    assert not (run / "step_0000/validation").exists() and not (run / "step_0002/validation").exists()
    validated = [m for m in metrics if m["stage"] == "validation" and m["name"] == "val/score/mean"]
    assert sorted(m["iteration"] for m in validated) == [0, 2]  # the policy after 0 and after 2 steps
    by_name = {(m["iteration"], m["name"]): m["value"] for m in metrics if m["stage"] == "validation"}
    for it in (0, 2):  # the interval the report draws, Wilson's over the 2 scored rows (MCQ scores are 0 or 1)
        assert by_name[(it, "val/scored")] == 2.0
        assert by_name[(it, "val/score/ci95_low")] <= by_name[(it, "val/score/mean")] <= \
            by_name[(it, "val/score/ci95_high")]
        assert (by_name[(it, "val/score/ci95_low")], by_name[(it, "val/score/ci95_high")]) == \
            pytest.approx(wilson(2 * by_name[(it, "val/score/mean")], 2))
    assert "val score" in rlvr_run.stdout

    # rollflow eval on step 1's checkpoint gives the run's own validation after that step
    config = args[1:]  # --config FILE --set ...
    evaluated = rollflow_here("eval", *config, "--checkpoint", str(run / "step_0001/checkpoint"), "--output",
                              str(tmp_path / "eval"), api_url=prefect_server.api_url)
    assert evaluated.exit_code == 0, evaluated.output[-3000:]
    assert "val/score/mean" in evaluated.stdout and "val/mcq/score/mean" in evaluated.stdout
    for table in ("responses", "scored"):
        got = _read(tmp_path / "eval" / table).sort_by("row_id").to_pylist()
        assert got == _read(run / "step_0001/validation" / table).sort_by("row_id").to_pylist(), table

    stamps = {p: p.stat().st_mtime_ns for p in run.glob("step_*/*/manifest.json")}
    again = rollflow_here("train", "--resume", str(run), "--no-report", api_url=prefect_server.api_url)
    assert again.exit_code == 0, again.output[-3000:]
    assert {p: p.stat().st_mtime_ns for p in run.glob("step_*/*/manifest.json")} == stamps
    assert len(stamps) == STEPS * (len(STAGES) + 1)  # the values too


@pytest.mark.slow
def test_rlvr_run_generating_one_step_ahead_trains_on_stale_responses_weighed_by_the_engine_log_probs(rlvr_run):
    """``async_generation_ratio: 1`` in the RLVR pipeline (issue 46), on the module's run: the one loop plays step
    k + 1's generation while step k's scoring, log-probs, values, rewards, advantages and training run, with the
    policy one step behind the trained one (the responses' manifest names it); every sample carries that staleness
    from the samples table to the one training reads, and training weighs its tokens by ROLL's token-level importance
    weight against the engine's recorded log-probs (``infer_logprobs``)."""
    import numpy as np

    from stages.generation.model_store import tiny_random_model_dir

    run = rlvr_run.tmp / "r"
    base = str(Path(tiny_random_model_dir()).resolve())
    policy = [base] + [str((run / f"step_{k:04d}/checkpoint").resolve()) for k in range(STEPS)]
    for k in range(STEPS):
        step = run / f"step_{k:04d}"
        played = json.loads((step / "responses/manifest.json").read_text())["state_in"]["checkpoint"]["path"]
        trained = json.loads((step / "logprobs/manifest.json").read_text())["section"]["checkpoint"]
        assert played == policy[max(0, k - 1)] and Path(trained).resolve() == Path(policy[k]), (k, played, trained)
        for stage in ("samples", "logprobs", "advantaged"):  # the staleness, from the samples to the trained table
            assert set(_read(step / stage).column("staleness").to_pylist()) == {min(k, 1)}, (k, stage)
        section = json.loads((step / "checkpoint/manifest.json").read_text())["section"]
        assert section["train_infer_correction"]["is_weight"] == {"enabled": True, "weight_type": "token",
                                                                  "upper_bound": 1.2}, (k, section)
    metrics = pads.dataset(str(run / "metrics"), format="parquet").to_table().to_pylist()
    stale = {m["iteration"]: m["value"] for m in metrics if m["name"] == "rollout/staleness"}
    assert stale == {0: 0.0, 1: 1.0, 2: 1.0} and {m["stage"] for m in metrics if m["name"] == "rollout/staleness"} \
        == {"generate"}, stale
    assert "played with the policy 1 step behind" in rlvr_run.stdout

    # the weight is e^(old - infer) against the engine's log-probs the responses recorded (infer_logprobs, next-token
    # aligned, 0 off the response): float32 noise apart at step 0 (played with the trained policy), a step apart after
    def mismatch(k: int) -> float:
        table = _read(run / f"step_{k:04d}/advantaged").select(["old_log_probs", "infer_logprobs"]).to_pylist()
        old, infer = (np.concatenate([row[name] for row in table]) for name in ("old_log_probs", "infer_logprobs"))
        sampled = infer != 0
        assert sampled.any()
        return float(np.abs(old - infer)[sampled].mean())

    assert mismatch(1) > 20 * mismatch(0) and mismatch(2) > 20 * mismatch(0), [mismatch(k) for k in range(3)]
    # ... and the step's own figure of it (ROLL's train_infer_ratio_token_mean: the sequence mean of each row's token
    # mean of e^(old - infer) over the trained tokens) is that of the table it read: 1 at step 0, not at the stale steps
    ratios = []
    for k in range(STEPS):
        rows = _read(run / f"step_{k:04d}/advantaged").select(
            ["old_log_probs", "infer_logprobs", "final_response_mask"]).to_pylist()
        means = [float(np.sum(np.exp(np.subtract(r["old_log_probs"], r["infer_logprobs"])) * r["final_response_mask"])
                       / np.sum(r["final_response_mask"])) for r in rows if np.sum(r["final_response_mask"]) > 0]
        logged = json.loads((run / f"step_{k:04d}/checkpoint/manifest.json").read_text())["metrics"]
        assert logged["actor/train_infer_ratio_token_mean@sum"] == pytest.approx(np.mean(means), rel=1e-5), k
        ratios.append(np.mean(means))
    assert ratios[0] == pytest.approx(1.0, abs=1e-4) and all(abs(r - 1) > 0.01 for r in ratios[1:]), ratios
