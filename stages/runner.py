"""The one runner that makes every stage resumable (DESIGN.md "One runner for every stage"): :func:`run_stage`.

1. fingerprint = stage name + version + the config section the stage reads + the input fingerprints (+ carried
   state such as a KL controller);
2. an output folder whose manifest has that fingerprint is skipped (unless ``force``);
3. otherwise the stage's Ray Data pipeline writes into a temporary sibling folder, the output schema and
   invariants are validated, the manifest is written last, and the folder is renamed into place;
4. on any failure the temporary folder is removed and a previous output is untouched.

Steps 2-4 are :func:`stages.commit.commit_folder` (the commit protocols, local and object store, live in
``stages/commit.py``); our errors raised inside Ray come out as themselves through ``stages/ray_errors.py``. What a
stage declares and gets is the contract in ``stages/stage.py``; its rows are written as Parquet part files by
``stages/parquet_parts.py``, and its batches' partials go through ``stages/partials.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import pyarrow as pa
from pydantic import BaseModel

from schemas.errors import SchemaError
from stages.commit import commit_folder
from stages.parquet_parts import ordered_parquet_sink, rename_parts
from stages.partials import SIDE_DIR
from stages.ray_errors import surface_user_errors
from stages.stage import Stage, StageContext, StageResult
from stages.storage import Location, folder_fingerprint, read_table_schema

log = logging.getLogger("rollflow.runner")


def stage_fingerprint(stage: Stage, section: BaseModel, inputs: dict[str, Location], state_in: dict) -> str:
    payload = {
        "stage": stage.name,
        "version": stage.version,
        "section": section.model_dump(mode="json"),
        "inputs": {k: folder_fingerprint(v) for k, v in sorted(inputs.items())},
        "state_in": state_in,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _input_schemas(stage: Stage, section: BaseModel, inputs: dict[str, Location]) -> dict[str, pa.Schema]:
    """The schema of each input ``stage`` declares, checked against its spec and the columns ``section`` needs."""
    schemas = {}
    needs = stage.required_columns(section)
    specs = stage.inputs_for(section)
    unread = sorted(set(inputs) - set(specs))
    if unread:  # an input the stage does not read would still change its fingerprint
        raise SchemaError(f"stage {stage.name}: input(s) {unread} are not read under this config section (it reads "
                          f"{sorted(specs)}); leave them out")
    for name, spec in specs.items():
        if name not in inputs:
            raise SchemaError(f"stage {stage.name}: input '{name}' was not given")
        schema = read_table_schema(inputs[name], spec.name)
        spec.check_schema(schema, inputs[name].path, needs.get(name, ()))
        schemas[name] = schema
    return schemas


def _write_output(stage: Stage, ctx: StageContext, out: Location, start: float,
                  context: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``stage``'s pipeline into ``ctx.output`` (the temporary folder of ``out``), validate what it wrote and
    return the manifest (all but the fingerprint; ``context``, when given, is recorded as it is)."""
    surface_user_errors()
    tmp = ctx.output
    stage.build(ctx).write_datasink(ordered_parquet_sink(tmp))
    files = rename_parts(tmp)
    schema = read_table_schema(tmp, stage.output_spec.name) if files else stage.output_spec.arrow_schema()
    stage.output_spec.check_schema(schema, f"{out.path} (output of {stage.name})")
    stage.check_output(ctx, tmp)
    metrics, state = stage.finalize(ctx, tmp)
    tmp.child(SIDE_DIR).rmtree()
    manifest = {
        "stage": stage.name,
        "version": stage.version,
        "table": stage.output_spec.name,
        "section": ctx.section.model_dump(mode="json"),
        "inputs": {k: {"path": v.uri(), "fingerprint": folder_fingerprint(v)} for k, v in ctx.inputs.items()},
        "state_in": ctx.state_in,
        "rows": sum(f["rows"] for f in files),
        "files": files,
        "schema": [f"{f.name}: {f.type}" for f in schema],
        "metrics": metrics,
        "state": state,
        "created_unix": time.time(),
        "seconds": round(time.time() - start, 3),
    }
    if context is not None:
        manifest["context"] = context
    return manifest


def run_stage(stage: Stage, section: BaseModel, inputs: dict[str, str], output: str, *, force: bool = False,
              state_in: dict | None = None, batch_rows: int = 1024,
              context: dict[str, Any] | None = None, resources: dict[str, float] | None = None) -> StageResult:
    """Run ``stage`` on ``inputs`` (name → folder) into the folder ``output``; skip if already done.

    ``context``: what ran the stage beyond what its output depends on, recorded in the manifest and not in the
    fingerprint (a rollout turn's checkpoint folder and engine settings, so ``rollflow stage`` can replay it).
    ``resources``: the custom Ray resources its map tasks ask for (``runtime.resources_for(stage.name)``; where the
    stage runs is not part of its fingerprint)."""
    start = time.time()
    out = Location.of(output)
    in_locs = {k: Location.of(v) for k, v in inputs.items()}
    state_in = state_in or {}
    schemas = _input_schemas(stage, section, in_locs)
    fp = stage_fingerprint(stage, section, in_locs, state_in)
    manifest, skipped = commit_folder(
        out, fp, lambda tmp: _write_output(stage, StageContext(section, in_locs, schemas, state_in, tmp, batch_rows,
                                                               dict(resources or {})),
                                           out, start, context),
        who=f"stage {stage.name}", other="output of stage {stage} with another config or input", force=force)
    if not skipped:
        log.info("stage %s: wrote %d rows to %s in %.1fs", stage.name, manifest["rows"], out.path,
                 time.time() - start)
    return StageResult(out.uri(), fp, skipped, manifest["rows"], time.time() - start, manifest.get("metrics", {}),
                       manifest.get("state", {}))
