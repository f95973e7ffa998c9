"""The one ``rollflow`` Typer app and its global options. The command modules of this package add their commands to
it (``@app.command()``); ``flows.cli`` imports them all."""

from __future__ import annotations

import sys

import typer

from flows import settings

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="rollflow: ROLL's RL post-training algorithms as Prefect flows of Ray Data stages.")


@app.callback()
def _main(ctx: typer.Context,
          verbose: bool = typer.Option(False, "--verbose", "-v", help="Also show the log (rollflow's, Ray's, "
                                                                     "Prefect's, ...) on the console; it always goes "
                                                                     "to the log file (runs/<run>/logs/rollflow.log "
                                                                     "for train).")) -> None:
    # imported when a command runs, not for --help (watchdog loads subprocess: a few ms of every --help)
    from flows import console
    from stages import progress, watchdog

    watchdog.start()  # what the command starts (a local Ray cluster, Prefect's ephemeral server) dies with it
    console.setup(verbose, ctx.invoked_subcommand)
    progress.enable(sys.stderr.isatty(), ray_data=verbose)
    settings.configure()
