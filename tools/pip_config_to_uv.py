"""Print the ``uv pip install`` options that make uv read packages where this machine's pip does.

uv reads neither pip's configuration files nor its ``PIP_*`` variables, so ``make setup`` asks pip itself
(``pip config list``: every file and variable pip would read) and hands uv the same indexes, find-links folders,
constraints, trusted hosts and certificate. Precedence is pip's: a ``PIP_*`` variable over the site file over the user
file over the global file. uv then picks the best version over all indexes, as pip does
(``--index-strategy unsafe-best-match``): on these machines the CPU build of torch lies in a find-links folder and
PyPI has a CUDA build of the same version.

Usage: ``python tools/pip_config_to_uv.py`` with the python whose pip to ask; prints one option per line (the
Makefile passes them on). Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import ast
import subprocess
import sys

# pip's key -> (uv's option, whether the value is a list of space-separated entries)
_OPTIONS = {
    "index-url": ("--index-url", False),
    "extra-index-url": ("--extra-index-url", True),
    "find-links": ("--find-links", True),
    "constraint": ("--constraint", True),
    "trusted-host": ("--allow-insecure-host", True),
    "cert": ("--cert", False),
}
_FLAGS = {"no-index": "--no-index"}
_PRECEDENCE = {"global": 0, "user": 1, "site": 2, ":env:": 3}  # later wins, as in pip


def pip_settings(listing: str) -> dict[str, str]:
    """``pip config list`` output (lines ``variant.key='value'``) -> key -> the value pip uses."""
    chosen: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        variant, _, key = name.rpartition(".")
        if not sep or variant not in _PRECEDENCE:
            continue
        rank = _PRECEDENCE[variant]
        if key not in chosen or rank >= chosen[key][0]:
            chosen[key] = (rank, ast.literal_eval(value))
    return {key: value for key, (_, value) in chosen.items()}


def uv_options(settings: dict[str, str]) -> list[str]:
    """pip's settings -> the ``uv pip install`` options that read from the same places."""
    options = ["--index-strategy", "unsafe-best-match"]
    for key, (option, many) in _OPTIONS.items():
        if key in settings:
            for value in settings[key].split() if many else [settings[key]]:
                options += [option, value]
    for key, flag in _FLAGS.items():
        if settings.get(key, "").lower() in ("1", "true", "yes", "on"):
            options.append(flag)
    return options


def main() -> None:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True,
                             text=True).stdout
    print("\n".join(uv_options(pip_settings(listing))))


if __name__ == "__main__":
    main()
