"""The operations commands: ``server`` (a local Prefect server), ``deploy`` (a scheduled deployment) and ``report``
(plots and an HTML page of a run)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

import typer

from flows import interrupt, settings
from flows.cli.app import app
from flows.cli.common import OverrideOpt, fail as _fail, guard as _guard
from schemas.errors import ConfigError

# Each command imports what it runs inside its function (config models: pydantic; tables: pyarrow; flows: Prefect;
# Ray; torch), so `rollflow --help` and every command load their own libraries only (CONTRIBUTING.md, imports).

FLOWS = ("recompute", "train")  # deployable flows


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _default_server_home() -> Path:
    return settings.cache_dir() / "prefect-server"  # apart from the ephemeral runs' database in $PREFECT_HOME


@app.command()
def server(host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
           port: int = typer.Option(4200, "--port", min=1, max=65535, help="Port of the API and UI."),
           home: Optional[Path] = typer.Option(None, "--home", help="Folder of the server's database and log "
                                                                     "(default: .cache/prefect-server)."),
           timeout: float = typer.Option(120.0, "--timeout", min=1, help="Seconds to wait for the server to be healthy.")
           ) -> None:
    """Start a local Prefect server (API + UI) and keep it running until Ctrl-C."""
    from flows.serving import start_server

    if home is not None and not home.is_file():  # a file: start_server says so
        from stages.outputs import Writes, check_output

        # its database and log would land among a table's or a run's files
        _guard(lambda: check_output(str(home), Writes("rollflow server", loose=True), flag="--home"))
    interrupt.keep_keyboard_interrupt()  # Ctrl-C is how this command ends: it stops the server (below)
    srv = _guard(lambda: start_server(host, port, home or _default_server_home(), timeout))
    typer.echo(f"Prefect server at {srv.url} (UI), database and log in {srv.home}\n"
               f"point flows and `rollflow deploy` at it with:\n  export PREFECT_API_URL={srv.api_url}\n"
               "Ctrl-C stops it.")
    signal.signal(signal.SIGTERM, _interrupt)  # a supervisor's stop also stops the server's process group
    try:
        status = srv.process.wait()
        typer.echo(f"error: the server exited with status {status}; see {srv.log_path}", err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo("stopping the server")
        srv.stop()


@app.command()
def deploy(config: Optional[Path] = typer.Option(None, "--config", help="YAML config of the flow."),
           input: Optional[Path] = typer.Option(None, "--input", help="recompute: folder of stored samples."),
           output: Optional[Path] = typer.Option(None, "--output", help="recompute: folder the flow writes "
                                                                        "(re-runs skip up-to-date stages)."),
           cron: Optional[str] = typer.Option(None, "--cron", help="Cron schedule, e.g. '0 3 * * *' (03:00 daily)."),
           interval: Optional[float] = typer.Option(None, "--interval", min=1, help="Or: run every SECONDS."),
           timezone: Optional[str] = typer.Option(None, "--timezone", help="Time zone of --cron (default UTC)."),
           name: str = typer.Option("scheduled", "--name", help="Deployment name (flow/name in Prefect)."),
           flow: str = typer.Option("recompute", "--flow", help=f"Flow to deploy: {', '.join(FLOWS)} (train: the "
                                                                "config's pipeline; each scheduled run continues the "
                                                                "config's run folder for max_steps more "
                                                                "iterations)."),
           api_url: Optional[str] = typer.Option(None, "--api-url", help="Prefect API (default $PREFECT_API_URL; "
                                                                          "`rollflow server` prints it)."),
           overrides: Optional[list[str]] = OverrideOpt,
           force: bool = typer.Option(False, "--force", help="recompute: every run recomputes all stages.")) -> None:
    """Register a scheduled deployment of a flow on a Prefect server and execute its runs until Ctrl-C
    (which pauses the schedule)."""
    if flow not in FLOWS:
        _fail(ConfigError(f"deploy: --flow {flow!r} is not deployable; choose one of {list(FLOWS)}"))
    # what the user wrote (the config, its files, the schedule) is checked before the server is asked; the config
    # first, before Prefect loads (flows/serving.py: 1-4 s on the 2-core machine)
    target, parameters, what = _DEPLOYMENTS[flow](config, input, output, overrides or [], force)
    from flows.serving import deploy as serve_deployment
    from flows.serving import make_schedule, resolve_api_url

    _guard(lambda: make_schedule(cron, interval, timezone))
    api = _guard(lambda: resolve_api_url(api_url))
    when = f"cron '{cron}' ({timezone or 'UTC'})" if cron else f"every {interval:g} s"
    typer.echo(f"deployment {target.name}/{name} on {api}: {when}, {what}\nserving: due runs execute here, one "
               "at a time; Ctrl-C stops and pauses the schedule")
    interrupt.keep_keyboard_interrupt()  # Ctrl-C is how this command ends: it pauses the schedule (flows/serving.py)
    _guard(lambda: serve_deployment(target, name, cron=cron, interval_s=interval, timezone=timezone,
                                    parameters=parameters, api_url=api))


def _recompute_deployment(config, input, output, overrides, force):
    """(flow, parameters, description) of a scheduled recompute of ``input`` into ``output``."""
    from schemas.config import RecomputeConfig, load_config, parse_overrides

    cfg = _guard(lambda: load_config(RecomputeConfig, config, parse_overrides(overrides)))
    if input is None or output is None or not input.is_dir():
        _fail(ConfigError(f"deploy: --input {input} is not a folder; the recompute flow needs --input (the folder "
                          "of stored samples) and --output"))
    from stages.outputs import Writes, check_output

    _guard(lambda: check_output(str(output), Writes("rollflow recompute", (), {"rewarded": ("response_rewards",),
                                                                             "advantaged": ("advantages",)}),
                                {"--input": str(input)}))
    parameters = {"input_dir": str(input.resolve()), "output_dir": str(output.resolve()),
                  "cfg": cfg.model_dump(mode="json"), "force": force}
    from flows.recompute import recompute_flow

    return recompute_flow, parameters, f"input {parameters['input_dir']}, output {parameters['output_dir']}"


def _train_deployment(config, input, output, overrides, force):
    """(flow, parameters, description) of a scheduled training run of ``config``: every tick continues its run folder
    for max_steps more iterations (:func:`flows.serving.advance_run`)."""
    from flows.pipelines import pipeline_of
    from schemas.config import load_config_data, parse_overrides, validate_config

    if config is None or input is not None or output is not None or force:
        _fail(ConfigError("deploy --flow train takes --config (the run's YAML; the run folder is runs_dir/run_name) "
                          "and no --input, --output or --force"))
    data = _guard(lambda: load_config_data(config, parse_overrides(overrides)))
    pipeline = _guard(lambda: pipeline_of(data, str(config)))
    cfg = _guard(lambda: validate_config(pipeline.config_model(), data, str(config)))
    from stages.run_folder import check_run

    # what `rollflow train` checks before it starts (environments, prompt files, reward workers, engine options,
    # model folders, the run folder): a config that fails them would fail every tick, after the tick started Ray
    _guard(lambda: pipeline.preflight(cfg, False))
    _guard(lambda: check_run(cfg, cfg.model_dump(mode="json"), pipeline.spec))
    from flows.serving import advance_run

    return (advance_run, {"cfg": cfg.model_dump(mode="json"), "iterations": None},
            f"run folder {cfg.runs_dir}/{cfg.run_name}: each run continues it for {cfg.max_steps} more iterations")


_DEPLOYMENTS = {"recompute": _recompute_deployment, "train": _train_deployment}  # keys: FLOWS


@app.command()
def report(run: Path = typer.Argument(..., help="A run folder (runs/<run>) with a metrics/ table."),
           output: Optional[Path] = typer.Option(None, "--output", help="Folder for the plots and index.html "
                                                                       "(default RUN/report)."),
           episodes: int = typer.Option(3, "--episodes", min=0, help="Sample episodes shown from the last rollout.")
           ) -> None:
    """Write PNG plots of a run's metrics per iteration and an HTML page with them and sample episodes."""
    from flows.report import check_run_folder, write_report

    _guard(lambda: check_run_folder(run))
    if output is not None:
        from stages.outputs import Writes, check_output

        _guard(lambda: check_output(str(output), Writes("rollflow report", loose=True)))
    result = _guard(lambda: write_report(run, output=output, max_episodes=episodes))
    for stem, path in result.plots.items():
        typer.echo(f"{stem:<18} {path}")
    for line in result.missing:
        typer.echo(f"missing: {line}")
    typer.echo(f"\nreport: {result.html}")
