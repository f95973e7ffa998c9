"""Response-level algorithms: reward normalisation, discounted step returns, GiGPO state groups, response-level
rewards, sample masks (ALGORITHMS.md §1.9, §3, §5). Golden conformance (every relevant case), hand-computed cases,
loop references, invariances and bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from schemas.errors import ConfigError, InvariantError, SchemaError
from stages.algos.ragged import Ragged
from stages.algos.reward_norm import (
    RunningMoments,
    agentic_reward_norm,
    batch_moments,
    canonical_method,
    clip_fraction,
    group_reward_norm,
    resolve_norm_types,
    resolve_rlvr_norm_types,
    reward_norm,
    reward_postprocess,
)
from stages.algos.response_rewards import (
    RESPONSE_REWARD_KINDS,
    RewardNormSettings,
    agentic_response_level_mask,
    build_state_group,
    compute_response_level_rewards,
    discounted_returns,
    gigpo_step_norm_types,
)
from stages.algos.sample_masks import difficulty_mask, get_eos_mask, get_pad_mask, get_sample_level_mask
from tests.golden import assert_close, case_names, load

NORM_TOL = dict(atol=1e-4, rtol=1e-5)  # golden README: whitened / normalised values
PLAIN_TOL = dict(atol=1e-6, rtol=1e-5)
# The estimator registry's response_reward values (stages/algos/estimators.py), restated for the golden cases.
RESPONSE_REWARD_OF = {"gigpo": "gigpo", "step_reinforce": "step_return"}


def _none(value):
    """Golden params spell a missing type as JSON null or the string "None"."""
    return None if value in (None, "None") else value


# ---- independent references (loops over groups, written from the spec text) -----------------------------------------
def ref_agentic_norm(x, keys, mean_type, std_type):
    x = np.asarray(x, dtype=np.float64)
    keys = np.zeros(len(x), dtype=int) if keys is None else np.asarray(keys)
    mu_b, sd_b = x.mean(), (x.std(ddof=1) if len(x) > 1 else np.nan)
    out = np.zeros_like(x)
    for key in set(keys.tolist()):
        rows = np.flatnonzero(keys == key)
        g = x[rows]
        mean = {"batch": mu_b, "group": g.mean(), None: 0.0}[mean_type]
        if std_type is None:
            out[rows] = g - mean
            continue
        std = sd_b if std_type == "batch" else (g.std(ddof=1) if len(g) > 1 else np.nan)
        out[rows] = (g - mean) / (std + 1e-6) if len(g) > 1 and abs(std) > 1e-6 else 0.0
    return out


def ref_rlvr_norm_fixed(r, n, mean_type, std_type):
    """BUG-3 corrected §3.2 without running statistics: every row uses its own group's statistics."""
    r = np.asarray(r, dtype=np.float64)
    out = np.empty_like(r)
    for start in range(0, len(r), n):
        g = r[start:start + n]
        mean = {"batch": r.mean(), "group": g.mean(), None: 0.0}[mean_type]
        std = {"batch": r.std(ddof=1), "group": g.std(ddof=1), None: None}[std_type]
        out[start:start + n] = (g - mean) if std is None else (g - mean) / (std + 1e-6)
    return out


def ref_discounted(traj_id, step, scores, gamma):
    out = np.zeros(len(scores), dtype=np.float64)
    for traj in set(np.asarray(traj_id).tolist()):
        rows = [i for i in range(len(scores)) if traj_id[i] == traj]
        rows.sort(key=lambda i: step[i])
        g = 0.0
        for i in reversed(rows):
            g = scores[i] + gamma * g
            out[i] = g
    return out.astype(np.float32)


def same_partition(a, b) -> bool:
    """True when the two key columns group the rows identically (ids may be spelt differently)."""
    ia = np.unique(np.asarray(a), return_inverse=True)[1].reshape(-1)
    ib = np.unique(np.asarray(b), return_inverse=True)[1].reshape(-1)
    pairs = set(zip(ia.tolist(), ib.tolist()))
    return len(pairs) == len(set(ia.tolist())) == len(set(ib.tolist()))


# ======================================================================================================================
# §5.2 agentic_reward_norm and the RewardNormalizationConfig resolution
# ======================================================================================================================
@pytest.mark.parametrize("name", case_names("agentic_reward_norm__"))
def test_agentic_reward_norm_golden(name):
    case = load(name)
    p = case.params
    keys = None if p["grouping"] == "batch" else case.inputs[p["grouping"]]
    out = agentic_reward_norm(case.inputs["scores"], keys, p["norm_mean_type"], p["norm_std_type"])
    assert out.dtype == np.float32 and out.shape == case.outputs["normalized"].shape
    assert_close(out, case.outputs["normalized"], **NORM_TOL, what=name)
    assert_close(out, ref_agentic_norm(case.inputs["scores"], keys, p["norm_mean_type"], p["norm_std_type"]),
                 **NORM_TOL, what=f"{name} vs reference")


def test_agentic_reward_norm_hand_cases():
    x = np.array([1.0, 3.0, 5.0, 5.0, 7.0], dtype=np.float32)
    keys = np.array(["a", "a", "b", "b", "c"])
    # group a: mean 2, std sqrt(2); group b: std 0 → zeros; group c: singleton → zeros
    out = agentic_reward_norm(x, keys, "group", "group")
    s = np.sqrt(2.0)
    assert_close(out, [-1 / (s + 1e-6), 1 / (s + 1e-6), 0, 0, 0])
    # Q-9 kept: a singleton group gives 0 even with a batch std
    out = agentic_reward_norm(x, keys, "batch", "batch")
    mu, sd = x.mean(), x.std(ddof=1)
    assert out[4] == 0.0
    assert_close(out[:4], (x[:4] - mu) / (sd + 1e-6))
    # no std: plain centring, singleton groups included
    assert_close(agentic_reward_norm(x, keys, "group", None), [-1, 1, 0, 0, 0])
    assert_close(agentic_reward_norm(x, None, None, None), x)


def test_agentic_reward_norm_injected_batch_stats_match_whole_table():
    rng = np.random.default_rng(0)
    x = rng.normal(size=40).astype(np.float32)
    keys = np.repeat(np.arange(10), 4).astype(str)
    whole = agentic_reward_norm(x, keys, "batch", "batch")
    mean, std = batch_moments(x)
    blocks = [agentic_reward_norm(x[s], keys[s], "batch", "batch", batch_mean=mean, batch_std=std)
              for s in (slice(0, 16), slice(16, 40))]  # blocks hold whole groups
    np.testing.assert_array_equal(np.concatenate(blocks), whole)
    assert not np.allclose(agentic_reward_norm(x[:16], keys[:16], "batch", "batch"), whole[:16])


def test_resolution_golden_table():
    case = load("reward_normalization_config__resolution")
    for method, grouping, mean_type, std_type, method_after in case.outputs["table"]:
        explicit = re.fullmatch(r"(\w+)\(explicit mean=(\w+),std=(\w+)\)", method)
        kwargs = {}
        if explicit:
            method, kwargs = explicit[1], dict(norm_mean_type=_none(explicit[2]), norm_std_type=_none(explicit[3]))
        assert tuple(resolve_norm_types(grouping, method, **kwargs)) == (_none(mean_type), _none(std_type)), method
        assert canonical_method(method) == method_after


def test_resolution_explicit_wins_and_none_does_not_override():
    assert resolve_norm_types("traj_group_id", "mean_std", "batch", None) == ("batch", "group")
    assert resolve_norm_types("batch", "identity", None, "group") == (None, "group")
    assert resolve_norm_types("tags", "mean", None, None) == ("group", None)


# ======================================================================================================================
# §3.1 RunningMoments, §3.2 reward_norm, §3.3 reward_postprocess, §3.4 group_reward_norm
# ======================================================================================================================
def test_running_moments_golden_sequence():
    case = load("running_moments__sequence")
    running = RunningMoments()
    for i, expected in enumerate(case.outputs["per_update"]):
        batch_mean, batch_std = running.update(case.inputs[f"update{i}_xs"])
        got = [batch_mean, batch_std, running.mean, running.var, running.std, running.count]
        assert_close(got, expected, **PLAIN_TOL, what=f"update {i}")  # NaN batch std for the 1-value update


def test_running_moments_state_round_trip_is_json():
    rng = np.random.default_rng(1)
    chunks = [rng.normal(size=n) for n in (5, 9, 3)]
    continuous = RunningMoments()
    resumed = RunningMoments()
    for i, chunk in enumerate(chunks):
        continuous.update(chunk)
        resumed = RunningMoments.from_state(json.loads(json.dumps(resumed.state_dict())))
        resumed.update(chunk)
    assert resumed.state_dict() == continuous.state_dict()
    # the running mean/variance equal the pooled ones (count starts at 1e-24)
    pooled = np.concatenate(chunks)
    assert_close([continuous.mean, continuous.var], [pooled.mean(), pooled.var()], atol=1e-9)
    with pytest.raises(InvariantError):
        RunningMoments.from_state({"mean": 0.0})


def _is_bug3(p) -> bool:
    return p["norm_std_type"] == "group" and p["norm_mean_type"] != "group"


@pytest.mark.parametrize("name", case_names("reward_norm__"))
def test_reward_norm_golden(name):
    case = load(name)
    p = case.params
    assert int(case.outputs["raised"]) == 0
    running = None
    if "running_warmup" in case.inputs:
        running = RunningMoments()
        running.update(case.inputs["running_warmup"])
    r = case.inputs["response_level_rewards"]
    out = reward_norm(r, p["n_sample"], p["norm_mean_type"], p["norm_std_type"], running)
    assert out.shape == r.shape and out.dtype == np.float32
    expected = case.outputs["normalized"]
    if _is_bug3(p):
        # ROLL broadcasts to (G, B) (BUG-3). Corrected: row b uses its own group's std, i.e. ROLL's entry [g(b), b].
        assert expected.shape == (len(r) // p["n_sample"], len(r))
        expected = expected[np.arange(len(r)) // p["n_sample"], np.arange(len(r))]
        if p["norm_mean_type"] != "running":
            assert_close(out, ref_rlvr_norm_fixed(r, p["n_sample"], p["norm_mean_type"], "group"), **NORM_TOL)
    assert_close(out, expected, **NORM_TOL, what=name)


def test_reward_norm_bug3_hand_case():
    r = np.array([0.0, 2.0, 1.0, 1.0, 4.0, 8.0], dtype=np.float32)  # groups of 2: std √2, 0, 2√2
    out = reward_norm(r, 2, "batch", "group")
    mu = r.mean()
    assert out.shape == (6,)
    assert_close(out, (r - mu) / (np.array([np.sqrt(2)] * 2 + [0, 0] + [2 * np.sqrt(2)] * 2) + 1e-6), **NORM_TOL)


def test_reward_norm_edges_and_running_domain_keying():
    # singleton groups give NaN (std of one value), zero-std groups give zeros (0/1e-6)
    assert np.isnan(reward_norm(np.array([1.0, 2.0]), 1, "group", "group")).all()
    np.testing.assert_array_equal(reward_norm(np.array([3.0, 3.0, 1.0, 2.0]), 2, "group", "group")[:2], [0, 0])
    # each domain's tracker is updated with the current batch before it is read (BUG-2: key by domain)
    trackers = {"math": RunningMoments(), "code": RunningMoments()}
    reward_norm(np.array([1.0, 3.0]), -1, "running", "running", trackers["math"])
    assert trackers["math"].count == pytest.approx(2) and trackers["code"].count == pytest.approx(1e-24)
    with pytest.raises(ConfigError, match="running"):
        reward_norm(np.array([1.0, 3.0]), 2, "running", None)
    with pytest.raises(InvariantError, match="groups of 4"):
        reward_norm(np.arange(6.0), 4, "group", "group")
    with pytest.raises(ConfigError):
        reward_norm(np.arange(4.0), 2, "median", None)


@pytest.mark.parametrize("name", case_names("reward_postprocess__"))
def test_reward_postprocess_golden(name):
    case = load(name)
    p = case.params
    params_before = json.dumps(p, sort_keys=True)
    out, metrics = reward_postprocess(case.inputs["response_level_rewards"], p["adv_estimator"], p["norm_mean_type"],
                                      p["norm_std_type"], p["num_return_sequences"], p["reward_clip"])
    assert_close(out, case.outputs["response_level_rewards"], **NORM_TOL, what=name)
    assert metrics["critic/reward_clip_frac"] == pytest.approx(case.metric("critic/reward_clip_frac"))
    resolved = resolve_rlvr_norm_types(p["adv_estimator"], p["norm_mean_type"], p["norm_std_type"])
    assert list(resolved) == case.outputs["config_after_norm_types"].tolist()
    assert json.dumps(p, sort_keys=True) == params_before  # nothing mutated


def test_clip_fraction_counts_both_sides():
    assert clip_fraction(np.array([-2.0, -1.0, 0.0, 1.0, 3.0]), 1.0, -1.0) == pytest.approx(0.4)
    assert clip_fraction(np.zeros(0), 1.0, -1.0) == 0.0


@pytest.mark.parametrize("name", case_names("group_reward_norm__"))
def test_group_reward_norm_golden(name):
    case = load(name)
    p = case.params
    out = group_reward_norm(case.inputs["response_level_rewards"], p["n_sample"], p["div_std"], p["div_std_global"])
    assert_close(out, case.outputs["response_level_rewards"], **NORM_TOL, what=name)


def test_group_reward_norm_hand_cases():
    r = np.array([1.0, 3.0, 10.0, 14.0])
    centred = np.array([-1.0, 1.0, -2.0, 2.0])
    assert_close(group_reward_norm(r, 2), centred / (np.array([2**0.5] * 2 + [8**0.5] * 2) + 1e-6), **NORM_TOL)
    assert_close(group_reward_norm(r, 2, div_std_global=True), centred / (centred.std(ddof=1) + 1e-6), **NORM_TOL)
    with pytest.raises(ConfigError):
        group_reward_norm(r, 1)


# ======================================================================================================================
# §5.1 discounted returns, §5.3 state groups
# ======================================================================================================================
@pytest.mark.parametrize("name", case_names("compute_discounted_returns__"))
def test_discounted_returns_golden(name):
    case = load(name)
    i = case.inputs
    out = discounted_returns(i["traj_id"], i["step"], i["step_scores"], case.params["gamma"])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(case.outputs["traj_id_after"], i["traj_id"])  # row order kept
    assert_close(out, case.outputs["step_rewards"], **PLAIN_TOL, what=name)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.95, 1.0])
def test_discounted_returns_vectorised_equals_loop(gamma):
    rng = np.random.default_rng(int(gamma * 100))
    lengths = rng.integers(1, 12, size=15)
    traj = np.repeat([f"t{k}" for k in range(len(lengths))], lengths)
    step = np.concatenate([rng.permutation(n) for n in lengths])
    scores = rng.normal(size=len(traj))
    perm = rng.permutation(len(traj))
    traj, step, scores = traj[perm], step[perm], scores[perm]
    assert_close(discounted_returns(traj, step, scores, gamma), ref_discounted(traj, step, scores, gamma), **PLAIN_TOL)


def test_discounted_returns_hand_case():
    out = discounted_returns(np.array(["a", "b", "a", "a"]), np.array([2, 0, 0, 1]), np.array([1.0, 5.0, 0.0, 2.0]),
                             0.5)
    assert_close(out, [1.0, 5.0, 0.0 + 0.5 * 2.5, 2.0 + 0.5 * 1.0])
    assert discounted_returns(np.array([], dtype=str), np.array([], dtype=int), np.array([]), 0.9).shape == (0,)


def test_build_state_group_golden():
    case = load("build_state_group")
    i = case.inputs
    compat_ids, compat_metrics = build_state_group(i["traj_group_id"], i["state_hash"], roll_compat=True)
    np.testing.assert_array_equal(compat_ids, case.outputs["state_group_id"])
    ids, metrics = build_state_group(i["traj_group_id"], i["state_hash"])
    # no state is shared across groups in this case, so the corrected ids group the rows exactly like ROLL's
    assert same_partition(ids, case.outputs["state_group_id"])
    for name in ("max", "mean", "min"):
        key = f"system/state_batch_size/{name}"
        assert metrics[key] == pytest.approx(case.metric(key)) == pytest.approx(compat_metrics[key])


def test_build_state_group_bug5_shared_state_across_groups():
    groups = np.array(["g0", "g0", "g1", "g1"])
    hashes = np.array(["h", "h", "h", "x"])
    ids, metrics = build_state_group(groups, hashes)
    assert ids[0] == ids[1] and ids[1] != ids[2] and len(set(ids.tolist())) == 3
    compat_ids, _ = build_state_group(groups, hashes, roll_compat=True)
    assert compat_ids[0] == compat_ids[2]  # ROLL pools the same state of different groups (BUG-5)
    assert metrics == {"system/state_batch_size/max": 2.0, "system/state_batch_size/mean": 4 / 3,
                       "system/state_batch_size/min": 1.0}


# ======================================================================================================================
# §5.4 compute_response_level_rewards
# ======================================================================================================================
def _columns(case):
    cols = dict(case.inputs)
    cols["score_sum"] = case.inputs["scores"].sum(-1)
    return cols


@pytest.mark.parametrize("roll_compat", [False, True])
@pytest.mark.parametrize("name", case_names("compute_response_level_rewards__"))
def test_compute_response_level_rewards_golden(name, roll_compat):
    case = load(name)
    p = case.params
    result = compute_response_level_rewards(
        RESPONSE_REWARD_OF.get(p["adv_estimator"], "episode"), _columns(case),
        RewardNormSettings(**p["reward_normalization"]), episode_reward_weight=p["episode_reward_weight"],
        step_reward_weight=p["step_reward_weight"], reward_clip=p["reward_clip"], roll_compat=roll_compat)
    expected = case.outputs
    assert result.rewards.dtype == np.float32
    assert_close(result.rewards, expected["response_level_rewards"], **NORM_TOL, what=name)
    for column in ("episode_rewards_norm", "step_rewards_norm"):
        if column in expected:
            assert_close(result.columns[column], expected[column], **NORM_TOL, what=f"{name} {column}")
    if "state_group_id" in expected:
        if roll_compat:
            np.testing.assert_array_equal(result.columns["state_group_id"], expected["state_group_id"])
        assert same_partition(result.columns["state_group_id"], expected["state_group_id"])
    golden_metrics = {k.split("metric:", 1)[1].replace("|", "/"): float(v)
                      for k, v in expected.items() if "metric:" in k}
    assert result.metrics == pytest.approx(golden_metrics)
    assert resolve_norm_types(**p["reward_normalization"]) == tuple(_none(t) for t in p["resolved_norm"])


@pytest.mark.parametrize("name", case_names("compute_response_level_rewards__"))
def test_golden_step_rewards_are_discounted_returns(name):
    i = load(name).inputs
    assert_close(discounted_returns(i["traj_id"], i["step"], i["step_scores"], 0.95), i["step_rewards"], **PLAIN_TOL)


def _gigpo_columns(states, groups=None):
    rng = np.random.default_rng(5)
    n = len(states)
    groups = np.array(["g0"] * (n // 2) + ["g1"] * (n - n // 2)) if groups is None else groups
    return {"traj_group_id": groups, "state_hash": np.asarray(states),
            "episode_scores": rng.normal(size=n), "step_rewards": rng.normal(size=n).astype(np.float32)}


def test_gigpo_bug6_explicit_types_normalise_step_rewards():
    cols = _gigpo_columns(["a", "a", "a", "b", "a", "a", "c", "c"])
    norm = RewardNormSettings(grouping="traj_group_id", method="identity", norm_mean_type="group",
                              norm_std_type="group")
    assert gigpo_step_norm_types(norm) == ("group", "group")
    assert gigpo_step_norm_types(norm, roll_compat=True) == (None, None)
    fixed = compute_response_level_rewards("gigpo", cols, norm)
    compat = compute_response_level_rewards("gigpo", cols, norm, roll_compat=True)
    keys = np.char.add(cols["traj_group_id"], cols["state_hash"])
    assert_close(fixed.columns["step_rewards_norm"], ref_agentic_norm(cols["step_rewards"], keys, "group", "group"),
                 **NORM_TOL)
    assert_close(compat.columns["step_rewards_norm"], cols["step_rewards"])  # ROLL: identity, not normalised
    episode = ref_agentic_norm(cols["episode_scores"], cols["traj_group_id"], "group", "group")
    assert_close(compat.rewards, episode + cols["step_rewards"], **NORM_TOL)


def test_gigpo_bug5_states_shared_across_groups():
    cols = _gigpo_columns(["s", "s", "t", "t", "s", "s", "t", "u"])
    norm = RewardNormSettings(grouping="traj_group_id", method="mean_std")
    fixed = compute_response_level_rewards("gigpo", cols, norm)
    compat = compute_response_level_rewards("gigpo", cols, norm, roll_compat=True)
    per_group = ref_agentic_norm(cols["step_rewards"], np.char.add(cols["traj_group_id"], cols["state_hash"]),
                                 "group", "group")
    pooled = ref_agentic_norm(cols["step_rewards"], cols["state_hash"], "group", "group")
    assert_close(fixed.columns["step_rewards_norm"], per_group, **NORM_TOL)
    assert_close(compat.columns["step_rewards_norm"], pooled, **NORM_TOL)
    assert not np.allclose(per_group, pooled)


def test_gigpo_with_unique_states_is_episode_norm():
    cols = _gigpo_columns([f"s{k}" for k in range(10)])
    norm = RewardNormSettings(grouping="traj_group_id", method="mean_std")
    result = compute_response_level_rewards("gigpo", cols, norm, episode_reward_weight=0.7, step_reward_weight=1.3)
    episode = compute_response_level_rewards("episode", {**cols, "score_sum": cols["episode_scores"]}, norm)
    np.testing.assert_array_equal(result.columns["step_rewards_norm"], np.zeros(10, dtype=np.float32))
    assert_close(result.rewards, 0.7 * episode.rewards, **NORM_TOL)
    assert result.metrics["system/state_batch_size/max"] == 1.0


def test_step_return_and_clip_metric():
    cols = {"step_rewards": np.array([3.0, -3.0, 0.5, 0.0], dtype=np.float32)}
    result = compute_response_level_rewards("step_return", cols, reward_clip=1.0)
    assert_close(result.rewards, [1.0, -1.0, 0.5, 0.0])
    assert result.metrics == {"critic/reward_clip_frac": 0.5}
    assert compute_response_level_rewards("step_return", cols).metrics == {}


def test_response_level_rewards_bad_input():
    assert set(RESPONSE_REWARD_KINDS) == {"episode", "step_return", "gigpo"}
    with pytest.raises(ConfigError, match="response_reward"):
        compute_response_level_rewards("grpo", {"score_sum": np.zeros(2)})
    with pytest.raises(SchemaError, match="step_rewards"):
        compute_response_level_rewards("step_return", {"score_sum": np.zeros(2)})
    with pytest.raises(SchemaError, match="traj_group_id"):
        compute_response_level_rewards("episode", {"score_sum": np.zeros(2)},
                                       RewardNormSettings(grouping="traj_group_id", method="mean"))
    with pytest.raises(ConfigError, match="norm_mean_type"):
        agentic_reward_norm(np.zeros(3), None, "running", None)


# ---- pieces of the golden pipeline chains that belong to this layer --------------------------------------------------
@pytest.mark.parametrize("name", case_names("chain_agentic__"))
def test_chain_agentic_response_level_part(name):
    case = load(name)
    p, i = case.params, case.inputs
    cols = _columns(case)
    if "step_rewards" in case.outputs:
        cols["step_rewards"] = discounted_returns(i["traj_id"], i["step"], i["step_scores"], p["step_reward_gamma"])
        assert_close(cols["step_rewards"], case.outputs["step_rewards"], **PLAIN_TOL)
    result = compute_response_level_rewards(
        RESPONSE_REWARD_OF.get(p["adv_estimator"], "episode"), cols, RewardNormSettings(**p["reward_normalization"]),
        episode_reward_weight=p["episode_reward_weight"], step_reward_weight=p["step_reward_weight"],
        reward_clip=p["reward_clip"])
    assert_close(result.rewards, case.outputs["response_level_rewards"], **NORM_TOL)


@pytest.mark.parametrize("name", case_names("chain_rlvr__"))
def test_chain_rlvr_mask_and_postprocess_part(name):
    case = load(name)
    p, i = case.params, case.inputs
    token_mask = i["response_mask"][:, 1:]
    s, metrics = get_sample_level_mask(token_mask.sum(-1), int(i["responses_width"]), i["scores"],
                                       p["num_return_sequences"], max_len_mask=p["max_len_mask"],
                                       use_difficulty_mask=p["difficulty_mask"])
    np.testing.assert_array_equal(token_mask * s[:, None], case.outputs["final_response_mask"])
    rewards, post_metrics = reward_postprocess(i["response_level_rewards"], p["adv_estimator"], p["norm_mean_type"],
                                               p["norm_std_type"], p["num_return_sequences"], p["reward_clip"])
    assert_close(rewards, case.outputs["response_level_rewards"], **NORM_TOL)
    for key, value in {**metrics, **post_metrics}.items():
        assert value == pytest.approx(case.metric(key)), key


# ======================================================================================================================
# Invariances
# ======================================================================================================================
def test_group_norm_unchanged_by_a_constant_per_group():
    rng = np.random.default_rng(2)
    x = rng.normal(size=24).astype(np.float32)
    groups = np.repeat(np.arange(6), 4)
    shifted = x + rng.uniform(-5, 5, size=6).astype(np.float32)[groups]
    assert_close(agentic_reward_norm(shifted, groups.astype(str), "group", "group"),
                 agentic_reward_norm(x, groups.astype(str), "group", "group"), **NORM_TOL)
    assert_close(reward_norm(shifted, 4, "group", "group"), reward_norm(x, 4, "group", "group"), **NORM_TOL)
    assert_close(reward_postprocess(shifted, "grpo", None, None, 4)[0], reward_postprocess(x, "grpo", None, None, 4)[0],
                 **NORM_TOL)


def test_row_permutation_permutes_outputs():
    rng = np.random.default_rng(3)
    n = 30
    cols = {"traj_group_id": rng.choice(["g0", "g1", "g2"], size=n), "state_hash": rng.choice(["a", "b", "c"], n),
            "traj_id": rng.choice([f"t{k}" for k in range(6)], size=n), "step": rng.permutation(n),
            "episode_scores": rng.normal(size=n), "step_rewards": rng.normal(size=n).astype(np.float32)}
    perm = rng.permutation(n)
    permuted = {k: v[perm] for k, v in cols.items()}
    norm = RewardNormSettings(grouping="traj_group_id", method="mean_std")
    base = compute_response_level_rewards("gigpo", cols, norm, reward_clip=1.5)
    moved = compute_response_level_rewards("gigpo", permuted, norm, reward_clip=1.5)
    assert_close(moved.rewards, base.rewards[perm], **NORM_TOL)
    np.testing.assert_array_equal(moved.columns["state_group_id"], base.columns["state_group_id"][perm])
    assert moved.metrics == pytest.approx(base.metrics)
    assert_close(discounted_returns(permuted["traj_id"], permuted["step"], permuted["episode_scores"], 0.9),
                 discounted_returns(cols["traj_id"], cols["step"], cols["episode_scores"], 0.9)[perm], **PLAIN_TOL)
    # RLVR groups are consecutive blocks: permuting whole groups and rows inside them permutes the output
    group_perm = (rng.permutation(6)[:, None] * 4 + np.array([rng.permutation(4) for _ in range(6)])).reshape(-1)
    x = rng.normal(size=24).astype(np.float32)
    assert_close(reward_norm(x[group_perm], 4, "batch", "group"), reward_norm(x, 4, "batch", "group")[group_perm],
                 **NORM_TOL)


# ======================================================================================================================
# §1.9 pad / eos masks, §3.5 sample-level mask, §5.5 agentic mask
# ======================================================================================================================
def test_get_eos_mask_golden_and_ragged():
    case = load("get_eos_mask")
    ids, eos = case.inputs["response_id"], case.params["eos_token"]
    np.testing.assert_array_equal(get_eos_mask(ids, eos), case.outputs["eos_mask"])
    lengths = np.array([9, 5, 9, 0])
    ragged = get_eos_mask(Ragged.from_padded(ids, lengths), eos)
    np.testing.assert_array_equal(ragged.values, Ragged.from_padded(case.outputs["eos_mask"], lengths).values)
    as_list = get_eos_mask([row[:n].tolist() for row, n in zip(ids, lengths)], eos)
    np.testing.assert_array_equal(as_list.values, ragged.values)


def test_get_pad_mask_golden_and_ragged():
    case = load("get_pad_mask__eos0_pad0")
    ids, p = case.inputs["response_id"], case.params
    np.testing.assert_array_equal(get_pad_mask(ids, p["pad_token"], p["eos_token"]), case.outputs["pad_mask"])
    lengths = np.array([7, 3, 9])
    ragged = get_pad_mask(Ragged.from_padded(ids, lengths), p["pad_token"], p["eos_token"])
    np.testing.assert_array_equal(ragged.values, Ragged.from_padded(case.outputs["pad_mask"], lengths).values)


def test_get_pad_mask_hand_cases_and_bad_rows():
    ids = np.array([[5, 7, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(get_pad_mask(ids, 0, 2), [[1, 1, 0, 0], [0, 0, 0, 0]])  # eos ≠ pad: pads dropped
    np.testing.assert_array_equal(get_pad_mask(ids, 0, 0), [[1, 1, 1, 0], [1, 0, 0, 0]])  # eos = pad: first kept
    with pytest.raises(InvariantError, match=r"rows \[1\]"):
        get_pad_mask(np.array([[5, 0], [0, 6]]), 0, 2)


@pytest.mark.parametrize("name", case_names("get_sample_level_mask__"))
def test_get_sample_level_mask_golden(name):
    case = load(name)
    p, i = case.params, case.inputs
    token_mask = i["response_mask"][:, 1:]
    s, metrics = get_sample_level_mask(
        token_mask.sum(-1), int(i["responses_width"]), i["scores"], p["num_return_sequences"],
        max_len_mask=p["max_len_mask"], use_difficulty_mask=p["difficulty_mask"],
        difficulty_low_threshold=p["difficulty_low_threshold"],
        difficulty_high_threshold=p["difficulty_high_threshold"],
        error_max_len_clip=p["error_max_len_clip"], error_max_len_threshold=p["error_max_len_threshold"])
    assert s.shape == (len(token_mask),) and s.dtype == np.float32
    np.testing.assert_array_equal(token_mask * s[:, None], case.outputs["final_response_mask"])
    golden = {k.split("metric:", 1)[1].replace("|", "/"): float(v) for k, v in case.outputs.items() if "metric:" in k}
    assert metrics == pytest.approx(golden)


def test_difficulty_and_error_len_masks_hand_case():
    scores = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0.5, 1, 0], dtype=np.float32)
    # group pass rates: 1.0, 0.5, 0.0, 0.625 → strictly inside (0.1, 0.95): groups 1 and 3
    keep = difficulty_mask(scores, 4, 0.1, 0.95)
    np.testing.assert_array_equal(keep, np.repeat([False, True, False, True], 4))
    assert difficulty_mask(scores, 1, 0.1, 0.95).all()
    assert not difficulty_mask(scores, 4, 0.5, 0.625).any()  # strict inequalities at both ends
    np.testing.assert_array_equal(difficulty_mask(scores, 4, 0.0, 1.0), np.repeat([False, True, False, True], 4))
    lengths = np.array([3, 20, 12, 5] * 4)
    s, metrics = get_sample_level_mask(lengths, 20, scores, 4, max_len_mask=True, use_difficulty_mask=True,
                                       difficulty_low_threshold=0.1, difficulty_high_threshold=0.95,
                                       error_max_len_clip=True, error_max_len_threshold=10)
    max_len = lengths != 20
    err_len = ((scores == 0) & (lengths < 10)) | (scores == 1)
    np.testing.assert_array_equal(s, (max_len & keep & err_len).astype(np.float32))
    assert metrics["actor/max_len_mask_ratio"] == pytest.approx(max_len.mean())
    assert metrics["actor/difficulty_mask_ratio"] == pytest.approx(keep.mean())
    assert metrics["actor/error_len_mask_ratio"] == pytest.approx(err_len.mean())  # score 0.5 is dropped
    assert metrics["actor/samples_used"] == s.sum() and metrics["actor/samples_total"] == 16.0
    with pytest.raises(InvariantError):
        get_sample_level_mask(lengths, 20, scores[:3], 4)


def test_agentic_response_level_mask_golden():
    case = load("get_agentic_response_level_mask")
    token_mask = case.inputs["response_mask"][:, 1:]
    s, metrics = agentic_response_level_mask(len(token_mask))
    np.testing.assert_array_equal(token_mask * s[:, None], case.outputs["final_response_mask"])
    golden = {k.split("metric:", 1)[1].replace("|", "/"): float(v) for k, v in case.outputs.items() if "metric:" in k}
    assert metrics == pytest.approx(golden)
