"""The additive partials of a stage's batches (metrics sums, counts): each Ray task writes its batch's into a side
folder of the stage's temporary output (:func:`write_partials`), the stage's ``finalize`` reads and sums them
(:func:`read_partials`, :func:`sum_partials`), and the runner removes the folder before the output is committed."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from stages.storage import Location

SIDE_DIR = "_partials"


def write_partials(output: Location, key: str, partials: dict[str, Any]) -> None:
    """From inside a Ray task: record a batch's additive partials (metrics sums, counts) next to the output.

    ``key`` must identify the batch deterministically (e.g. its first row id), so a retried task overwrites its
    own file instead of counting twice."""
    side = output.child(SIDE_DIR)
    side.fs.create_dir(side.path, recursive=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    side.child(f"{name}.json").write_text(json.dumps(partials))


def read_partials(output: Location) -> list[dict[str, Any]]:
    """All partials written by :func:`write_partials` for this output (the folder is removed by the runner)."""
    side = output.child(SIDE_DIR)
    return [json.loads(Location(side.fs, i.path).read_text()) for i in side.list(missing_ok=True)
            if i.path.endswith(".json")]


def sum_partials(parts: list[dict[str, Any]]) -> dict[str, float]:
    """Key-wise sum of numeric partials."""
    total: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            total[k] = total.get(k, 0.0) + float(v)
    return total
