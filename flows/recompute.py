"""The ``recompute`` flow: stored trajectories + a config → ``rewarded`` and ``advantaged`` tables.

Each stage is a Prefect task of the run kit (flows/runkit.py, shared with the agentic flow) calling the one runner, so a re-run skips what is done and a killed run resumes at the
first stage without a committed output.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.runkit import advantages_task, rewards_task
from schemas.config import AdvantageSection, RecomputeConfig, ResponseRewardSection, section, validate_config
from stages import cluster  # cluster.ensure_ray looked up at the call, as in every flow (tests replace it)
from stages.advantages import AdvantagesStage
from stages.commit import cleanup_leftovers
from stages.preflight import Step, check_steps
from stages.response_rewards import ResponseRewardsStage
from stages.stage import StageResult
from stages.storage import Location


def _summary(result: StageResult) -> dict[str, Any]:
    return {"output": result.output, "rows": result.rows, "skipped": result.skipped,
            "seconds": round(result.seconds, 2), "metrics": result.metrics, "state": result.state}


def outputs(output_dir: str) -> tuple[str, str]:
    """The folders of the two tables the flow writes under ``output_dir``: rewarded, advantaged."""
    return f"{output_dir.rstrip('/')}/rewarded", f"{output_dir.rstrip('/')}/advantaged"


def recompute_steps(input_dir: str, output_dir: str, config: RecomputeConfig) -> list[Step]:
    """The flow's two stages with their inputs and outputs, for the pre-flight check (stages/preflight.py)."""
    rewarded_dir, advantaged_dir = outputs(output_dir)
    return [Step(ResponseRewardsStage(), section(config, ResponseRewardSection), {"samples": input_dir}, rewarded_dir),
            Step(AdvantagesStage(), section(config, AdvantageSection),
                 {"samples": input_dir, "rewarded": rewarded_dir}, advantaged_dir)]


@flow(name="recompute", log_prints=True)
def recompute_flow(input_dir: str, output_dir: str, cfg: dict, force: bool = False, preflight: bool = True) -> dict:
    """Recompute response-level rewards, token rewards and advantages of the samples in ``input_dir``. First the
    input is checked for everything both stages need (``preflight``; the CLI checks before it starts the flow and
    passes False), so bad input commits neither table."""
    config = validate_config(RecomputeConfig, cfg)
    if preflight:
        check_steps(recompute_steps(input_dir, output_dir, config))
    rewarded_dir, advantaged_dir = outputs(output_dir)
    for out in (rewarded_dir, advantaged_dir):  # a killed attempt's temporary folders, whichever stage refuses
        cleanup_leftovers(Location.of(out))

    rt = config.runtime
    cluster.ensure_ray(rt.ray_address, rt.num_cpus, data_memory_mb=rt.data_memory_mb)
    cluster.check_stage_resources(rt)
    rewarded = rewards_task(section(config, ResponseRewardSection), input_dir, rewarded_dir, force=force,
                            batch_rows=rt.batch_rows, resources=rt.resources_for("response_rewards"))
    advantaged = advantages_task(section(config, AdvantageSection), input_dir, rewarded_dir, advantaged_dir, None,
                                 force=force, batch_rows=rt.batch_rows, resources=rt.resources_for("advantages"))
    return {"rewarded": _summary(rewarded), "advantaged": _summary(advantaged)}
