"""Every golden case belongs to a family (ROLL function) that some conformance test runs over in full.

A family the table below does not know — a new ROLL function in ``tests/golden_vectors`` — fails here with its name
instead of going unchecked. Environment functions (``roll.pipeline.agentic.env.*``) are dispatched by kind in
tests/envs/test_golden_envs.py, which fails on a kind it cannot check.
"""

import os
from pathlib import Path

from tests import golden

TESTS = Path(__file__).resolve().parent
F = "roll.utils.functionals."
A = "roll.pipeline.agentic.utils."
FAMILIES = {
    F + "{log_probs_from_logits,entropy_from_logits}": ("losses/test_primitives.py", "train/test_conformance.py"),
    F + "{masked_mean,masked_sum,masked_var,masked_whiten,masked_normalize,response_level_masked_whiten}":
        ("losses/test_primitives.py", "algos/test_token_level.py"),
    F + "compute_approx_kl": ("losses/test_primitives.py", "algos/test_token_level.py"),
    F + "compute_clip_fraction": ("algos/test_token_level.py",),
    "roll.utils.kl_controller.{AdaptiveKLController,FixedKLController,get_kl_controller}":
        ("algos/test_token_level.py",),
    F + "compute_token_reward": ("algos/test_token_level.py",),
    F + "apply_kl_penalty": ("algos/test_token_level.py",),
    F + "compute_reinforce_return": ("algos/test_token_level.py",),
    F + "compute_gae_advantage_return": ("algos/test_token_level.py",),
    F + "compute_advantage": ("algos/test_token_level.py",),
    A + "agentic_compute_advantage": ("algos/test_token_level.py",),
    A + "compute_agentic_reinforce_return": ("algos/test_token_level.py",),
    A + "compute_segment_masked_mean": ("losses/test_primitives.py", "algos/test_token_level.py"),
    F + "RunningMoments.update": ("algos/test_response_level.py",),
    F + "reward_norm": ("algos/test_response_level.py",),
    F + "reward_postprocess": ("algos/test_response_level.py",),
    F + "group_reward_norm": ("algos/test_response_level.py",),
    F + "get_eos_mask": ("algos/test_response_level.py",),
    F + "get_pad_mask": ("algos/test_response_level.py",),
    F + "get_sample_level_mask": ("algos/test_response_level.py", "rlvr/test_chain.py"),
    A + "agentic_reward_norm": ("algos/test_response_level.py",),
    "roll.pipeline.agentic.agentic_config.RewardNormalizationConfig.__post_init__": ("algos/test_response_level.py",),
    A + "compute_discounted_returns": ("algos/test_response_level.py",),
    A + "build_state_group": ("algos/test_response_level.py",),
    A + "compute_response_level_rewards": ("algos/test_response_level.py",),
    A + "get_agentic_response_level_mask": ("algos/test_response_level.py",),
    "agentic pipeline chain: compute_discounted_returns -> get_agentic_response_level_mask -> "
    "compute_response_level_rewards -> compute_token_reward -> agentic_compute_advantage":
        ("algos/test_response_level.py", "spine/test_statistics.py"),
    "rlvr pipeline chain (one domain): get_sample_level_mask -> reward_postprocess -> compute_token_reward -> "
    "compute_advantage(response_mask=final_response_mask)":
        ("algos/test_response_level.py", "rlvr/test_chain.py", "rlvr/test_stages.py"),
    F + "agg_loss": ("losses/test_aggregation.py",),
    "roll.pipeline.agentic.agentic_actor_worker.ActorWorker.loss_func":
        ("losses/test_actor_golden.py", "train/test_conformance.py"),
    "roll.pipeline.base_worker.ActorWorker.loss_func": ("losses/test_actor_golden.py", "train/test_conformance.py"),
    "roll.pipeline.rlvr.actor_worker.ActorWorker.loss_func":
        ("losses/test_actor_golden.py", "train/test_conformance.py"),
    "roll.pipeline.base_worker.CriticWorker.loss_func": ("losses/test_critic.py", "train/test_conformance.py"),
    "roll.utils.train_infer_corrections.compute_train_infer_correction": ("losses/test_train_infer.py",),
    "roll.utils.train_infer_corrections.apply_train_infer_correction_to_batch": ("losses/test_train_infer.py",),
}
ENV_FUNCTIONS = "roll.pipeline.agentic.env."


def test_every_golden_family_has_a_conformance_test():
    functions = {meta["roll_function"] for meta in golden.manifest().values()}
    unknown = sorted(f for f in functions if f not in FAMILIES and not f.startswith(ENV_FUNCTIONS))
    assert not unknown, f"golden families without a conformance test: {unknown}"


def test_the_listed_test_files_exist_and_name_their_family():
    for function, files in FAMILIES.items():
        for name in files:
            text = (TESTS / name).read_text()
            tail = function.rsplit(".", 1)[-1].split(" ")[0].strip("{}").split(",")[0]
            assert tail in text or "chain" in function, f"{name} does not mention {function}"


def test_the_golden_vectors_ship_with_the_repository():
    """Every case the manifest lists is a file in tests/golden_vectors, so a fresh clone runs every conformance test
    with nothing beside it; where the spec's copy is at hand (shared/spec/golden beside the repository), ours holds
    every case of it byte for byte."""
    assert golden.GOLDEN_DIR.is_relative_to(TESTS) or "ROLLFLOW_GOLDEN_DIR" in os.environ
    missing = [meta["file"] for meta in golden.manifest().values() if not (golden.GOLDEN_DIR / meta["file"]).is_file()]
    assert not missing, f"golden vectors listed in the manifest but missing: {missing}"
    spec = TESTS.parent.parent / "shared/spec/golden"
    if spec.is_dir():
        stale = [p.name for p in sorted(spec.iterdir())
                 if not (golden.GOLDEN_DIR / p.name).is_file()
                 or (golden.GOLDEN_DIR / p.name).read_bytes() != p.read_bytes()]
        assert not stale, f"tests/golden_vectors differs from {spec} in {stale}: copy them again"
