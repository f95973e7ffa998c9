"""Helpers of the tests that run ``rollflow`` in child processes and kill them."""

from __future__ import annotations

import os
import time


def wait_gone(pgid: int, seconds: float) -> bool:
    """Wait until no process of group ``pgid`` is left (True), or ``seconds`` passed (False)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False
