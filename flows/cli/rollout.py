"""The rollout commands: ``rollout`` (play episodes, write samples) and ``show`` (render a rollout's episodes)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from flows.cli.app import app
from flows.cli.common import OverrideOpt, announce_precision, connect, guard as _guard

# Each command imports what it runs inside its function (config models: pydantic; tables: pyarrow; flows: Prefect;
# Ray; torch), so `rollflow --help` and every command load their own libraries only (CONTRIBUTING.md, imports).


def _progress(name: str, info: dict) -> None:
    result = info["result"]
    state = "committed earlier, skipped" if result.skipped else f"{result.seconds:.1f}s"
    if name == "turn":
        m = result.metrics
        typer.echo(f"turn {info['turn'] + 1:>3}: {int(m.get('rows', result.rows)):>5} episodes played, "
                   f"{int(m.get('active', 0)):>5} still running, {int(m.get('response_tokens', 0)):>7} response "
                   f"tokens  ({state})")
    else:
        typer.echo(f"{name:<9} {result.output}  ({result.rows:,} rows, {state})")


def _print_summary(result) -> None:
    m = result.metrics
    typer.echo("")
    keys = ["rollout/episodes", "rollout/success_rate", "rollout/valid_action_rate", "rollout/format_penalty_rate",
            "rollout/truncated_response_rate", "rollout/mean_episode_length", "rollout/episode_score/mean",
            "rollout/response_tokens"]
    keys += sorted(k for k in m if k.startswith("rollout/stop/") and m[k])
    for key in keys:
        if key in m:
            value = m[key]
            typer.echo(f"  {key:<34} {value:,.0f}" if value >= 100 else f"  {key:<34} {value:.4g}")
    t = result.timings
    typer.echo(f"\n  wall {result.seconds:.1f}s: engine build {result.engine_build_seconds:.1f}s, turns "
               f"{t.get('turn_seconds', 0):.1f}s (generate {t.get('generate_seconds', 0):.1f}s, env "
               f"{t.get('env_seconds', 0):.1f}s), samples {t.get('samples_seconds', 0):.1f}s")
    typer.echo(f"  samples: {result.samples.output}  (rollflow show {result.output} to read the episodes)")


@app.command()
def rollout(config: Optional[Path] = typer.Option(None, "--config", help="YAML config (configs/rollout_*.yaml)."),
            checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="HF checkpoint folder of the "
                                                                                  "policy (default: the default "
                                                                                  "model, converted once)."),
            output: str = typer.Option(..., "--output", help="Folder for episodes/, turns/ and samples/ (a "
                                                              "path or an s3://bucket/folder URI)."),
            overrides: Optional[list[str]] = OverrideOpt,
            force: bool = typer.Option(False, "--force", help="Recompute every stage even if committed.")) -> None:
    """Play episodes with the policy, turn by turn, and write training samples (resumes a killed rollout)."""
    from schemas.config import load_config, parse_overrides
    from schemas.rollout_config import RolloutConfig

    cfg = _guard(lambda: load_config(RolloutConfig, config, parse_overrides(overrides or [])))
    announce_precision()
    from stages.rollout.driver import check_rollout, run_rollout

    _guard(lambda: check_rollout(cfg, str(output), str(checkpoint) if checkpoint else None))  # before Ray starts
    connect(cfg.runtime)

    tags = ", ".join(f"{e.tag} x{e.num_groups}" for e in cfg.env_layout())
    typer.echo(f"rollout: {cfg.num_episodes} episodes ({cfg.env.num_env_groups} groups x {cfg.env.group_size}: "
               f"{tags}), up to {max(e.max_steps for e in cfg.env_layout())} turns, {cfg.sample_level}-level samples, "
               f"{cfg.engine.backend} engine")
    result = _guard(lambda: run_rollout(cfg, str(output), str(checkpoint) if checkpoint else None, force=force,
                                        on_event=_progress))
    _print_summary(result)


@app.command()
def show(path: str = typer.Argument(..., help="A rollout output folder (a path or a URI)."),
         episodes: int = typer.Option(3, "--episodes", "-n", min=1, help="How many episodes to show (in episode order)."),
         traj_id: Optional[str] = typer.Option(None, "--traj", help="Show only this episode (a traj_id)."),
         max_text: int = typer.Option(400, "--max-text", min=1, help="Characters of model text shown per turn.")) -> None:
    """Render a rollout's episodes turn by turn: observation, model text, parsed action, reward."""
    from stages.rollout.show import render_rollout

    typer.echo(_guard(lambda: render_rollout(str(path), episodes, traj_id, max_text)))
