"""The RLVR stages through Ray and the runner: ROLL's golden chain through the reward stage and both chain stages,
routing by domain, None rows (null in Arrow, out of the statistics, zero advantage), the stage outputs equal the pure
chain on the whole table, a re-run skips, state carried in the manifests, and bad input fails clearly with nothing
committed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyarrow import fs as pafs

from flows.rlvr import score_responses
from schemas.errors import ConfigError, InvariantError, SchemaError
from schemas.rlvr_config import rlvr_advantage_section, rlvr_reward_section
from schemas.tables import SAMPLES
from stages.algos.ragged import Ragged
from stages.algos.rlvr_chain import response_tokens, rlvr_response_rewards
from stages.algos.token_chain import token_batch
from stages.rlvr.stages import SamplesSection, _ToSamples
from tests.golden import assert_close, case_names, load
from tests.rlvr.helpers import (GOLDEN_ROUTE, golden_config, golden_rows, padded, read_folder, responses_table,
                                write_responses)

NORM_TOL = dict(atol=1e-4, rtol=1e-5)
GOLDEN = case_names("chain_rlvr__")[0] if case_names("chain_rlvr__") else None
FLAKY_TRUTHS = ["1", "0", "none", "1", "none", "none", "none", "none", "0", "1", "1", "none"]
ROUTES = {"golden": GOLDEN_ROUTE, "flaky": {**GOLDEN_ROUTE, "kwargs": {"scale": 2.0}}}


def flaky_rows(n: int = 4) -> dict[str, list]:
    """A second domain: 3 prompts × 4 responses, some unscorable (ground_truth 'none'), one group all None."""
    rng = np.random.default_rng(0)
    cols: dict[str, list] = {k: [] for k in golden_rows(load(GOLDEN))}
    for b, truth in enumerate(FLAKY_TRUTHS):
        plen, rlen = 3, int(rng.integers(1, 6))
        old = rng.normal(-1, 0.3, rlen).astype(np.float32)
        values = {"row_id": f"f{b:03d}", "prompt_id": f"f-prompt-{b // n}", "domain": "flaky", "tag": "flaky",
                  "prompt": "p", "ground_truth": truth, "response": "r", "prompt_ids": [5] * plen,
                  "response_ids": [6] * rlen, "finish_reason": "stop", "old_log_probs": old.tolist(),
                  "ref_log_probs": (old - 0.1).tolist()}
        for k, v in values.items():
            cols[k].append(v)
    return cols


def cli_app():
    """The rollflow command line (score and rlvr-example among its commands)."""
    from flows.cli import app

    return app


def invoke(*args: str):
    from typer.testing import CliRunner

    return CliRunner().invoke(cli_app(), list(args))


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory, ray_cluster):
    """ROLL's golden chain case (domain 'golden') plus a domain with unscorable rows, scored and run through the
    chain end to end by ``rollflow score --advantages`` (several files, small batches, domains interleaved)."""
    if GOLDEN is None:
        pytest.skip("golden vectors not found")
    import yaml

    case = load(GOLDEN)
    g, f = golden_rows(case), flaky_rows()
    order = list(range(8)) + list(range(20, 32)) + list(range(8, 20))  # domains interleaved across files
    cols = {k: [(g[k] + f[k])[i] for i in order] for k in g}
    root = tmp_path_factory.mktemp("rlvr-golden")
    responses = write_responses(cols, root / "responses", rows_per_file=7)
    cfg = golden_config(case, rewards={"routes": ROUTES}, runtime__batch_rows=6)
    config_file = root / "golden.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"runtime"})))
    result = invoke("score", "--input", responses, "--config", str(config_file), "--output", str(root / "out"),
                    "--advantages", "--set", "runtime.batch_rows=6")
    assert result.exit_code == 0, result.output
    return {"case": case, "cols": cols, "cfg": cfg, "responses": responses, "out": root / "out",
            "config": str(config_file), "stdout": result.output}


def _in_order(table, row_ids):
    """``table``'s rows in the order of ``row_ids`` (the chain's tables are joined by row_id, not by position)."""
    rows = _by_row(table)
    return table.take([rows[i] for i in row_ids])


def _by_row(table):
    return {rid: i for i, rid in enumerate(table.column("row_id").to_pylist())}


def test_reward_stage_routes_by_domain_and_writes_null_for_none(golden_run):
    cols = golden_run["cols"]
    scored = _in_order(read_folder(str(golden_run["out"] / "scored")), cols["row_id"])
    assert scored.num_rows == len(cols["row_id"])
    got = scored.column("scores").to_pylist()
    for rid, truth, domain, score in zip(cols["row_id"], cols["ground_truth"], cols["domain"], got):
        expected = None if truth == "none" else float(truth) * (2.0 if domain == "flaky" else 1.0)
        assert score == expected, rid
    assert scored.column("scores").null_count == FLAKY_TRUTHS.count("none")
    assert set(scored.column("reward_worker").to_pylist()) == {GOLDEN_ROUTE["worker"]}
    metrics = json.loads((golden_run["out"] / "scored" / "manifest.json").read_text())["metrics"]
    assert metrics[f"rewards/unscored/{GOLDEN_ROUTE['worker']}"] == FLAKY_TRUTHS.count("none")


def test_a_later_reward_stage_scores_in_processes_already_running(golden_run, tmp_path):
    """The reward stage's batches go to Ray tasks, not to an actor pool (which started an actor process for each
    stage, about 1.5 CPU-s before its first batch): a later stage, such as the next iteration's, scores in worker
    processes that were running before it started (Ray keeps idle task workers, stages/cluster.py WORKER_POOL_ENV;
    the module's chain left some). The scores are the scoring processes' ids here, one batch per stage."""
    import os

    from schemas.rlvr_config import RewardsConfig
    from stages.rlvr.stages import RewardStage
    from stages.runner import run_stage
    from stages.watchdog import tree

    section = RewardsConfig(routes={"*": {"worker": "tests.rlvr.workers:process_id_as_score"}})
    responses = write_responses(flaky_rows(), tmp_path / "responses")
    scored = []
    for name in ("first", "second"):
        running = set(tree([os.getpid()]))  # the session's cluster is this process's: its workers are descendants
        run_stage(RewardStage(), section, {"responses": responses}, str(tmp_path / name))
        pids = {int(p) for p in read_folder(str(tmp_path / name)).column("scores").to_pylist()}
        assert pids and pids <= running, (name, pids, "a process was started for the stage")
        scored.append(pids)
    assert os.getpid() not in scored[0] | scored[1]  # scored by Ray's workers, not in this process


def test_golden_chain_through_ray(golden_run):
    case, out = golden_run["case"], golden_run["out"]
    rewarded = read_folder(str(out / "rewarded"))
    advantaged = read_folder(str(out / "advantaged"))
    rows_r, rows_a = _by_row(rewarded), _by_row(advantaged)
    ids = [f"g{b:03d}" for b in range(20)]
    rewards = np.array(rewarded.column("response_level_rewards").to_pylist())[[rows_r[i] for i in ids]]
    assert_close(rewards, case.outputs["response_level_rewards"], **NORM_TOL)
    golden = advantaged.take([rows_a[i] for i in ids])
    width = case.outputs["advantages"].shape[1]
    np.testing.assert_array_equal(padded(golden.column("final_response_mask"), width),
                                  case.outputs["final_response_mask"])
    for name in ("token_level_rewards", "advantages", "returns"):
        assert_close(padded(golden.column(name), width), case.outputs[name], **NORM_TOL, what=name)
    manifest = json.loads((out / "rewarded" / "manifest.json").read_text())
    for key in ("actor/final_mask_ratio", "actor/samples_used", "actor/samples_total", "critic/reward_clip_frac"):
        assert manifest["metrics"][f"golden/{key}"] == pytest.approx(case.metric(key)), key


def test_stage_outputs_equal_the_pure_chain_on_the_whole_table(golden_run):
    cols, cfg, out = golden_run["cols"], golden_run["cfg"], golden_run["out"]
    tokens = response_tokens(Ragged.from_rows(cols["prompt_ids"], np.int32),
                             Ragged.from_rows(cols["response_ids"], np.int32),
                             {c: Ragged.from_rows(cols[c], np.float32) for c in ("old_log_probs", "ref_log_probs")})
    scale = np.array([2.0 if d == "flaky" else 1.0 for d in cols["domain"]])
    scores = np.array([np.nan if t == "none" else float(t) for t in cols["ground_truth"]]) * scale
    pure = rlvr_response_rewards(np.array(cols["prompt_id"]), np.array(cols["domain"]), scores, scores,
                                 tokens.response_len, rlvr_reward_section(cfg), {})
    beta = cfg.init_kl_coef
    batch = token_batch(tokens, pure.rewards, pure.sample_mask, np.array(cols["domain"]),
                             rlvr_advantage_section(cfg), beta)
    rewarded = _in_order(read_folder(str(out / "rewarded")), cols["row_id"])
    advantaged = _in_order(read_folder(str(out / "advantaged")), cols["row_id"])
    # the stage sorts by prompt id before its sums (ROLL does too): equal up to float summation order
    np.testing.assert_allclose(rewarded.column("response_level_rewards").to_numpy(), pure.rewards, rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_array_equal(rewarded.column("sample_mask").to_numpy(), pure.sample_mask)
    np.testing.assert_array_equal(rewarded.column("scored").to_numpy(zero_copy_only=False), pure.scored)
    for name, expected in (("advantages", batch.advantages), ("returns", batch.returns),
                           ("token_level_rewards", batch.token_level_rewards)):
        got = Ragged.from_arrow(advantaged.column(name), np.float32)
        np.testing.assert_array_equal(got.offsets, expected.offsets)
        np.testing.assert_allclose(got.values, expected.values, rtol=1e-6, atol=1e-7)
    manifest = json.loads((out / "advantaged" / "manifest.json").read_text())
    assert manifest["metrics"]["critic/kl"] == pytest.approx(batch.partials["kl_sum"] / batch.partials["rows"])
    assert manifest["metrics"]["critic/kl_coef"] == pytest.approx(beta)
    assert manifest["state"]["kl_ctrl"]["value"] == pytest.approx(beta)  # fixed controller carried
    # the advantaged table holds what training reads, next-token aligned
    lengths = Ragged.from_arrow(advantaged.column("input_ids")).lengths
    assert (Ragged.from_arrow(advantaged.column("old_log_probs")).lengths == lengths - 1).all()


def test_unscored_rows_are_out_of_the_statistics_and_get_zero_advantage(golden_run):
    cols, out = golden_run["cols"], golden_run["out"]
    advantaged = read_folder(str(out / "advantaged"))
    rows = _by_row(advantaged)
    none_ids = [rid for rid, t in zip(cols["row_id"], cols["ground_truth"]) if t == "none"]
    part = advantaged.take([rows[i] for i in none_ids])
    assert not any(part.column("scored").to_pylist())
    assert all(v == 0.0 for row in part.column("advantages").to_pylist() for v in row)
    assert all(v == 0.0 for row in part.column("final_response_mask").to_pylist() for v in row)
    assert set(part.column("response_level_rewards").to_pylist()) == {0.0}
    # group f-prompt-0 = [1, 0, None, 1] ×2: normalised over its three scored rows only
    rewarded = read_folder(str(out / "rewarded"))
    r = dict(zip(rewarded.column("row_id").to_pylist(), rewarded.column("response_level_rewards").to_pylist()))
    x = np.array([2.0, 0.0, 2.0])
    expected = (x - x.mean()) / (x.std(ddof=1) + 1e-6)
    assert_close([r["f000"], r["f001"], r["f003"]], expected, **NORM_TOL)
    assert r["f002"] == 0.0


def test_cli_prints_the_stages_and_a_per_domain_summary_and_a_rerun_skips(golden_run):
    out = golden_run["stdout"]
    assert all(name in out for name in ("scored", "samples", "rewarded", "advantaged", "computed in"))
    flaky = next(line for line in out.splitlines() if line.startswith("flaky"))
    assert flaky.split()[1:4] == ["12", str(FLAKY_TRUTHS.count("none")), f"{np.mean([2, 0, 2, 0, 2, 2]):.3f}"]
    again = invoke("score", "--input", golden_run["responses"], "--config", golden_run["config"], "--output",
                   str(golden_run["out"]), "--advantages", "--set", "runtime.batch_rows=6")
    assert again.exit_code == 0, again.output
    assert again.output.count("up to date, skipped") == 4
    # a run killed before its last stage committed resumes there: the committed stages skip, the output is the same
    import shutil

    before = read_folder(str(golden_run["out"] / "advantaged"))
    shutil.rmtree(golden_run["out"] / "advantaged")
    resumed = invoke("score", "--input", golden_run["responses"], "--config", golden_run["config"], "--output",
                     str(golden_run["out"]), "--advantages", "--set", "runtime.batch_rows=6")
    assert resumed.exit_code == 0, resumed.output
    assert resumed.output.count("up to date, skipped") == 3 and "advantaged" in resumed.output
    after = read_folder(str(golden_run["out"] / "advantaged"))
    assert _in_order(after, before.column("row_id").to_pylist()).equals(before)


def test_score_runs_the_rlvr_declarations_steps_and_force_recomputes_them(golden_run):
    """rollflow score runs the RLVR declaration's own steps (flows/rlvr.py ``RLVR``) outside the loop: the manifests
    record the first values of the state the stages declare they carry, and ``force`` reaches every stage."""
    from flows.loop import first_state
    from flows.rlvr import RLVR, RLVR_ADVANTAGES, RLVR_REWARDS

    assert RLVR_REWARDS in RLVR.iteration and RLVR_ADVANTAGES in RLVR.iteration
    out = golden_run["out"]
    manifests = {name: json.loads((out / name / "manifest.json").read_text())
                 for name in ("scored", "samples", "rewarded", "advantaged")}
    assert manifests["rewarded"]["state_in"] == first_state("response_rewards") == {"running_moments": {}}
    assert manifests["advantaged"]["state_in"] == {} and manifests["samples"]["state_in"] == {}
    before = read_folder(str(out / "advantaged"))
    results = score_responses(golden_run["responses"], str(out), golden_run["cfg"], advantages=True, force=True)
    assert sorted(results) == ["advantaged", "rewarded", "samples", "scored"]
    assert not any(r.skipped for r in results.values())
    assert _in_order(read_folder(str(out / "advantaged")), before.column("row_id").to_pylist()).equals(before)
    again = score_responses(golden_run["responses"], str(out), golden_run["cfg"], advantages=True)
    assert all(r.skipped for r in again.values())


def test_cli_bad_config_exits_2_with_the_rule(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rewards: {routes: {math: {worker: math_rule}}}\nadv_estimator: grpo\n")
    result = invoke("score", "--input", str(tmp_path), "--config", str(bad), "--output", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert "num_return_sequences_in_group (1) must be at least 2" in result.output


def test_running_moments_are_carried_per_domain_in_the_manifest_state(golden_run, tmp_path):
    cfg = golden_run["cfg"].model_copy(update={"adv_estimator": "reinforce", "norm_mean_type": "running",
                                               "norm_std_type": "running"})
    state = {"running_moments": {"golden": {"mean": 0.5, "var": 0.2, "std": 0.45, "count": 10.0}}}
    from stages.response_rewards import ResponseRewardsStage
    from stages.runner import run_stage

    result = run_stage(ResponseRewardsStage(), rlvr_reward_section(cfg),
                       {"samples": str(golden_run["out"] / "samples"), "scored": str(golden_run["out"] / "scored")},
                       str(tmp_path / "rewarded"), state_in=state)
    moments = result.state["running_moments"]
    assert set(moments) == {"golden", "flaky"}
    assert moments["golden"]["count"] == pytest.approx(30.0)  # 10 carried + 20 scored rows
    assert moments["flaky"]["count"] == pytest.approx(12 - FLAKY_TRUTHS.count("none"))


# ---- bad input: clear error, nothing committed ----------------------------------------------------------------------

def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir()) if folder.parent.exists() else []


def test_nan_from_a_custom_worker_is_a_clear_error(golden_run, tmp_path):
    cols = flaky_rows()
    cols["ground_truth"][5] = "nan"
    responses = write_responses(cols, tmp_path / "responses")
    out = tmp_path / "out"
    with pytest.raises(InvariantError, match=r"reward worker 'tests.rlvr.workers:ground_truth_as_score': "
                                             r"scores\[\d+\] = nan is not finite"):
        score_responses(responses, str(out), golden_run["cfg"])
    assert not (out / "scored").exists() and _leftovers(out / "scored") == []


def test_unknown_domain_without_fallback_is_a_config_error(golden_run, tmp_path):
    responses = write_responses(flaky_rows(), tmp_path / "responses")
    cfg = golden_run["cfg"].model_copy(update={"rewards": golden_run["cfg"].rewards.model_copy(
        update={"routes": {"golden": golden_run["cfg"].rewards.routes["golden"]}})})
    with pytest.raises(ConfigError, match=r"domain value\(s\) 'flaky' have no reward route .* fallback"):
        score_responses(responses, str(tmp_path / "out"), cfg)
    assert not (tmp_path / "out").exists()


def test_missing_log_probs_for_token_kl_is_a_schema_error(golden_run, tmp_path):
    """add_token_level_kl needs old and reference log-probs on the samples the advantages stage reads: responses
    without them give a samples table without them, refused before any stage runs (``rollflow score`` checks
    first) and by the stage itself, nothing committed."""
    from flows.loop import Run, run_steps
    from flows.rlvr import SCORING, score_steps
    from stages.advantages import AdvantagesStage
    from stages.preflight import check_steps
    from stages.runner import run_stage

    cols = {k: v for k, v in flaky_rows().items() if k not in ("old_log_probs", "ref_log_probs")}
    responses = write_responses(cols, tmp_path / "responses")
    cfg = golden_run["cfg"]  # add_token_level_kl: true
    assert cfg.add_token_level_kl
    with pytest.raises(SchemaError, match="missing column 'old_log_probs'"):
        check_steps(score_steps(responses, str(tmp_path / "out"), cfg, advantages=True))
    assert not (tmp_path / "out").exists()
    samples = run_steps(SCORING, Run.of_folder(cfg, str(tmp_path / "out"), held={"responses": responses}))["samples"]
    with pytest.raises(SchemaError, match="missing column 'old_log_probs'"):
        run_stage(AdvantagesStage(), rlvr_advantage_section(cfg),
                  {"samples": samples.output, "rewarded": str(golden_run["out"] / "rewarded")},
                  str(tmp_path / "advantaged"))
    assert not (tmp_path / "advantaged").exists()
    # with them, the same check passes: the samples stage carries the responses' log-prob columns
    check_steps(score_steps(golden_run["responses"], str(tmp_path / "out2"), cfg, advantages=True))


# ---- the shipped data sets through Ray: rollflow rlvr-example, then rollflow score --------------------------------

def test_shipped_sets_are_scored_correctly_through_ray(tmp_path, ray_cluster):
    from tests.rlvr.helpers import REPO

    responses = tmp_path / "responses"
    made = invoke("rlvr-example", "--output", str(responses), "--limit", "2", "--samples-per-prompt", "4")
    assert made.exit_code == 0, made.output
    assert "wrote 32 responses to 8 prompts" in made.output
    result = invoke("score", "--input", str(responses), "--config", str(REPO / "configs/rlvr_mixed.yaml"),
                    "--output", str(tmp_path / "out"), "--set", "num_return_sequences_in_group=4")
    assert result.exit_code == 0, result.output
    table = read_folder(str(responses))
    scored = _in_order(read_folder(str(tmp_path / "out" / "scored")), table.column("row_id").to_pylist())
    assert scored.num_rows == table.num_rows
    kinds = table.column("example_kind").to_pylist()
    domains = table.column("domain").to_pylist()
    scores = scored.column("scores").to_pylist()
    workers = scored.column("reward_worker").to_pylist()
    expected_worker = {"math": "math_rule", "code": "code_sandbox", "mcq": "multiple_choice_boxed",
                       "ifeval": "ifeval"}
    assert set(kinds) == {"correct", "incorrect", "garbage"} and list(dict.fromkeys(domains)) == list(expected_worker)
    for domain, kind, score, worker in zip(domains, kinds, scores, workers):
        assert worker == expected_worker[domain]
        if kind == "correct":
            assert score == 1.0, (domain, kind)
        elif kind == "incorrect":
            assert score == 0.0, (domain, kind)
        elif domain != "ifeval":  # an IFEval constraint can hold on any text (e.g. 'at most 20 words')
            assert score in (0.0, None), (domain, kind)
    # through Ray = in process: the same router on the same rows gives the same scores and rewards
    import stages.rewards  # noqa: F401
    from schemas.config import load_config
    from schemas.rlvr_config import RLVRConfig
    from stages.rewards import RewardRouter

    cfg = load_config(RLVRConfig, REPO / "configs/rlvr_mixed.yaml", {"num_return_sequences_in_group": 4})
    router = RewardRouter({d: r.model_dump() for d, r in cfg.rewards.routes.items()}, "domain")
    rows = {c: table.column(c).to_pylist() for c in ("domain", "tag", "prompt", "ground_truth", "response")}
    direct = router.score(rows)
    assert direct.score_list() == scores
    assert_close(scored.column("response_level_rewards").to_numpy(zero_copy_only=False),
                 direct.response_level_rewards)


def test_responses_generated_ahead_get_their_staleness_and_in_turn_no_column(tmp_path):
    """async_generation_ratio > 0 (issue 46): the samples of responses generated ahead carry the training steps
    between the policy that generated them and the one trained on them, as a rollout's samples do (a field of the
    section, so the fingerprint names it); in turn (None) the section dumps as {} — the stage's fingerprint as before
    the field existed — and the table is the same without the column."""
    responses = responses_table(flaky_rows())
    n = responses.num_rows
    pq.write_table(pa.table({"row_id": responses.column("row_id"),
                             "scores": pa.array(np.arange(n), pa.float32())}), tmp_path / "scored.parquet")
    scored = ([str(tmp_path / "scored.parquet")], pafs.LocalFileSystem(), "scored:ahead-test")
    in_turn = _ToSamples(scored, "test")(responses)
    assert "staleness" not in in_turn.column_names and SamplesSection().model_dump() == {}
    ahead = _ToSamples(scored, "test", SamplesSection(staleness=2).staleness)(responses)
    SAMPLES.check_schema(ahead.schema, "test", ("staleness",))
    assert ahead.column("staleness").type == pa.int32() and ahead.column("staleness").to_pylist() == [2] * n
    assert ahead.drop_columns(["staleness"]).equals(in_turn)
    assert SamplesSection(staleness=2).model_dump() == {"staleness": 2}


# ---- the generate service hook of the LLM judge (no Ray: the actor class in process, the driver-side check) -------

def test_judge_without_a_generate_service_fails_before_any_row_is_scored(tmp_path):
    from schemas.rlvr_config import RewardsConfig
    from stages.rlvr.stages import RewardStage
    from stages.runner import run_stage

    responses = write_responses(flaky_rows(), tmp_path / "responses")
    section = RewardsConfig(routes={"*": {"worker": "llm_judge"}})
    with pytest.raises(ConfigError, match=r"worker 'llm_judge' needs the run-time service\(s\) \['generate'\]"):
        run_stage(RewardStage(), section, {"responses": responses}, str(tmp_path / "scored"))
    assert not (tmp_path / "scored").exists()


def test_bad_worker_kwargs_fail_on_the_driver_naming_the_route(tmp_path):
    from schemas.rlvr_config import RewardsConfig
    from stages.rlvr.stages import RewardStage
    from stages.runner import run_stage

    responses = write_responses(flaky_rows(), tmp_path / "responses")
    section = RewardsConfig(routes={"flaky": {"worker": "math_rule", "kwargs": {"timeout": 3}}})
    with pytest.raises(ConfigError, match=r"rewards.routes.flaky: reward worker 'math_rule': bad kwargs \['timeout'\]"):
        run_stage(RewardStage(), section, {"responses": responses}, str(tmp_path / "scored"))
    assert not (tmp_path / "scored").exists()


def test_generate_service_factory_plugs_into_the_judge_inside_the_actor():
    from stages.rlvr.stages import ScoreBatch
    from tests.rlvr.helpers import responses_table
    from tests.rlvr.workers import keyword_judge_service

    cols = flaky_rows()
    cols["ground_truth"] = ["Paris"] * 12
    cols["response"] = ["It is Paris.", "It is Rome.", "???"] * 4
    actor = ScoreBatch({"*": {"worker": "llm_judge", "kwargs": {}}}, "domain",
                       {"generate": keyword_judge_service}, "(test)")
    out = actor(responses_table(cols))
    assert out.column("scores").to_pylist() == [1.0, 0.0, None] * 4
    assert out.column("reward_worker").to_pylist() == ["llm_judge"] * 12


# ---- the LLM judge served by a generation engine ------------------------------------------------------------------

def test_llm_judge_is_served_by_a_generation_engine(tmp_path, ray_cluster):
    """``rollflow score`` with an llm_judge route starts an engine over the judge model (the tiny random model on
    the HF engine here) and every row goes through it; its unparseable verdicts are 'cannot score' (null)."""
    import yaml

    from stages.generation.model_store import tiny_random_model_dir
    from stages.rlvr.generate import EngineGenerate
    from stages.rollout.engine_pool import EnginePool
    from schemas.rollout_config import EngineConfig

    pool = EnginePool(EngineConfig(backend="hf", dtype="float32", num_cpus_per_engine=0, threads=1),
                      tiny_random_model_dir(), 512)
    try:
        generate = EngineGenerate(pool.handles(), max_new_tokens=4, sequence_length=512)()
        texts = generate(["first question", "second", "third"])
        assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
        assert generate(["first question"]) == texts[:1], "greedy and seeded: the same prompt, the same verdict"
    finally:
        pool.close()

    responses = tmp_path / "responses"
    made = invoke("rlvr-example", "--output", str(responses), "--domains", "math", "--limit", "2",
                  "--samples-per-prompt", "2")
    assert made.exit_code == 0, made.output
    config = tmp_path / "judge.yaml"
    config.write_text(yaml.safe_dump({"rewards": {"routes": {"math": {"worker": "llm_judge"}}},
                                      "num_return_sequences_in_group": 2, "adv_estimator": "grpo",
                                      "judge": {"engine": {"backend": "hf", "dtype": "float32", "threads": 1},
                                                "max_new_tokens": 16, "sequence_length": 512}}))
    # the judge's engine comes from the config's judge section, its model from the command line
    result = invoke("score", "--input", str(responses), "--config", str(config), "--output", str(tmp_path / "out"),
                    "--judge-model", tiny_random_model_dir())
    assert result.exit_code == 0, result.output
    scored = read_folder(str(tmp_path / "out" / "scored"))
    assert scored.num_rows == 4 and set(scored.column("reward_worker").to_pylist()) == {"llm_judge"}
    metrics = json.loads((tmp_path / "out" / "scored" / "manifest.json").read_text())["metrics"]
    assert metrics["rewards/unscored/llm_judge"] == scored.column("scores").null_count  # replies without a verdict


def test_a_judge_engine_that_would_starve_the_reward_stage_is_refused(ray_cluster):
    """On the 2-CPU test cluster a judge engine holding 1.5 CPUs leaves the reward stage less than one: refused with
    the fix before any engine starts; the default judge engine reserves none."""
    from schemas.rlvr_config import JudgeEngineConfig
    from stages.rlvr.generate import check_judge_cpus

    with pytest.raises(ConfigError, match=r"judge.engine reserves 1.5 of the Ray cluster's 2 CPUs.*"
                                          r"num_cpus_per_engine: 0"):
        check_judge_cpus(JudgeEngineConfig(num_cpus_per_engine=1.5))
    check_judge_cpus(JudgeEngineConfig())
