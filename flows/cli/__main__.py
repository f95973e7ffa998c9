"""``python -m flows.cli COMMAND ...``: the rollflow command line."""

from flows.cli import main

main()
