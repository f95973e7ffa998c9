"""The table commands: ``recompute`` (rewards and advantages of stored trajectories), ``stage`` (re-run one stage),
``lineage``, ``inspect``, ``validate``, ``example`` and ``demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from flows import settings
from flows.cli.app import app
from flows.cli.common import OverrideOpt, fail as _fail, guard as _guard

# Each command imports what it runs inside its function (config models: pydantic; tables: pyarrow; flows: Prefect;
# Ray; torch), so `rollflow --help` and every command load their own libraries only (CONTRIBUTING.md, imports).


def _print_recompute(result: dict) -> None:
    from flows.tableview import render, summarize

    for name in ("rewarded", "advantaged"):
        r = result[name]
        state = "up to date, skipped" if r["skipped"] else f"computed in {r['seconds']:.1f}s"
        typer.echo(f"{name:<11} {r['output']}  ({r['rows']:,} rows, {state})")
    typer.echo("")
    typer.echo(render(summarize(result["advantaged"]["output"])))


@app.command()
def recompute(input: str = typer.Option(..., "--input", help="Folder of stored samples (Parquet): a path or an "
                                                             "s3://bucket/folder URI."),
              config: Optional[Path] = typer.Option(None, "--config", help="YAML config (configs/recompute_*.yaml)."),
              output: str = typer.Option(..., "--output", help="Folder for the rewarded/ and advantaged/ tables (a "
                                                               "path or an s3://bucket/folder URI)."),
              overrides: Optional[list[str]] = OverrideOpt,
              force: bool = typer.Option(False, "--force", help="Recompute even if outputs are up to date.")) -> None:
    """Recompute response-level rewards, token rewards and advantages of stored trajectories."""
    from schemas.config import RecomputeConfig, load_config, parse_overrides

    cfg = _guard(lambda: load_config(RecomputeConfig, config, parse_overrides(overrides or [])))
    from flows.recompute import recompute_flow, recompute_steps
    from flows.services import start_services
    from stages.cluster import check_stage_resources
    from stages.preflight import check_command_output, check_steps

    steps = recompute_steps(str(input), str(output), cfg)
    _guard(lambda: check_command_output("rollflow recompute", str(output), steps, {"--input": str(input)}))
    _guard(lambda: check_steps(steps))  # before Prefect and Ray start
    _guard(lambda: start_services(cfg.runtime))
    _guard(lambda: check_stage_resources(cfg.runtime))  # a stage pinned to resources no node has would wait forever
    result = _guard(lambda: recompute_flow(str(input), str(output), cfg.model_dump(mode="json"), force,
                                           preflight=False))
    _print_recompute(result)


@app.command()
def stage(name: str = typer.Argument(..., help="Stage name: rollout_turn (a rollout from one of its turns), "
                                                "rollout_reset (a rollout from its episodes), response_rewards, "
                                                "advantages, rewards, rlvr_samples, logprobs, values, train_step "
                                                "(a checkpoint) or eval (an evaluation)."),
          run_dir: str = typer.Option(..., "--from", help="An existing output folder of that stage (its manifest "
                                                            "records the inputs and config), e.g. "
                                                            "runs/<run>/iter_0000/rollout/turns/turn_001."),
          overrides: Optional[list[str]] = OverrideOpt,
          output: Optional[str] = typer.Option(None, "--output", help="New output folder (default: beside the old "
                                                                       "one, named <stage>@<tag>)."),
          downstream: bool = typer.Option(False, "--downstream", help="Also recompute every output beside it that "
                                                                      "reads it, and theirs (each <folder>@<tag>)."),
          checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="rollout_turn / rollout_reset: a copy "
                                                    "of the checkpoint the rollout was played with (same files, sizes "
                                                    "and modification times, cp -a), when the recorded one moved."),
          force: bool = typer.Option(False, "--force")) -> None:
    """Re-run one stage on its recorded inputs with changed settings, keeping the old output."""
    from flows.rerun import rerun_stage

    for line in _guard(lambda: rerun_stage(name, str(run_dir), overrides or [], output and str(output),
                                           downstream, force, checkpoint and str(checkpoint))):
        typer.echo(line)


@app.command()
def lineage(path: str = typer.Argument(..., help="A stage output (a folder with manifest.json) or a run folder "
                                          "(a path or a URI).")
            ) -> None:
    """Show where a table came from (the inputs its manifest records, and theirs) and which stage outputs under the
    folder are stale (an input changed or went away since they were written)."""
    from flows.lineage import lineage_lines

    for line in _guard(lambda: lineage_lines(str(path))):
        typer.echo(line)


@app.command()
def inspect(path: str = typer.Argument(..., help="A table folder (a path or a URI).")) -> None:
    """Show a table's schema, rows, groups and summary statistics."""
    from flows.tableview import render, summarize

    typer.echo(_guard(lambda: render(summarize(str(path)))))


@app.command()
def validate(path: str = typer.Argument(..., help="A table folder (a path or a URI)."),
             group_size: Optional[int] = typer.Option(None, min=1, help="Check complete groups of this "
                                                                           "size.")) -> None:
    """Check a table's schema and invariants (exit 2 on the first violation)."""
    from flows.tableview import validate as check

    typer.echo(_guard(lambda: check(str(path), group_size)))


@app.command()
def example(output: str = typer.Option(..., "--output", help="New folder for the generated samples (a path "
                                                               "or a URI)."),
            samples: int = typer.Option(2048, "--samples", min=1, help="Rows to generate (rounded up to whole "
                                                                        "groups)."),
            seed: int = typer.Option(0, "--seed", min=0, help="Seed of the generated data."),
            group_size: int = typer.Option(8, "--group-size", min=1, help="Trajectories per group."),
            env: str = typer.Option("frozenlake", "--env", help="frozenlake or sokoban (reward shape)."),
            level: str = typer.Option("step", "--level", help="step (one row per turn) or trajectory."),
            min_response: int = typer.Option(64, "--min-response", min=0, help="Shortest response, tokens."),
            max_response: int = typer.Option(512, "--max-response", min=1, help="Longest response, tokens (at "
                                                                                 "least --min-response).")) -> None:
    """Generate realistic stored trajectories (FrozenLake/Sokoban-shaped) for trying rollflow."""
    from stages.example import ExampleSpec, generate

    if env not in ("frozenlake", "sokoban") or level not in ("step", "trajectory"):
        _fail(ValueError(f"--env {env!r} / --level {level!r}: --env must be frozenlake or sokoban and --level step "
                         "or trajectory"))
    spec = ExampleSpec(samples=samples, seed=seed, group_size=group_size, env=env, level=level,
                       response_len=(min_response, max_response))
    from stages.outputs import check_output

    from stages.storage import Location

    if not _guard(lambda: Location.of(str(output)).exists()):
        _guard(lambda: check_output(str(output), None))  # not inside a committed table (an existing folder: generate)
    manifest = _guard(lambda: generate(spec, str(output)))
    typer.echo(f"wrote {manifest['rows']:,} {level}-level rows in {manifest['groups']:,} groups of {group_size} "
               f"to {output}")


@app.command()
def demo(run_dir: Path = typer.Option(Path("runs/demo"), "--run-dir"),
         config: Path = typer.Option(settings.REPO / "configs/recompute_gigpo.yaml", "--config")) -> None:
    """The embedded default: generate an example set (once) and recompute its rewards and advantages."""
    from schemas.config import RecomputeConfig, load_config
    from stages.example import ExampleSpec, generate

    cfg = _guard(lambda: load_config(RecomputeConfig, config))  # a bad config writes nothing
    from stages.outputs import Writes, check_output

    _guard(lambda: check_output(str(run_dir), Writes("rollflow demo", (), {"samples": ("example",), "recompute": ()}),
                                flag="--run-dir"))
    samples_dir = run_dir / "samples"
    if not samples_dir.exists():
        manifest = _guard(lambda: generate(ExampleSpec(samples=4096, seed=0), str(samples_dir)))
        typer.echo(f"generated {manifest['rows']:,} example rows in {samples_dir}")
    from flows.recompute import recompute_flow
    from flows.services import start_services

    _guard(lambda: start_services(cfg.runtime))
    result = _guard(lambda: recompute_flow(str(samples_dir), str(run_dir / "recompute"), cfg.model_dump(mode="json")))
    _print_recompute(result)
    typer.echo(f"\nconfig {config}; outputs under {run_dir / 'recompute'} (rollflow inspect DIR to look again)")
