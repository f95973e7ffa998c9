"""Response-level algorithms: reward normalisation, discounted step returns, GiGPO state groups, response-level
rewards, sample masks (ALGORITHMS.md §1.9, §3, §5). Golden conformance (every relevant case), hand-computed cases,
loop references, invariances and bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from schemas.errors import ConfigError, InvariantError, SchemaError
from stages.algos.functional import clip_fraction
from stages.algos.ragged import Ragged
from stages.algos.reward_norm import (
    RunningMoments,
    agentic_reward_norm,
    batch_moments,
    canonical_method,
    clip_rewards,
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
from stages.algos.advantages import compute_advantage
from stages.algos.estimators import ADVANTAGE_ESTIMATORS
from stages.algos.kl import get_kl_controller
from stages.algos.token_rewards import compute_token_reward
from tests.golden import assert_close, family, load, magnitude

NORM_TOL = dict(atol=1e-4, rtol=1e-5)  # golden README: whitened / normalised values
PLAIN_TOL = dict(atol=1e-6, rtol=1e-5)
# The estimator registry's response_reward values (stages/algos/estimators.py), restated for the golden cases.
RESPONSE_REWARD_OF = {"gigpo": "gigpo", "step_reinforce": "step_return"}
AGENTIC = "roll.pipeline.agentic."
F = "roll.utils.functionals."
AGENTIC_REWARD_NORM = family(AGENTIC + "utils.agentic_reward_norm")
RESOLUTION = family(AGENTIC + "agentic_config.RewardNormalizationConfig.__post_init__")
RUNNING_MOMENTS = family(F + "RunningMoments.update")
REWARD_NORM = family(F + "reward_norm")
REWARD_POSTPROCESS = family(F + "reward_postprocess")
GROUP_REWARD_NORM = family(F + "group_reward_norm")
DISCOUNTED_RETURNS = family(AGENTIC + "utils.compute_discounted_returns")
BUILD_STATE_GROUP = family(AGENTIC + "utils.build_state_group")
RESPONSE_LEVEL_REWARDS = family(AGENTIC + "utils.compute_response_level_rewards")
CHAIN_AGENTIC = family("agentic pipeline chain: compute_discounted_returns -> get_agentic_response_level_mask -> "
                       "compute_response_level_rewards -> compute_token_reward -> agentic_compute_advantage")
CHAIN_RLVR = family("rlvr pipeline chain (one domain): get_sample_level_mask -> reward_postprocess -> "
                    "compute_token_reward -> compute_advantage(response_mask=final_response_mask)")
EOS_MASK = family(F + "get_eos_mask")
PAD_MASK = family(F + "get_pad_mask")
SAMPLE_LEVEL_MASK = family(F + "get_sample_level_mask")
AGENTIC_RESPONSE_MASK = family(AGENTIC + "utils.get_agentic_response_level_mask")


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


def ref_running(*batches) -> tuple[float, float]:
    """§3.1 RunningMoments (mean 0, var 1, count 1e-24) after updating with each batch: (mean, std)."""
    mean, var, count = 0.0, 1.0, 1e-24
    for xs in batches:
        x = np.asarray(xs, dtype=np.float64).reshape(-1)
        n = x.size
        delta, total = x.mean() - mean, count + n
        var = (var * count + delta ** 2 * count * n / total + x.var() * n) / total
        mean, count = mean + delta * n / total, total
    return mean, float(np.sqrt(var * count / (count - 1)))


def ref_rlvr_norm_fixed(r, n, mean_type, std_type, running_warmup=None):
    """BUG-3 corrected §3.2: every row uses its own group's statistics (consecutive groups of ``n``; ``n ≤ 0`` one
    group); running statistics after updating with the warm-up batch (if any), then with ``r``."""
    r = np.asarray(r, dtype=np.float64)
    n = len(r) if n is None or n <= 0 else n
    run_mean, run_std = ref_running(*([] if running_warmup is None else [running_warmup]), r)
    out = np.empty_like(r)
    for start in range(0, len(r), n):
        g = r[start:start + n]
        mean = {"batch": r.mean(), "group": g.mean(), "running": run_mean, None: 0.0}[mean_type]
        std = {"batch": r.std(ddof=1), "group": g.std(ddof=1) if len(g) > 1 else np.nan, "running": run_std,
               None: None}[std_type]
        out[start:start + n] = (g - mean) if std is None else (g - mean) / (std + 1e-6)
    return out


def ref_resolve(grouping="batch", method="identity", norm_mean_type=None, norm_std_type=None):
    """§5.2 resolution of the normalisation types: explicit types win, ``method`` fills the ones left None."""
    method = method if method in ("identity", "mean", "mean_std", "asym_clip") else "identity"
    scope = "batch" if grouping == "batch" else "group"
    derived = {"identity": (None, None), "mean": (scope, None), "mean_std": (scope, scope),
               "asym_clip": (scope, scope)}[method]
    return (derived[0] if norm_mean_type is None else norm_mean_type,
            derived[1] if norm_std_type is None else norm_std_type)


def ref_response_level_rewards(estimator, cols, norm: dict, episode_weight=1.0, step_weight=1.0, reward_clip=None,
                               roll=False) -> tuple[np.ndarray, dict, dict]:
    """§5.4 (rewards, columns, metrics). Corrected: GiGPO state groups keyed by (traj_group_id, state_hash) [BUG-5]
    and step types from the explicit fields [BUG-6]; ``roll``: ROLL's (bare hash, types from ``method`` only)."""
    norm = {k: _none(v) for k, v in norm.items()}
    grouping = norm.get("grouping", "batch")
    types = ref_resolve(**norm)
    keys = None if grouping == "batch" else np.asarray(cols[grouping])
    columns, metrics = {}, {}
    if estimator == "gigpo":
        episode = ref_agentic_norm(cols["episode_scores"], keys, *types)
        groups, hashes = np.asarray(cols["traj_group_id"]).astype(str), np.asarray(cols["state_hash"]).astype(str)
        buckets = np.char.add(np.char.add(groups, "\x00"), hashes)
        state_keys = hashes if roll else buckets
        step_types = ref_resolve("state_group_id", norm.get("method", "identity")) if roll else \
            ref_resolve("state_group_id", norm.get("method", "identity"), norm.get("norm_mean_type"),
                        norm.get("norm_std_type"))
        step = ref_agentic_norm(cols["step_rewards"], state_keys, *step_types)
        rewards = episode_weight * episode + step_weight * step
        columns = {"episode_rewards_norm": episode, "step_rewards_norm": step, "state_keys": state_keys}
        sizes = np.unique(buckets, return_counts=True)[1]
        metrics = {"system/state_batch_size/max": float(sizes.max()), "system/state_batch_size/mean": float(
            sizes.mean()), "system/state_batch_size/min": float(sizes.min())}
    elif estimator == "step_reinforce":
        rewards = ref_agentic_norm(cols["step_rewards"], keys, *types)
    else:
        rewards = ref_agentic_norm(np.asarray(cols["scores"], dtype=np.float64).sum(-1), keys, *types)
    if reward_clip:
        metrics["critic/reward_clip_frac"] = float(np.mean(np.abs(rewards) > reward_clip))
        rewards = np.clip(rewards, -reward_clip, reward_clip)
    return rewards, columns, metrics


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
@pytest.mark.parametrize("name", AGENTIC_REWARD_NORM)
def test_agentic_reward_norm_golden(name):
    case = load(name)
    p = case.check_params(("grouping", "norm_mean_type", "norm_std_type"))
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


@pytest.mark.parametrize("name", RESOLUTION)
def test_resolution_golden_table(name):
    case = load(name)
    case.check_params(())
    for method, grouping, mean_type, std_type, method_after in case.outputs["table"]:
        explicit = re.fullmatch(r"(\w+)\(explicit mean=(\w+),std=(\w+)\)", method)
        kwargs = {}
        if explicit:
            method, kwargs = explicit[1], dict(norm_mean_type=_none(explicit[2]), norm_std_type=_none(explicit[3]))
        assert tuple(resolve_norm_types(grouping, method, **kwargs)) == (_none(mean_type), _none(std_type)), method
        assert ref_resolve(grouping, method, **kwargs) == (_none(mean_type), _none(std_type)), method
        assert canonical_method(method) == method_after


def test_resolution_explicit_wins_and_none_does_not_override():
    assert resolve_norm_types("traj_group_id", "mean_std", "batch", None) == ("batch", "group")
    assert resolve_norm_types("batch", "identity", None, "group") == (None, "group")
    assert resolve_norm_types("tags", "mean", None, None) == ("group", None)


# ======================================================================================================================
# §3.1 RunningMoments, §3.2 reward_norm, §3.3 reward_postprocess, §3.4 group_reward_norm
# ======================================================================================================================
@pytest.mark.parametrize("name", RUNNING_MOMENTS)
def test_running_moments_golden_sequence(name):
    case = load(name)
    case.check_params(())
    running = RunningMoments()
    seen = []
    for i, expected in enumerate(case.outputs["per_update"]):
        xs = case.inputs[f"update{i}_xs"]
        seen.append(xs)
        batch_mean, batch_std = running.update(xs)
        got = [batch_mean, batch_std, running.mean, running.var, running.std, running.count]
        # NaN batch std for a 1-value update; float32 batch statistics in ROLL: ulps of the values' magnitude
        assert_close(got, expected, **PLAIN_TOL, scale=magnitude(*seen, running.var), what=f"update {i}")
        assert_close([running.mean, running.std], ref_running(*seen), atol=1e-9, what=f"reference, update {i}")


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


def _is_bug3(mean_type, std_type) -> bool:
    """§13 BUG-3's condition: a group std with a non-group mean (ROLL then broadcasts (B,) against (G, 1))."""
    return std_type == "group" and mean_type != "group"


def _running_tracker(warmup) -> RunningMoments:
    running = RunningMoments()
    if warmup is not None:
        running.update(warmup)
    return running


def _running_warmup(case):
    """The params' ``running_ctrl`` describes ROLL's per-call tracker: a fresh ``RunningMoments``, pre-updated once
    with the ``running_warmup`` input when present."""
    desc = case.params.get("running_ctrl")
    assert desc is None or "RunningMoments" in str(desc), f"{case.name}: running_ctrl {desc!r}"
    return case.inputs.get("running_warmup")


def as_the_rlvr_chain_calls(fn, r, n_sample):
    """``fn(rewards, group=, scored=, zero_without_spread=True)`` called the way the RLVR chain calls it
    (stages/algos/rlvr_chain.py): groups keyed by prompt id in shuffled row order, plus two unscored (NaN) rows in the first
    and the last group. Returns (output on the original rows, in their order; output on the two unscored rows; fn's
    whole result)."""
    r = np.asarray(r, dtype=np.float64)
    groups = np.arange(len(r)) // n_sample if n_sample is not None and n_sample > 0 else np.zeros(len(r), int)
    keys = np.char.add("prompt-", groups.astype(str))
    rewards, keys = np.concatenate([r, [np.nan, np.nan]]), np.concatenate([keys, keys[[0, -1]]])
    order = np.random.default_rng(len(r)).permutation(len(rewards))
    result = fn(rewards[order], group=keys[order], scored=~np.isnan(rewards[order]), zero_without_spread=True)
    out = result[0] if isinstance(result, tuple) else result
    back = np.empty_like(out)
    back[order] = out
    return back[:len(r)], back[len(r):], result


@pytest.mark.parametrize("name", REWARD_NORM)
def test_reward_norm_golden(name):
    """Corrected (BUG-3 fixed) = the per-row reference on every case; ROLL's output where the case does not meet
    BUG-3's condition, and ROLL's broadcast entry [g(b), b] where it does."""
    case = load(name)
    p = case.check_params(("n_sample", "norm_mean_type", "norm_std_type", "running_ctrl"))
    assert int(case.outputs.get("raised", 0)) == 0
    warmup = _running_warmup(case)
    r = case.inputs["response_level_rewards"]
    mean_type, std_type = p["norm_mean_type"], p["norm_std_type"]
    tracker = _running_tracker(warmup)
    out = reward_norm(r, p["n_sample"], mean_type, std_type, tracker)
    assert out.shape == r.shape and out.dtype == np.float32
    assert_close(out, ref_rlvr_norm_fixed(r, p["n_sample"], mean_type, std_type, warmup), **NORM_TOL,
                 what=f"{name} vs reference")
    expected = case.outputs["normalized"]
    if _is_bug3(mean_type, std_type) and p["n_sample"] > 0:
        # ROLL broadcasts to (G, B) (BUG-3). Corrected: row b uses its own group's std, i.e. ROLL's entry [g(b), b].
        assert expected.shape == (len(r) // p["n_sample"], len(r))
        expected = expected[np.arange(len(r)) // p["n_sample"], np.arange(len(r))]
    assert_close(out, expected, **NORM_TOL, what=name)
    # the production call (groups keyed by prompt id, unscored rows): the same on the scored rows, 0 on the others
    chain_tracker = _running_tracker(warmup)
    keyed, unscored, _ = as_the_rlvr_chain_calls(
        lambda x, **kw: reward_norm(x, None, mean_type, std_type, chain_tracker, **kw), r, p["n_sample"])
    assert_close(keyed, expected, **NORM_TOL, what=f"{name} as the RLVR chain calls it")
    assert unscored.tolist() == [0.0, 0.0]
    assert chain_tracker.state_dict() == pytest.approx(tracker.state_dict())


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


def test_reward_norm_keyed_groups_unscored_rows_and_one_scored_value():
    r = np.array([1.0, np.nan, 0.0, 3.0, 5.0, np.nan, 2.0])
    keys = np.array(["a", "a", "b", "b", "c", "c", "b"])  # groups by key, not by position
    scored = ~np.isnan(r)
    b = np.array([0.0, 3.0, 2.0])
    expected_b = (b - b.mean()) / (b.std(ddof=1) + 1e-6)
    out = reward_norm(r, None, "group", "group", group=keys, scored=scored, zero_without_spread=True)
    assert_close(out, [0.0, 0.0, expected_b[0], expected_b[1], 0.0, 0.0, expected_b[2]], **NORM_TOL)
    roll_like = reward_norm(r, None, "group", "group", group=keys, scored=scored)  # one value: NaN, as ROLL
    assert np.isnan(roll_like[[0, 4]]).all() and roll_like[[1, 5]].tolist() == [0.0, 0.0]
    tracker = RunningMoments()
    out = reward_norm(r, None, "running", "batch", tracker, scored=scored, zero_without_spread=True)
    reference = RunningMoments()
    reference.update(r[scored])
    assert tracker.state_dict() == pytest.approx(reference.state_dict())
    x = r[scored]
    assert_close(out[scored], (x - reference.mean) / (x.std(ddof=1) + 1e-6), **NORM_TOL)
    assert out[~scored].tolist() == [0.0, 0.0]
    untouched = RunningMoments()
    nothing = reward_norm(np.full(3, np.nan), 3, "running", "running", untouched, scored=np.zeros(3, bool))
    assert nothing.tolist() == [0.0, 0.0, 0.0] and untouched.count == 1e-24
    with pytest.raises(InvariantError, match="scored"):
        reward_norm(r, None, None, None, scored=scored[:3])


@pytest.mark.parametrize("name", REWARD_POSTPROCESS)
def test_reward_postprocess_golden(name):
    case = load(name)
    p = case.check_params(("adv_estimator", "norm_mean_type", "norm_std_type", "reward_clip", "num_return_sequences",
                           "running_ctrl"))
    params_before = json.dumps(p, sort_keys=True)
    warmup = _running_warmup(case)
    r = case.inputs["response_level_rewards"]
    out, metrics = reward_postprocess(r, p["adv_estimator"], p["norm_mean_type"], p["norm_std_type"],
                                      p["num_return_sequences"], p["reward_clip"], _running_tracker(warmup))
    resolved = resolve_rlvr_norm_types(p["adv_estimator"], p["norm_mean_type"], p["norm_std_type"])
    if "config_after_norm_types" in case.outputs:
        assert [_none(t) for t in resolved] == [_none(t) for t in case.outputs["config_after_norm_types"].tolist()]
    ref = ref_rlvr_norm_fixed(r, p["num_return_sequences"], *resolved, warmup)
    clip = p["reward_clip"]
    ref_frac = float(np.mean(np.abs(ref) > clip)) if clip else 0.0
    ref = np.clip(ref, -clip, clip) if clip else ref
    assert_close(out, ref, **NORM_TOL, what=f"{name} vs reference")
    assert metrics["critic/reward_clip_frac"] == pytest.approx(ref_frac)
    if not _is_bug3(*resolved):               # where BUG-3's condition holds ROLL's output is (G, B): reference only
        assert_close(out, case.outputs["response_level_rewards"], **NORM_TOL, what=name)
        assert metrics["critic/reward_clip_frac"] == pytest.approx(case.metric("critic/reward_clip_frac"))
    assert json.dumps(p, sort_keys=True) == params_before  # nothing mutated
    # the production call (groups keyed by prompt id, unscored rows): the same on the scored rows, 0 on the others,
    # the clip fraction over the scored rows
    keyed, unscored, (_, keyed_metrics) = as_the_rlvr_chain_calls(
        lambda x, **kw: reward_postprocess(x, p["adv_estimator"], p["norm_mean_type"], p["norm_std_type"], None,
                                           p["reward_clip"], _running_tracker(warmup), **kw),
        r, p["num_return_sequences"])
    assert_close(keyed, ref, **NORM_TOL, what=f"{name} as the RLVR chain calls it")
    assert unscored.tolist() == [0.0, 0.0]
    assert keyed_metrics == pytest.approx(metrics)


def test_clip_fraction_counts_both_sides():
    assert clip_fraction(np.array([-2.0, -1.0, 0.0, 1.0, 3.0]), low=-1.0, high=1.0) == pytest.approx(0.4)
    assert clip_fraction(np.zeros(0), low=-1.0, high=1.0) == 0.0
    assert clip_rewards(np.array([-2.0, 0.5, 3.0]), 1.0)[1] == {"critic/reward_clip_frac": pytest.approx(2 / 3)}


@pytest.mark.parametrize("name", GROUP_REWARD_NORM)
def test_group_reward_norm_golden(name):
    """ROLL's group_reward_norm (§3.4, a helper its pipelines never call) centres each group and, with ``div_std``,
    divides by the group std of the centred values (= the values' group std): reward_norm with group types, which
    is what the RLVR chain calls. ``div_std_global`` (one std over all centred values) has no option of ours."""
    case = load(name)
    p = case.check_params(("n_sample", "div_std", "div_std_global"))
    if p["div_std_global"]:
        pytest.fail(f"{name}: div_std_global is not offered (no norm type divides by the std of the centred values); "
                    "add it to reward_norm if a pipeline needs it", pytrace=False)
    r, expected = case.inputs["response_level_rewards"], case.outputs["response_level_rewards"]
    std_type = "group" if p["div_std"] else None
    out = reward_norm(r, p["n_sample"], "group", std_type)
    assert_close(out, expected, **NORM_TOL, what=name)
    keyed, unscored, _ = as_the_rlvr_chain_calls(lambda x, **kw: reward_norm(x, None, "group", std_type, **kw), r,
                                                 p["n_sample"])
    assert_close(keyed, expected, **NORM_TOL, what=f"{name} as the RLVR chain calls it")
    assert unscored.tolist() == [0.0, 0.0]


def test_group_reward_norm_hand_cases():
    """§3.4's per-group variant through reward_norm: centring, then the group std of the centred values."""
    r = np.array([1.0, 3.0, 10.0, 14.0])
    centred = np.array([-1.0, 1.0, -2.0, 2.0])
    assert_close(reward_norm(r, 2, "group", "group"), centred / (np.array([2**0.5] * 2 + [8**0.5] * 2) + 1e-6),
                 **NORM_TOL)
    assert_close(reward_norm(r, 2, "group", None), centred, **NORM_TOL)


# ======================================================================================================================
# §5.1 discounted returns, §5.3 state groups
# ======================================================================================================================
@pytest.mark.parametrize("name", DISCOUNTED_RETURNS)
def test_discounted_returns_golden(name):
    """Only estimators with step rows (gigpo, step_reinforce) compute step returns; for the others ROLL returns the
    batch unchanged (no ``step_rewards``) and our pipeline never calls it."""
    case = load(name)
    p = case.check_params(("adv_estimator", "gamma"))
    i = case.inputs
    if "traj_id_after" in case.outputs:
        np.testing.assert_array_equal(case.outputs["traj_id_after"], i["traj_id"])  # row order kept
    if not ADVANTAGE_ESTIMATORS.get(p["adv_estimator"]).needs_step_rows:
        assert "step_rewards" not in case.outputs
        return
    out = discounted_returns(i["traj_id"], i["step"], i["step_scores"], p["gamma"])
    assert out.dtype == np.float32
    ref = ref_discounted(i["traj_id"], i["step"], i["step_scores"], p["gamma"])
    scale = magnitude(i["step_scores"]) * len(i["step_scores"])        # bound of any partial return
    assert_close(out, case.outputs["step_rewards"], **PLAIN_TOL, scale=scale, what=name)
    assert_close(out, ref, **PLAIN_TOL, scale=scale, what=f"{name} vs reference")


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


@pytest.mark.parametrize("name", BUILD_STATE_GROUP)
def test_build_state_group_golden(name):
    """compat = ROLL's ids; corrected ids partition the rows by (traj_group_id, state_hash) [BUG-5], which is ROLL's
    partition unless a state hash occurs in more than one group (the defect's condition, read off the inputs)."""
    case = load(name)
    case.check_params(())
    i = case.inputs
    compat_ids, compat_metrics = build_state_group(i["traj_group_id"], i["state_hash"], roll_compat=True)
    np.testing.assert_array_equal(compat_ids, case.outputs["state_group_id"])
    ids, metrics = build_state_group(i["traj_group_id"], i["state_hash"])
    pairs = np.char.add(np.char.add(np.asarray(i["traj_group_id"]).astype(str), "\x00"),
                        np.asarray(i["state_hash"]).astype(str))
    assert same_partition(ids, pairs)
    shared = any(len(set(np.asarray(i["traj_group_id"])[np.asarray(i["state_hash"]) == h].tolist())) > 1
                 for h in set(np.asarray(i["state_hash"]).tolist()))
    assert same_partition(ids, case.outputs["state_group_id"]) == (not shared)
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


RESPONSE_LEVEL_PARAMS = ("adv_estimator", "reward_normalization", "resolved_norm", "episode_reward_weight",
                         "step_reward_weight", "reward_clip")
NORM_KEYS = ("grouping", "method", "norm_mean_type", "norm_std_type")


def _norm_settings(case, p) -> RewardNormSettings:
    """The params' ``reward_normalization`` → RewardNormSettings (every key mapped, an unknown one refused); checks
    the params' ``resolved_norm`` against our resolution of it."""
    norm = {k: _none(v) for k, v in dict(p["reward_normalization"]).items()}
    unknown = sorted(set(norm) - set(NORM_KEYS))
    assert not unknown, f"{case.name}: reward_normalization keys {unknown} not honoured"
    settings = RewardNormSettings(**norm)
    if "resolved_norm" in p:
        resolved = tuple(_none(t) for t in p["resolved_norm"])
        assert resolve_norm_types(**norm) == resolved == ref_resolve(**norm), (norm, p["resolved_norm"])
    return settings


def _response_level(case, p, cols, roll_compat: bool):
    return compute_response_level_rewards(
        RESPONSE_REWARD_OF.get(p["adv_estimator"], "episode"), cols, _norm_settings(case, p),
        episode_reward_weight=p.get("episode_reward_weight", 1.0), step_reward_weight=p.get("step_reward_weight", 1.0),
        reward_clip=p.get("reward_clip"), roll_compat=roll_compat)


def _response_level_reference(p, cols, roll: bool):
    return ref_response_level_rewards(p["adv_estimator"], cols, dict(p["reward_normalization"]),
                                      p.get("episode_reward_weight", 1.0), p.get("step_reward_weight", 1.0),
                                      p.get("reward_clip"), roll=roll)


def _check_response_level(result, expected: dict, ref, what: str, exact_ids: bool) -> None:
    rewards, columns, metrics = ref
    assert result.rewards.dtype == np.float32
    assert_close(result.rewards, expected["response_level_rewards"], **NORM_TOL, what=what)
    for column in ("episode_rewards_norm", "step_rewards_norm"):
        if column in expected:
            assert_close(result.columns[column], expected[column], **NORM_TOL, what=f"{what} {column}")
    if "state_group_id" in expected:
        if exact_ids:
            np.testing.assert_array_equal(result.columns["state_group_id"], expected["state_group_id"])
        assert same_partition(result.columns["state_group_id"], expected["state_group_id"])
    golden = {k.split("metric:", 1)[1].replace("|", "/"): float(v) for k, v in expected.items() if "metric:" in k}
    assert {k: result.metrics[k] for k in golden} == pytest.approx(golden), what


@pytest.mark.parametrize("name", RESPONSE_LEVEL_REWARDS)
def test_compute_response_level_rewards_golden(name):
    """compat and the reference's ROLL mode reproduce ROLL; the default equals the corrected reference (GiGPO state
    groups per trajectory group [BUG-5], explicit step types [BUG-6]), and ROLL wherever the two reference modes
    agree, i.e. where the case's params and inputs meet neither defect's condition."""
    case = load(name)
    p = case.check_params(RESPONSE_LEVEL_PARAMS)
    cols = _columns(case)
    roll_ref, fixed_ref = _response_level_reference(p, cols, roll=True), _response_level_reference(p, cols, False)
    expected = case.outputs
    _check_response_level(_response_level(case, p, cols, roll_compat=True), expected, roll_ref, "compat", True)
    assert_close(roll_ref[0], expected["response_level_rewards"], **NORM_TOL, what="reference (ROLL mode)")
    result = _response_level(case, p, cols, roll_compat=False)
    assert_close(result.rewards, fixed_ref[0], **NORM_TOL, what="default vs corrected reference")
    for column in ("episode_rewards_norm", "step_rewards_norm"):
        if column in fixed_ref[1]:
            assert_close(result.columns[column], fixed_ref[1][column], **NORM_TOL, what=column)
    if "state_keys" in fixed_ref[1]:
        assert same_partition(result.columns["state_group_id"], fixed_ref[1]["state_keys"])
    assert result.metrics == pytest.approx(fixed_ref[2])
    if np.allclose(roll_ref[0], fixed_ref[0], rtol=0, atol=1e-9):
        _check_response_level(result, {k: v for k, v in expected.items() if k != "state_group_id"}, fixed_ref,
                              "default = ROLL", False)


@pytest.mark.parametrize("name", [n for n in RESPONSE_LEVEL_REWARDS if load(n).params["adv_estimator"] == "gigpo"])
@pytest.mark.parametrize("defect", ["BUG-5", "BUG-6"])
def test_response_level_rewards_under_each_gigpo_defect_condition(name, defect):
    """A golden GiGPO case's inputs put under a defect's condition (BUG-5: state hashes shared across trajectory
    groups; BUG-6: explicit step types with ``method: identity``): compat = the reference's ROLL mode, default = its
    corrected mode, and the two differ — the reference's defect branches are live, whatever cases the folder holds."""
    case = load(name)
    p = dict(case.check_params(RESPONSE_LEVEL_PARAMS))
    cols = _columns(case)
    if defect == "BUG-5":
        cols["state_hash"] = np.array([f"s{k % 3}" for k in range(len(cols["state_hash"]))])
    else:
        p["reward_normalization"] = {**p["reward_normalization"], "method": "identity", "norm_mean_type": "group",
                                     "norm_std_type": "group"}
        p.pop("resolved_norm", None)
    roll_ref, fixed_ref = _response_level_reference(p, cols, roll=True), _response_level_reference(p, cols, False)
    assert not np.allclose(roll_ref[0], fixed_ref[0], atol=1e-6)
    compat = _response_level(case, p, cols, roll_compat=True)
    default = _response_level(case, p, cols, roll_compat=False)
    assert_close(compat.rewards, roll_ref[0], **NORM_TOL, what="compat vs reference (ROLL mode)")
    assert_close(default.rewards, fixed_ref[0], **NORM_TOL, what="default vs corrected reference")
    assert same_partition(default.columns["state_group_id"], fixed_ref[1]["state_keys"])
    assert same_partition(compat.columns["state_group_id"], roll_ref[1]["state_keys"])


def _stated_gamma(case, column: str) -> float | None:
    """γ a case's manifest states for a derived input column ("... compute_discounted_returns(gamma=0.95) ...")."""
    meaning = case.meta.get("inputs", {}).get(column, {}).get("meaning", "")
    found = re.search(r"gamma\s*=\s*([0-9.]+)", meaning)
    return float(found.group(1).rstrip(".")) if found else None


@pytest.mark.parametrize("name", RESPONSE_LEVEL_REWARDS)
def test_golden_step_rewards_are_discounted_returns(name):
    case = load(name)
    i = case.inputs
    gamma = _stated_gamma(case, "step_rewards")
    if "step_rewards" not in i or gamma is None:
        pytest.skip(f"{name}: no step_rewards input with a stated gamma")
    assert_close(discounted_returns(i["traj_id"], i["step"], i["step_scores"], gamma), i["step_rewards"],
                 **PLAIN_TOL, scale=magnitude(i["step_scores"]) * len(i["step_scores"]))


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
CHAIN_AGENTIC_PARAMS = RESPONSE_LEVEL_PARAMS + ("step_reward_gamma", "advantage_clip", "whiten_advantages",
                                                "add_token_level_kl", "init_kl_coef", "kl_penalty", "gamma", "lambd")


def _run_agentic_chain(case, p, roll_compat: bool):
    """ROLL's agentic chain (§0.4 steps 2, 5-8) through our functions; every param dispatched. Returns (outputs,
    metrics) in the golden layout."""
    from tests.algos.test_token_level import _token_reward_inputs, full_rows, padded

    i = case.inputs
    entry = ADVANTAGE_ESTIMATORS.get(p["adv_estimator"])
    cols = _columns(case)
    out = {}
    if entry.needs_step_rows:                                        # §5.1, with the pipeline's step_reward_gamma
        cols["step_rewards"] = out["step_rewards"] = discounted_returns(i["traj_id"], i["step"], i["step_scores"],
                                                                        p.get("step_reward_gamma", 0.95))
    token_mask = i["response_mask"][:, 1:]
    s, metrics = agentic_response_level_mask(len(token_mask))        # §5.5 (a no-op)
    final = token_mask * s[:, None]
    response = _response_level(case, p, cols, roll_compat)
    out["response_level_rewards"] = response.rewards
    metrics = {**metrics, **response.metrics}
    _, mask, old, ref = _token_reward_inputs(case)
    kl_ctrl = get_kl_controller(p.get("init_kl_coef", 0.2))          # no target_kl in the chain: fixed
    tokens = compute_token_reward(response.rewards, mask, old, ref, kl_coef=kl_ctrl.value,
                                  kl_penalty=p.get("kl_penalty", "kl"),
                                  add_token_level_kl=p.get("add_token_level_kl", False),
                                  reward_clip=p.get("reward_clip"))
    width = token_mask.shape[1]
    token_rewards = padded(tokens.token_level_rewards, width)
    out["token_level_rewards"] = token_rewards
    if "critic/token_reward_clip_frac" in tokens.metrics:            # ROLL's denominator: all B·(S−1) positions
        tokens.metrics["critic/token_reward_clip_frac"] *= len(old.values) / token_mask.size
    metrics.update(tokens.metrics)
    values = full_rows(i["values"]) if "values" in i else None
    adv = compute_advantage(full_rows(token_rewards), full_rows(final).values, p["adv_estimator"], gamma=p["gamma"],
                            lambd=p["lambd"], values=values, whiten_advantages=p.get("whiten_advantages", False),
                            advantage_clip=p.get("advantage_clip"), roll_compat_gae=roll_compat)
    out["advantages"], out["returns"] = padded(adv.advantages, width), padded(adv.returns, width)
    metrics.update(adv.metrics)
    return out, metrics


@pytest.mark.parametrize("name", CHAIN_AGENTIC)
def test_chain_agentic_golden(name):
    """The whole agentic chain: compat reproduces every output and metric; the default too wherever the
    response-level reference's ROLL and corrected modes agree (else its response-level rewards equal the corrected
    reference, and the later steps are covered by their own families)."""
    case = load(name)
    p = case.check_params(CHAIN_AGENTIC_PARAMS)
    golden = {k.split("metric:", 1)[1].replace("|", "/"): float(v) for k, v in case.outputs.items() if "metric:" in k}
    cols = _columns(case)
    if ADVANTAGE_ESTIMATORS.get(p["adv_estimator"]).needs_step_rows:
        cols["step_rewards"] = discounted_returns(case.inputs["traj_id"], case.inputs["step"],
                                                  case.inputs["step_scores"], p.get("step_reward_gamma", 0.95))
    fixed_ref = _response_level_reference(p, cols, roll=False)[0]
    no_defect = np.allclose(_response_level_reference(p, cols, roll=True)[0], fixed_ref, rtol=0, atol=1e-9)
    for roll_compat in (True, False):
        out, metrics = _run_agentic_chain(case, p, roll_compat)
        if not roll_compat:
            assert_close(out["response_level_rewards"], fixed_ref, **NORM_TOL, what="default vs reference")
            if not no_defect:
                continue
        what = "compat" if roll_compat else "default"
        for key, value in case.outputs.items():
            if not key.startswith("metric:"):
                tol = PLAIN_TOL if key == "step_rewards" else NORM_TOL
                assert_close(out[key], value, **tol, scale=row_scale(out.get("token_level_rewards"), key),
                             what=f"{what} {key}")
        for key, value in golden.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{what} {key}"


def row_scale(token_rewards, key):
    """float32 scale of the chain's recursions: per row Σ|r| for returns/advantages (None otherwise)."""
    if token_rewards is None or key not in ("advantages", "returns"):
        return None
    return np.abs(np.asarray(token_rewards, dtype=np.float64)).sum(-1, keepdims=True)


@pytest.mark.parametrize("name", CHAIN_RLVR)
def test_chain_rlvr_mask_and_postprocess_part(name):
    """The narrow part of ROLL's RLVR chain (the whole chain: tests/rlvr/test_chain.py)."""
    from tests.rlvr.helpers import chain_params

    case = load(name)
    p = chain_params(case)
    i = case.inputs
    token_mask, s, metrics = _sample_mask_of_case(i, p)
    np.testing.assert_array_equal(token_mask * s[:, None], case.outputs["final_response_mask"])
    rewards, post_metrics = reward_postprocess(i["response_level_rewards"], p["adv_estimator"], p.get("norm_mean_type"),
                                               p.get("norm_std_type"), p["num_return_sequences"],
                                               p.get("reward_clip"), RunningMoments())
    resolved = resolve_rlvr_norm_types(p["adv_estimator"], p.get("norm_mean_type"), p.get("norm_std_type"))
    ref = ref_rlvr_norm_fixed(i["response_level_rewards"], p["num_return_sequences"], *resolved)
    clip = p.get("reward_clip")
    assert_close(rewards, np.clip(ref, -clip, clip) if clip else ref, **NORM_TOL, what="vs reference")
    if not _is_bug3(*resolved):
        assert_close(rewards, case.outputs["response_level_rewards"], **NORM_TOL)
    for key, value in {**metrics, **post_metrics}.items():
        if key != "critic/reward_clip_frac" or not _is_bug3(*resolved):
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
def _ragged_lengths(ids: np.ndarray) -> np.ndarray:
    """Row lengths for the ragged variants: full, about half, full − 2, empty, repeated over the rows."""
    width = ids.shape[1]
    return np.array([(width, width // 2 + 1, width - 2, 0)[b % 4] for b in range(ids.shape[0])]).clip(0, width)


@pytest.mark.parametrize("name", EOS_MASK)
def test_get_eos_mask_golden_and_ragged(name):
    case = load(name)
    p = case.check_params(("eos_token",))
    ids, eos = case.inputs["response_id"], p["eos_token"]
    np.testing.assert_array_equal(get_eos_mask(ids, eos), case.outputs["eos_mask"])
    lengths = _ragged_lengths(ids)
    ragged = get_eos_mask(Ragged.from_padded(ids, lengths), eos)
    np.testing.assert_array_equal(ragged.values, Ragged.from_padded(case.outputs["eos_mask"], lengths).values)
    as_list = get_eos_mask([row[:n].tolist() for row, n in zip(ids, lengths)], eos)
    np.testing.assert_array_equal(as_list.values, ragged.values)


@pytest.mark.parametrize("name", PAD_MASK)
def test_get_pad_mask_golden_and_ragged(name):
    case = load(name)
    p = case.check_params(("pad_token", "eos_token"))
    ids = case.inputs["response_id"]
    np.testing.assert_array_equal(get_pad_mask(ids, p["pad_token"], p["eos_token"]), case.outputs["pad_mask"])
    lengths = _ragged_lengths(ids)
    ragged = get_pad_mask(Ragged.from_padded(ids, lengths), p["pad_token"], p["eos_token"])
    np.testing.assert_array_equal(ragged.values, Ragged.from_padded(case.outputs["pad_mask"], lengths).values)


def test_get_pad_mask_hand_cases_and_bad_rows():
    ids = np.array([[5, 7, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(get_pad_mask(ids, 0, 2), [[1, 1, 0, 0], [0, 0, 0, 0]])  # eos ≠ pad: pads dropped
    np.testing.assert_array_equal(get_pad_mask(ids, 0, 0), [[1, 1, 1, 0], [1, 0, 0, 0]])  # eos = pad: first kept
    with pytest.raises(InvariantError, match=r"rows \[1\]"):
        get_pad_mask(np.array([[5, 0], [0, 6]]), 0, 2)


SAMPLE_MASK_PARAMS = ("max_len_mask", "difficulty_mask", "error_max_len_clip", "error_max_len_threshold",
                      "difficulty_low_threshold", "difficulty_high_threshold", "num_return_sequences")


def _sample_mask_of_case(i: dict, p: dict, group=None):
    """get_sample_level_mask on a golden case's inputs and params, ROLL's defaults (§3.5) for a param the case leaves
    out (``group``: prompt keys, as the RLVR chain passes them). Returns (token mask (B, S-1), sample mask (B,),
    metrics); with ``group``, (sample mask, metrics)."""
    token_mask = i["response_mask"][:, 1:]
    s, metrics = get_sample_level_mask(
        token_mask.sum(-1), int(i["responses_width"]), i["scores"], p["num_return_sequences"],
        max_len_mask=p.get("max_len_mask", False), use_difficulty_mask=p.get("difficulty_mask", False),
        difficulty_low_threshold=p.get("difficulty_low_threshold", 0.0),
        difficulty_high_threshold=p.get("difficulty_high_threshold", 1.0),
        error_max_len_clip=p.get("error_max_len_clip", False),
        error_max_len_threshold=p.get("error_max_len_threshold", 9999999999), group=group)
    return (s, metrics) if group is not None else (token_mask, s, metrics)


@pytest.mark.parametrize("name", SAMPLE_LEVEL_MASK)
def test_get_sample_level_mask_golden(name):
    case = load(name)
    p, i = case.check_params(SAMPLE_MASK_PARAMS), case.inputs
    token_mask, s, metrics = _sample_mask_of_case(i, p)
    assert s.shape == (len(token_mask),) and s.dtype == np.float32
    np.testing.assert_array_equal(token_mask * s[:, None], case.outputs["final_response_mask"])
    golden = {k.split("metric:", 1)[1].replace("|", "/"): float(v) for k, v in case.outputs.items() if "metric:" in k}
    assert metrics == pytest.approx(golden)
    # the production call (groups keyed by prompt id, rows shuffled): the same mask and metrics, difficulty on or off
    order = np.random.default_rng(0).permutation(len(token_mask))
    keys = np.char.add("prompt-", (np.arange(len(token_mask)) // p["num_return_sequences"]).astype(str))
    for difficulty in (False, True):
        params = {**p, "difficulty_mask": difficulty}
        _, consecutive, consecutive_metrics = _sample_mask_of_case(i, params)
        keyed, keyed_metrics = _sample_mask_of_case({**i, "scores": i["scores"][order],
                                                     "response_mask": i["response_mask"][order]}, params,
                                                    group=keys[order])
        np.testing.assert_array_equal(keyed, consecutive[order])
        assert keyed_metrics == pytest.approx(consecutive_metrics)


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


def test_difficulty_mask_keyed_groups_and_unscored_rows():
    scores = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0.5, 1, 0], dtype=np.float64)
    order = np.random.default_rng(4).permutation(16)
    keys = np.char.add("p", (np.arange(16) // 4).astype(str))
    np.testing.assert_array_equal(difficulty_mask(scores[order], 4, 0.1, 0.95, group=keys[order]),
                                  difficulty_mask(scores, 4, 0.1, 0.95)[order])
    # a NaN score is left out of its group's pass rate; a group without a scored row is dropped
    with_none = np.array([1.0, np.nan, 0.0, np.nan, np.nan])
    np.testing.assert_array_equal(difficulty_mask(with_none, 2, 0.1, 0.95, group=np.array([0, 0, 1, 1, 2])),
                                  [False, False, False, False, False])
    np.testing.assert_array_equal(difficulty_mask(with_none, 2, -0.1, 0.95, group=np.array([0, 0, 1, 1, 2])),
                                  [False, False, True, True, False])
    s, metrics = get_sample_level_mask(np.full(5, 3), 10, with_none, 2, group=np.array([0, 0, 1, 1, 2]))
    np.testing.assert_array_equal(s, [1, 0, 1, 0, 0])                   # unscored rows get 0
    assert metrics["actor/samples_used"] == 2.0 and metrics["actor/final_mask_ratio"] == pytest.approx(0.4)


@pytest.mark.parametrize("name", AGENTIC_RESPONSE_MASK)
def test_agentic_response_level_mask_golden(name):
    """ROLL's agentic sample mask is a no-op whatever ``max_len_mask`` says (its branch is a stub, §5.5)."""
    case = load(name)
    case.check_params(("max_len_mask",))
    token_mask = case.inputs["response_mask"][:, 1:]
    s, metrics = agentic_response_level_mask(len(token_mask))
    np.testing.assert_array_equal(token_mask * s[:, None], case.outputs["final_response_mask"])
    golden = {k.split("metric:", 1)[1].replace("|", "/"): float(v) for k, v in case.outputs.items() if "metric:" in k}
    assert metrics == pytest.approx(golden)
