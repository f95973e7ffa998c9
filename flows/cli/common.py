"""What every ``rollflow`` command module shares: the ``--set`` option and the one way user errors end a command
(one message on stderr naming what, where and the fix; exit status 2)."""

from __future__ import annotations

import typer

from schemas.errors import RollflowError

# Each command imports what it runs inside its function (config models: pydantic; tables: pyarrow; flows: Prefect;
# Ray; torch), so `rollflow --help` and every command load their own libraries only (CONTRIBUTING.md, imports).

OverrideOpt = typer.Option(None, "--set", help="Config override key=value (dotted keys, YAML values); repeatable.")


def fail(err: Exception) -> None:
    """Print ``err`` as a user error and exit with status 2."""
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(2)


def guard(fn):
    """Run ``fn``; rollflow's user errors (bad input, bad config), existing outputs and an object store that cannot
    be used end the command via :func:`fail`. Anything else is a bug and propagates with its traceback."""
    from stages.storage import store_error

    try:
        return fn()
    except (RollflowError, FileExistsError) as err:
        fail(err)
    except OSError as err:  # an object store that failed after the command's checks (it went away, access revoked)
        mapped = store_error(err)
        if mapped is None:
            raise
        fail(mapped)


def announce_precision() -> None:
    """Print which dtypes ``dtype: auto`` resolved to while the command's config was loaded, and why; and what the
    optimizer, torch_compile and sampler options resolved to on this host (schemas/toolchain.py)."""
    from schemas import precision, toolchain

    for line in (precision.choices_line(), toolchain.choices_line()):
        if line:
            typer.echo(f"[setup] {line}")


def connect(runtime) -> None:
    """Join or start the Ray cluster a command's config names (its ``runtime`` section): once, when the command
    starts; the stages it runs use that cluster."""
    from stages.cluster import check_stage_resources, connect_runtime

    guard(lambda: connect_runtime(runtime))
    guard(lambda: check_stage_resources(runtime))
