"""Checks a command runs on its inputs before its first stage, so that bad input commits nothing.

The runner checks each stage's inputs when that stage starts; in a command of several stages the first stage is
then already committed when the second one finds a problem that was knowable from the start. :func:`check_steps`
runs every check the stages of a command would run on their on-disk inputs, in the driver, before Prefect and Ray
start: the schema and the columns each section needs, every row's invariants (aligned list lengths, finite numbers,
identity columns set), a non-empty table, and the whole-table structure (unique row ids, contiguous turns, complete
groups of the section's ``group_size``). An input that an earlier step of the same command writes is checked
against that step's output contract instead. Pure pyarrow: no Ray, no Prefect.

What cannot be known up front (a stage's own computation failing) still fails only that stage; its output is not
committed, the outputs of earlier stages are (they are valid tables) and a re-run resumes after them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel

from schemas.errors import InvariantError, SchemaError
from schemas.tables import TableSpec, check_row_invariants, check_structure
from stages.outputs import check_output, container_writes, stage_writes
from stages.stage import Stage
from stages.storage import Location, read_table_schema

IDENTITY = ("row_id", "group_id", "traj_id", "turn_idx")
BATCH_ROWS = 4096


@dataclass(frozen=True)
class Step:
    """One stage of a command: its section, its inputs (input name -> folder) and its output folder."""

    stage: Stage
    section: BaseModel
    inputs: dict[str, str]
    output: str


def _key(path: str) -> str:
    return Location.of(path).path.rstrip("/")


def check_steps(steps: Sequence[Step]) -> dict[str, int]:
    """Check the inputs of ``steps`` (in run order) as the stages would; raise the first problem as a
    SchemaError/InvariantError naming the file, column, row and fix. Returns the rows of each on-disk input."""
    written: dict[str, tuple[pa.Schema, str]] = {}  # output folder -> (the schema its stage will write, stage name)
    rows: dict[str, int] = {}
    for step in steps:
        needs = step.stage.required_columns(step.section)
        schemas: dict[str, pa.Schema] = {}
        for name, spec in step.stage.inputs_for(step.section).items():
            if name not in step.inputs:
                raise SchemaError(f"stage {step.stage.name}: input '{name}' was not given")
            path = _key(step.inputs[name])
            if path in written:  # written by an earlier step of this command: its contract is what arrives here
                schema, maker = written[path]
                spec.check_schema(schema, f"{path} (written by stage {maker} before {step.stage.name})",
                                  needs.get(name, ()))
                schemas[name] = schema
                continue
            loc = Location.of(step.inputs[name])
            schemas[name] = read_table_schema(loc, spec.name)
            if path in rows:  # read by an earlier step: its rows are checked, the columns this step needs not yet
                spec.check_schema(schemas[name], loc.path, needs.get(name, ()))
            else:
                rows[path] = check_input(spec, step.inputs[name], needs.get(name, ()),
                                         getattr(step.section, "group_size", None))
        step.stage.preflight(step.section, {n: p for n, p in step.inputs.items() if _key(p) not in written}, schemas)
        on_disk = {f"{step.stage.name} input '{n}'": p for n, p in step.inputs.items() if _key(p) not in written}
        check_output(step.output, stage_writes(f"stage {step.stage.name}", step.stage.name), on_disk,
                     records=step.inputs)
        written[_key(step.output)] = (step.stage.output_schema(schemas), step.stage.name)
    return rows


def check_command_output(who: str, output: str, steps: Sequence[Step], inputs: dict[str, str]) -> None:
    """The top output folder of a command of several ``steps`` (recompute's, score's): none of its ``inputs``, not
    inside a committed table, holding only the folders its steps write (:func:`stages.outputs.check_output`)."""
    check_output(output, container_writes(who, {_key(s.output): s.stage.name for s in steps}, _key(output)), inputs)


def check_input(spec: TableSpec, path: str, needs: Sequence[str] = (), group_size: int | None = None) -> int:
    """The on-disk table at ``path`` as a command's input of contract ``spec``: its schema (with the columns in
    ``needs``), every row's invariants and the whole-table structure (:func:`check_table_data`). Returns its rows;
    raises the first problem naming the file, column, row and fix. Pure pyarrow, before Prefect and Ray start."""
    loc = Location.of(path)
    spec.check_schema(read_table_schema(loc, spec.name), loc.path, tuple(needs))
    return check_table_data(spec, loc, group_size)


def _columns_to_check(spec: TableSpec, names: list[str]) -> list[str]:
    wanted = {*spec.required, *spec.token_aligned, *spec.next_token_aligned, *spec.finite, *IDENTITY, "num_turns"}
    return [c for c in names if c in wanted]


def _check_identity_set(batch: pa.Table, where: str) -> None:
    for col in IDENTITY:
        if col in batch.column_names and batch.column(col).null_count:
            i = int(pc.index(batch.column(col).is_null(), True).as_py())
            raise InvariantError(f"table at {where}: identity column '{col}' is null in row {i}; row_id, group_id, "
                                 "traj_id and turn_idx must be set on every row. Fix the producer of the data or drop "
                                 "the row.")


def check_table_data(spec: TableSpec, loc: Location, group_size: int | None = None, *,
                     allow_empty: bool = False) -> int:
    """Read every file of the table at ``loc`` (only the columns the checks use) and check its rows; then the
    whole-table structure when the identity columns are there. Returns the number of rows; a 0-row table is an
    error unless ``allow_empty``. A file that fails to decode is named."""
    total = 0
    identity: list[pa.Table] = []
    for path in loc.parquet_files():
        where = f"{path}"
        try:
            with loc.fs.open_input_file(path) as f:
                reader = pq.ParquetFile(f)
                columns = _columns_to_check(spec, reader.schema_arrow.names)
                start = 0
                for batch in reader.iter_batches(batch_size=BATCH_ROWS, columns=columns):
                    table = pa.Table.from_batches([batch])
                    _check_identity_set(table, f"{where} (rows from {start})")
                    check_row_invariants(spec, table, f"{where} (rows from {start})")
                    present = [c for c in IDENTITY + ("num_turns",) if c in table.column_names]
                    identity.append(table.select(present))
                    start += table.num_rows
        except (InvariantError, SchemaError):
            raise
        except (OSError, pa.ArrowException) as err:
            raise SchemaError(f"{spec.name} input file {path} cannot be decoded ({err}); the file is corrupt: restore "
                              "it from the stage that wrote it or re-run that stage") from None
        total += start
    if total == 0 and not allow_empty:
        raise InvariantError(f"{spec.name} input {loc.path} has no rows; pass a table with at least one row (an empty "
                             "selection upstream?)")
    if total == 0:
        return 0
    whole = pa.concat_tables(identity)
    if all(c in whole.column_names for c in IDENTITY):
        check_structure(whole, loc.path, group_size)
    return total
