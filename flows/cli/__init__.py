"""The ``rollflow`` command line: one Typer app (:mod:`flows.cli.app`) whose commands live in the modules of this
package, one per capability — tables (recompute, stage, inspect, validate, example, demo), training (train, plan,
train-step, logprobs, values), rollout (rollout, show), RLVR (score, rlvr-example), operations (server, deploy,
report). Every command prints a readable result; user errors (bad input, bad config) print one message naming what,
where and the fix, and exit with status 2."""

from __future__ import annotations

import logging
import sys
import traceback

from flows import interrupt
from flows.cli import tables, training, rollout, rlvr, ops  # noqa: F401,I001  (each adds its commands; --help order)
from flows.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    interrupt.install(sys.argv[1:])  # Ctrl-C: stop the work, one line (what is committed, how to resume), exit 130
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # a bug, not a user error (those end in flows.cli.common.fail): the traceback, and where the log is
        from flows import console  # the log's place: only after a failure (not loaded for --help)

        traceback.print_exc()
        if console.log_path() is not None:
            logging.getLogger("rollflow").exception("the command failed", extra={"hide": True})  # the file only
            print(f"the log of this command: {console.log_path()}", file=sys.stderr)
        sys.exit(1)

