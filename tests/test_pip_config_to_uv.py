"""tools/pip_config_to_uv.py: uv gets the package sources pip is configured with, with pip's precedence."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "pip_config_to_uv.py"
_spec = importlib.util.spec_from_file_location("pip_config_to_uv", TOOL)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

# what `pip config list` printed on this project's machines (a variable, the global file, /etc/xdg's file)
LISTING = """:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
"""


def _pairs(options: list[str]) -> list[tuple[str, str]]:
    return list(zip(options[::2], options[1::2]))


def test_the_machines_pip_configuration_becomes_uv_options():
    options = tool.uv_options(tool.pip_settings(LISTING))
    assert _pairs(options) == [("--index-strategy", "unsafe-best-match"),
                               ("--extra-index-url", "file:///opt/pypi/simple"),
                               ("--extra-index-url", "file:///opt/pypi-more/simple"),
                               ("--find-links", "/opt/wheels"),
                               ("--constraint", "/etc/xdg/pip/constraints.txt"),
                               ("--cert", "/etc/ssl/certs/ca-certificates.crt")]


def test_a_variable_beats_the_site_file_beats_the_user_file_beats_the_global_file_whatever_the_order():
    lines = [":env:.index-url='https://env/simple'", "site.index-url='https://site/simple'",
             "user.index-url='https://user/simple'", "global.index-url='https://global/simple'"]
    for order in (lines, lines[::-1]):
        assert tool.pip_settings("\n".join(order))["index-url"] == "https://env/simple"
    assert tool.pip_settings("\n".join(lines[2:]))["index-url"] == "https://user/simple"


def test_no_index_trusted_hosts_and_unrelated_settings():
    settings = tool.pip_settings("global.no-index='true'\nglobal.trusted-host='a.example b.example'\n"
                                 "global.timeout='60'\nnot a setting line\n")
    options = tool.uv_options(settings)
    assert "--no-index" in options
    assert _pairs(options[:-1])[1:] == [("--allow-insecure-host", "a.example"), ("--allow-insecure-host", "b.example")]
    assert tool.uv_options({}) == ["--index-strategy", "unsafe-best-match"]


def test_the_script_asks_the_pip_of_the_python_that_runs_it():
    out = subprocess.run([sys.executable, str(TOOL)], check=True, capture_output=True, text=True).stdout.splitlines()
    assert out[:2] == ["--index-strategy", "unsafe-best-match"]
    assert len(out) % 2 == 0  # option, value, option, value, ...
