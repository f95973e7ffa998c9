"""Turn pip's choice of files into what ``uv pip install`` installs, so that uv installs exactly what pip would.

``make setup`` (tools/setup_venv.sh) lets pip resolve the lock (``pip install --dry-run --report``: pip reads every
index and find-links folder it is configured with and picks, for each pinned version, the file it would install)
and uv download and install those files in parallel. uv resolving on its own is not the same: it takes a version's
files from the first index that has the version, where pip takes the best file over all of them (on these machines
a local index holds multiprocess's Python 3.10 wheel, another its 3.11 one; uv installed the 3.10 one).

    python tools/pip_report_to_uv.py pins REPORT [--leave NAME,...]   # 'name @ url --hash=sha256:...' lines
    python tools/pip_report_to_uv.py options                          # uv options: pip's certificate, trusted hosts

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys


def pins(report: dict, leave: frozenset[str] = frozenset()) -> list[str]:
    """pip's installation report -> one requirement per file, ``name @ url --hash=sha256:...`` (in the report's
    order), leaving out the names in ``leave`` (lower case)."""
    lines = []
    for item in report["install"]:
        name = item["metadata"]["name"]
        if name.lower() in leave:
            continue
        info = item["download_info"]
        digest = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        lines.append(f"{name} @ {info['url']}" + (f" --hash=sha256:{digest}" if digest else ""))
    return lines


_PRECEDENCE = {"global": 0, "user": 1, "site": 2, ":env:": 3}  # later wins, as in pip


def pip_settings(listing: str) -> dict[str, str]:
    """``pip config list`` output (lines ``variant.key='value'``) -> key -> the value pip uses (a ``PIP_*``
    variable over the site file over the user file over the global file)."""
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
    """What uv needs of pip's settings to download the files pip chose: the certificate bundle and trusted hosts."""
    options = []
    if "cert" in settings:
        options += ["--cert", settings["cert"]]
    for host in settings.get("trusted-host", "").split():
        options += ["--allow-insecure-host", host]
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    pin = sub.add_parser("pins")
    pin.add_argument("report")
    pin.add_argument("--leave", default="")
    sub.add_parser("options")
    args = parser.parse_args()
    if args.what == "pins":
        with open(args.report) as f:
            leave = frozenset(n.strip().lower() for n in args.leave.split(",") if n.strip())
            print("\n".join(pins(json.load(f), leave)))
    else:
        listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True,
                                 text=True).stdout
        print("\n".join(uv_options(pip_settings(listing))))


if __name__ == "__main__":
    main()
