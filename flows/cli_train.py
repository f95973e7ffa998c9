"""The training commands of the ``rollflow`` CLI: ``train-step``, ``logprobs`` and ``values``.

Register them on the main app with :func:`register` (``flows/cli.py``: ``from flows.cli_train import register;
register(app)``). Each prints a readable result; user errors (bad input, bad config) print one message naming what,
where and the fix, and exit with status 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from flows.cli_common import OverrideOpt, announce_precision, guard as _guarded


def _state(result) -> str:
    return "up to date, skipped" if result.skipped else f"computed in {result.seconds:.1f}s"


def _print_metrics(metrics: dict[str, float], prefixes: tuple[str, ...]) -> None:
    for key in sorted(metrics):
        if key.startswith(prefixes):
            typer.echo(f"  {key:<34} {metrics[key]:.6g}")


def train_step(samples: Path = typer.Option(..., "--samples", help="Advantaged table folder (Parquet)."),
               checkpoint: Path = typer.Option(..., "--checkpoint", help="Model folder: the default model or an "
                                                                         "earlier train-step output."),
               config: Optional[Path] = typer.Option(None, "--config", help="YAML training config "
                                                                            "(schemas/train_config.py)."),
               output: Path = typer.Option(..., "--output", help="New checkpoint folder."),
               overrides: Optional[list[str]] = OverrideOpt,
               force: bool = typer.Option(False, "--force", help="Train even if the output is up to date.")) -> None:
    """One PPO training step (actor, and critic for gae) on DeepSpeed under Ray Train; writes a checkpoint."""
    from schemas.config import load_config, parse_overrides
    from schemas.train_config import TrainStepConfig

    cfg = _guarded(lambda: load_config(TrainStepConfig, config, parse_overrides(overrides or [])))
    announce_precision()
    from stages.train.stage import run_train_step

    result = _guarded(lambda: run_train_step(str(samples), str(checkpoint), cfg, str(output), force=force))
    typer.echo(f"checkpoint  {result.output}  (step {result.state.get('global_step')}, {result.rows:,} rows, "
               f"{_state(result)})")
    _print_metrics(result.metrics, ("actor/", "critic/", "system/", "time/"))


def logprobs(samples: Path = typer.Option(..., "--samples", help="Samples table folder (Parquet)."),
             checkpoint: Path = typer.Option(..., "--checkpoint", help="Model folder for old_log_probs."),
             reference: Optional[Path] = typer.Option(None, "--reference", help="Model folder for ref_log_probs "
                                                                               "(default: the checkpoint)."),
             config: Optional[Path] = typer.Option(None, "--config", help="YAML forward config (ForwardConfig)."),
             output: Path = typer.Option(..., "--output", help="New table folder."),
             overrides: Optional[list[str]] = OverrideOpt,
             force: bool = typer.Option(False, "--force")) -> None:
    """Add old_log_probs (and ref_log_probs, entropy) to a samples table, in a Ray Data actor pool."""
    from schemas.config import load_config, parse_overrides
    from schemas.train_config import ForwardConfig

    cfg = _guarded(lambda: load_config(ForwardConfig, config, parse_overrides(overrides or [])))
    announce_precision()
    from stages.train.stage import run_logprobs

    result = _guarded(lambda: run_logprobs(str(samples), str(checkpoint), cfg, str(output),
                                           reference=str(reference) if reference else None, force=force))
    typer.echo(f"logprobs  {result.output}  ({result.rows:,} rows, {_state(result)})")
    _print_metrics(result.metrics, ("logprobs/",))


def values(samples: Path = typer.Option(..., "--samples", help="Samples table folder (Parquet)."),
           checkpoint: Path = typer.Option(..., "--checkpoint", help="Checkpoint whose critic/ gives the values (a "
                                                                     "new seeded value head before the first step)."),
           config: Optional[Path] = typer.Option(None, "--config", help="YAML forward config (ForwardConfig)."),
           output: Path = typer.Option(..., "--output", help="New table folder."),
           overrides: Optional[list[str]] = OverrideOpt,
           force: bool = typer.Option(False, "--force")) -> None:
    """Add the critic's values to a samples table (gae), in a Ray Data actor pool."""
    from schemas.config import load_config, parse_overrides
    from schemas.train_config import ForwardConfig

    cfg = _guarded(lambda: load_config(ForwardConfig, config, parse_overrides(overrides or [])))
    announce_precision()
    from stages.train.stage import run_values

    result = _guarded(lambda: run_values(str(samples), str(checkpoint), cfg, str(output), force=force))
    typer.echo(f"values  {result.output}  ({result.rows:,} rows, {_state(result)})")
    _print_metrics(result.metrics, ("values/",))


def register(app: typer.Typer) -> None:
    """Add ``train-step``, ``logprobs`` and ``values`` to ``app``."""
    app.command("train-step")(train_step)
    app.command("logprobs")(logprobs)
    app.command("values")(values)
