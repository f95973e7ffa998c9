"""The ``recompute`` flow: stored trajectories + a config → ``rewarded`` and ``advantaged`` tables.

Each stage is a Prefect task calling the one runner, so a re-run skips what is done and a killed run resumes at the
first stage without a committed output.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task

from schemas.config import AdvantageSection, RecomputeConfig, ResponseRewardSection, section, validate_config
from stages.cluster import ensure_ray
from stages.recompute import AdvantagesStage, ResponseRewardsStage
from stages.runner import StageResult, run_stage


def _summary(result: StageResult) -> dict[str, Any]:
    return {"output": result.output, "rows": result.rows, "skipped": result.skipped,
            "seconds": round(result.seconds, 2), "metrics": result.metrics, "state": result.state}


@task(name="response_rewards", retries=0)
def response_rewards_task(samples: str, output: str, cfg: dict, force: bool) -> dict:
    config = validate_config(RecomputeConfig, cfg)
    return _summary(run_stage(ResponseRewardsStage(), section(config, ResponseRewardSection),
                              {"samples": samples}, output, force=force, batch_rows=config.runtime.batch_rows))


@task(name="advantages", retries=0)
def advantages_task(samples: str, rewarded: str, output: str, cfg: dict, force: bool,
                    state_in: dict | None = None) -> dict:
    config = validate_config(RecomputeConfig, cfg)
    return _summary(run_stage(AdvantagesStage(), section(config, AdvantageSection),
                              {"samples": samples, "rewarded": rewarded}, output, force=force, state_in=state_in,
                              batch_rows=config.runtime.batch_rows))


@flow(name="recompute", log_prints=True)
def recompute_flow(input_dir: str, output_dir: str, cfg: dict, force: bool = False) -> dict:
    """Recompute response-level rewards, token rewards and advantages of the samples in ``input_dir``."""
    config = validate_config(RecomputeConfig, cfg)
    ensure_ray(config.runtime.ray_address, config.runtime.num_cpus, data_memory_mb=config.runtime.data_memory_mb)
    rewarded_dir = f"{output_dir.rstrip('/')}/rewarded"
    advantaged_dir = f"{output_dir.rstrip('/')}/advantaged"
    rewarded = response_rewards_task(input_dir, rewarded_dir, cfg, force)
    advantaged = advantages_task(input_dir, rewarded_dir, advantaged_dir, cfg, force)
    return {"rewarded": rewarded, "advantaged": advantaged}
