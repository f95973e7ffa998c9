"""Scoring stored RLVR responses: the reward stage, then optionally the RLVR chain up to advantages, each through the
one runner. Shared by ``rollflow score`` (flows/cli_rlvr.py, offline) and the RLVR training flow
(flows/rlvr_train.py, once per step)."""

from __future__ import annotations

from typing import Any


def score_responses(input_dir: str, output_dir: str, cfg, *, advantages: bool = False, force: bool = False,
                    state_in: dict | None = None, services: dict | None = None) -> dict[str, Any]:
    """Run the reward stage (and with ``advantages`` the RLVR chain) on the responses in ``input_dir``.

    Outputs: ``<output_dir>/scored`` (+ ``rlvr_rewarded``, ``advantaged``). ``state_in``: ``running_moments`` and
    ``kl_ctrl`` of a previous step (from its manifests' ``state``); ``services``: reward-stage service factories."""
    from schemas.rlvr_config import reward_section, rlvr_reward_section
    from stages.cluster import ensure_ray
    from stages.rlvr.stages import RewardStage, RLVRRewardsStage
    from stages.runner import run_stage

    ensure_ray(cfg.runtime.ray_address, cfg.runtime.num_cpus, progress=False)
    out = output_dir.rstrip("/")
    state_in = state_in or {}
    rows = cfg.runtime.batch_rows
    results = {"scored": run_stage(RewardStage(services), reward_section(cfg), {"responses": input_dir},
                                   f"{out}/scored", force=force, batch_rows=rows)}
    if advantages:
        results["rlvr_rewarded"] = run_stage(
            RLVRRewardsStage(), rlvr_reward_section(cfg), {"responses": input_dir, "scored": f"{out}/scored"},
            f"{out}/rlvr_rewarded", force=force, batch_rows=rows,
            state_in={"running_moments": state_in.get("running_moments", {})})
        results["advantaged"] = rlvr_advantages(cfg, input_dir, f"{out}/rlvr_rewarded", f"{out}/advantaged",
                                                state_in, force=force)
    return results


def rlvr_advantages(cfg, responses: str, rewarded: str, output: str, state_in: dict, *, force: bool = False):
    """The RLVR advantages stage (token rewards, advantages, ``final_response_mask``) on ``responses`` and their
    ``rlvr_rewarded`` rows; ``state_in`` may carry the KL controller (``kl_ctrl``) of a previous step."""
    from schemas.rlvr_config import rlvr_advantage_section
    from stages.rlvr.stages import RLVRAdvantagesStage
    from stages.runner import run_stage

    return run_stage(RLVRAdvantagesStage(), rlvr_advantage_section(cfg),
                     {"responses": responses, "rlvr_rewarded": rewarded}, output, force=force,
                     batch_rows=cfg.runtime.batch_rows,
                     state_in={"kl_ctrl": state_in["kl_ctrl"]} if "kl_ctrl" in state_in else {})
