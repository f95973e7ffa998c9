"""Where a table came from, and which outputs are stale (``rollflow lineage``).

Every stage output's manifest records its inputs: their folders and the fingerprints they had when it was written
(stages/runner.py). The lineage of an output follows those records back to tables without a manifest (stored data).
An output is *stale* when one of its inputs has changed since (its fingerprint differs: the input was recomputed
with ``--force``, or rewritten) or is gone; a re-run with ``rollflow stage`` writes beside the old output, so it
makes nothing stale, while its ``--downstream`` outputs read the new one. Read-only: nothing is written.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import pyarrow.fs as pafs

from schemas.errors import RollflowError
from stages.storage import MANIFEST, Location, damaged_manifest, folder_fingerprint, read_manifest
from stages.train.checkpoint import checkpoint_fingerprint


@dataclass(frozen=True)
class Edge:
    """One recorded input of an output: its name, folder, the fingerprint recorded and the one it has now (None:
    the folder is gone)."""

    name: str
    path: str
    recorded: str
    current: str | None

    @property
    def problem(self) -> str | None:
        if self.current is None:
            return f"input '{self.name}' ({self.path}) is gone"
        if self.current != self.recorded:
            return (f"input '{self.name}' ({self.path}) changed since this output was written (recorded "
                    f"{self.recorded[:8]}, now {self.current[:8]}): recompute it, e.g. rollflow stage ... --downstream")
        return None


def _fingerprint_now(source: Location) -> str:
    """The fingerprint ``source`` has now, computed as its readers record it: a stage output's manifest fingerprint;
    a model folder without one (the base model a training step or an evaluation read) by its files
    (stages.train.checkpoint.checkpoint_fingerprint); a folder of Parquet files by theirs."""
    if read_manifest(source) is None and source.child("config.json").exists():
        return checkpoint_fingerprint(source.path)
    return folder_fingerprint(source)


def _edges(loc: Location, manifest: dict) -> list[Edge]:
    edges = []
    for name, info in sorted(manifest.get("inputs", {}).items()):
        if "fingerprint" not in info:
            raise damaged_manifest(loc, f"input '{name}' records no fingerprint")
        source = loc.recorded(info["path"])
        current = _fingerprint_now(source) if source.exists() else None
        edges.append(Edge(name, info["path"], info["fingerprint"], current))
    return edges


def _describe(manifest: dict | None) -> str:
    if manifest is None:
        return "stored table (no manifest)"
    text = f"stage {manifest.get('stage')} v{manifest.get('version')}, {manifest.get('rows', 0):,} rows"
    played = (manifest.get("state_in") or {}).get("checkpoint")
    if isinstance(played, dict) and "path" in played:  # a rollout's turns, RLVR's responses: the policy generating
        text += f", played with {played['path']}"
    if "created_unix" in manifest:
        text += dt.datetime.fromtimestamp(manifest["created_unix"], dt.timezone.utc).strftime(", %Y-%m-%d %H:%M UTC")
    return text


def trace(path: str) -> list[str]:
    """Lines showing the output at ``path`` and, indented below it, each recorded input and its own inputs in turn;
    an input that changed since (or is gone) is marked STALE with the reason."""
    loc = Location.of(path)
    if not loc.is_dir():
        raise RollflowError(f"{path} is not a folder; pass a stage output (a folder with {MANIFEST}) or a run folder")
    lines = [f"{loc.uri()}  {_describe(read_manifest(loc))}"]
    seen: set[str] = set()

    def walk(out: Location, depth: int) -> None:
        manifest = read_manifest(out)
        if manifest is None or out.path in seen:
            return
        seen.add(out.path)
        for edge in _edges(out, manifest):
            source = out.recorded(edge.path)
            mark = f"  STALE: {edge.problem}" if edge.problem else ""
            shown = _describe(read_manifest(source)) if edge.current is not None else "missing"
            lines.append(f"{'  ' * depth}<- {edge.name}: {edge.path}  {shown}{mark}")
            if edge.current is not None:
                walk(source, depth + 1)

    walk(loc, 1)
    return lines


def stale_outputs(root: str) -> tuple[int, list[str]]:
    """Every stage output under the folder ``root`` (a run folder, say): how many there are, and a line for each
    whose inputs changed since it was written or are gone."""
    loc = Location.of(root)
    if not loc.is_dir():
        raise RollflowError(f"{root} is not a folder; pass a run folder or a stage output")
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True))
    outputs = sorted(i.path.rsplit("/", 1)[0] for i in infos
                     if i.type == pafs.FileType.File and i.base_name == MANIFEST and "/." not in i.path)
    lines = []
    for folder in outputs:
        out = Location(loc.fs, folder)
        for edge in _edges(out, read_manifest(out) or {}):
            if edge.problem:
                lines.append(f"{folder}: {edge.problem}")
    return len(outputs), lines


def lineage_lines(path: str) -> list[str]:
    """``rollflow lineage PATH``: the lineage of PATH when it is a stage output, then the stale outputs under it."""
    loc = Location.of(path)
    own = read_manifest(loc) is not None
    lines = trace(path) if own else [f"{loc.uri()}  (no manifest: a folder of outputs)"]
    count, stale = stale_outputs(path)
    if not own and count == 0:
        raise RollflowError(f"{loc.uri()} holds no stage output (no manifest.json in it or below); pass a run folder "
                            "(runs/<run>) or a folder a stage wrote")
    lines.append("")
    if stale:
        lines.append(f"{len(stale)} stale of {count} stage outputs under {loc.uri()}:")
        lines.extend(f"  {line}" for line in stale)
    else:
        lines.append(f"{count} stage outputs under {loc.uri()}; none is stale")
    return lines
