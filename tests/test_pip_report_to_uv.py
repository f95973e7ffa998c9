"""tools/pip_report_to_uv.py: uv installs the very files pip chose, and reaches them as pip does."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "pip_report_to_uv.py"
_spec = importlib.util.spec_from_file_location("pip_report_to_uv", TOOL)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def _item(name: str, url: str, sha256: str | None = None) -> dict:
    info = {"url": url, "archive_info": {"hashes": {"sha256": sha256}} if sha256 else {}}
    return {"metadata": {"name": name, "version": "1"}, "download_info": info}


REPORT = {"version": "1", "install": [
    _item("multiprocess", "file:///opt/pypi-more/files/multiprocess-0.70.19-py311-none-any.whl", "ab" * 32),
    _item("torchvision", "https://files.example/torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl", "cd" * 32),
    _item("Flask", "https://files.example/flask-3.1.3-py3-none-any.whl"),
]}


def test_each_file_pip_chose_is_pinned_by_url_and_hash_in_order():
    assert tool.pins(REPORT) == [
        f"multiprocess @ file:///opt/pypi-more/files/multiprocess-0.70.19-py311-none-any.whl --hash=sha256:{'ab' * 32}",
        f"torchvision @ https://files.example/torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl "
        f"--hash=sha256:{'cd' * 32}",
        "Flask @ https://files.example/flask-3.1.3-py3-none-any.whl"]  # a file without a recorded hash


def test_left_out_names_are_not_installed():
    assert [line.split(" @ ")[0] for line in tool.pins(REPORT, frozenset({"torchvision"}))] == ["multiprocess",
                                                                                                 "Flask"]


def test_the_script_reads_a_report_file(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps(REPORT))
    out = subprocess.run([sys.executable, str(TOOL), "pins", str(report), "--leave", "Torchvision, flask"],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    assert out == [tool.pins(REPORT)[0]]


def test_pips_certificate_and_trusted_hosts_with_pips_precedence():
    listing = ("global.cert='/etc/global.pem'\n:env:.cert='/etc/env.pem'\nuser.cert='/etc/user.pem'\n"
               "global.trusted-host='a.example b.example'\nglobal.extra-index-url='file:///opt/pypi/simple'\n"
               "not a setting line\n")
    assert tool.uv_options(tool.pip_settings(listing)) == ["--cert", "/etc/env.pem",
                                                           "--allow-insecure-host", "a.example",
                                                           "--allow-insecure-host", "b.example"]
    assert tool.pip_settings("site.cert='/s.pem'\nuser.cert='/u.pem'")["cert"] == "/s.pem"
    assert tool.uv_options({}) == []
