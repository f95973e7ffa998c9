"""The stage contract (DESIGN.md "One runner for every stage"): what a stage declares and builds (:class:`Stage`),
what its ``build`` gets (:class:`StageContext`: its config section, input folders and schemas, the temporary output
folder) and what a run of it returns (:class:`StageResult`); with the helpers a stage builds its Ray Data pipeline
with (:func:`slices`). ``stages.runner.run_stage`` runs a stage; Ray is imported only when a pipeline is built."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import pyarrow as pa
from pydantic import BaseModel

from schemas.tables import TableSpec
from stages.storage import Location


class Stage(ABC):
    """A stage: named inputs of known table specs → one output table. Subclasses declare their contract and build a
    Ray Data pipeline; the runner does everything else."""

    name: ClassVar[str]
    version: ClassVar[str]
    output_spec: ClassVar[TableSpec]
    section_model: ClassVar[type[BaseModel]]
    input_specs: ClassVar[dict[str, TableSpec]]

    def required_columns(self, section: BaseModel) -> dict[str, tuple[str, ...]]:
        """Optional columns each input must have under this section (e.g. ``values`` for GAE)."""
        return {}

    def inputs_for(self, section: BaseModel) -> dict[str, TableSpec]:
        """The inputs the stage reads under this section (all of ``input_specs`` unless a section selects fewer,
        e.g. the scores table only for RLVR rewards). Only these enter the fingerprint."""
        return self.input_specs

    @abstractmethod
    def build(self, ctx: StageContext):
        """Return the Ray Data dataset that produces the output rows."""

    def finalize(self, ctx: StageContext, written: Location) -> tuple[dict[str, float], dict[str, Any]]:
        """After writing: metrics for the manifest and state to carry to the next run (e.g. KL controller)."""
        return {}, {}

    def check_output(self, ctx: StageContext, written: Location) -> None:
        """Whole-table output invariants beyond the schema (optional)."""

    def preflight(self, section: BaseModel, on_disk: dict[str, str], schemas: dict[str, pa.Schema]) -> None:
        """Checks of the section against the inputs that a command's pre-flight (stages/preflight.py) runs before
        Prefect and Ray start, beyond the input contracts (optional): ``on_disk`` maps the inputs already on disk to
        their folders, ``schemas`` every input to its (expected) schema. Raise a RollflowError naming field and fix."""

    def output_schema(self, input_schemas: dict[str, pa.Schema]) -> pa.Schema:
        """The columns the output may have on inputs of these schemas (what a pre-flight check of the next stage
        checks against): the spec's required and optional columns, unless a stage knows which it writes."""
        return self.output_spec.arrow_schema()


@dataclass
class StageContext:
    """What a stage's ``build`` gets: its config section, its input folders and their schemas."""

    section: BaseModel
    inputs: dict[str, Location]
    schemas: dict[str, pa.Schema]
    state_in: dict[str, Any]
    output: Location
    batch_rows: int = 1024
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources (runtime.stage_resources)

    def task_options(self) -> dict[str, Any]:
        """Ray options of the stage's map tasks: the custom resources the run pins the stage with, if any."""
        return {"resources": dict(self.resources)} if self.resources else {}

    def read(self, name: str, columns: list[str] | None = None):
        """A Ray Data dataset over input ``name`` (optionally only ``columns``), in file order."""
        import ray.data

        loc = self.inputs[name]
        return ray.data.read_parquet(loc.parquet_files(), columns=columns, filesystem=loc.ray_filesystem())

    def read_per_file(self, name: str, columns: list[str] | None = None, include_paths: bool = False):
        """:meth:`read` with one read task per file, whose blocks are not split further: a ``map_batches`` with
        ``batch_size=None`` after it runs in the same task on whole blocks (Ray Data fuses read, map and write), so a
        row-parallel stage runs as one task per file and slices the blocks itself (:func:`slices`). Without it
        Ray Data splits a read into at least 200 blocks (``read_op_min_num_blocks``) and bundles them again for a
        separate map task per ~1,024 rows: at 200k rows ~200 tasks a stage, and most of the stage's time was spent
        around them (BENCHMARKS.md, issue 49). ``include_paths``: each row also has its file's path (column
        ``path``)."""
        import ray.data

        loc = self.inputs[name]
        files = loc.parquet_files()
        return ray.data.read_parquet(files, columns=columns, filesystem=loc.ray_filesystem(),
                                     override_num_blocks=max(1, len(files)), include_paths=include_paths)

    def one_task(self, produce: Callable[[], pa.Table | Iterator[pa.Table]]):
        """A Ray Data dataset whose only task (with the stage's task options) returns ``produce()``: for a
        whole-table step that reads its inputs itself. ``produce`` may yield its rows as several tables, in order (a
        step that streams its output). The task is named after ``produce``."""
        import ray.data

        def task(_: pa.Table) -> Iterator[pa.Table]:
            out = produce()
            if isinstance(out, pa.Table):
                yield out
            else:
                yield from out

        task.__name__ = task.__qualname__ = produce.__name__
        return ray.data.from_items([{"task": 0}]).map_batches(task, batch_size=None, batch_format="pyarrow",
                                                             **self.task_options())


@dataclass
class StageResult:
    output: str
    fingerprint: str
    skipped: bool
    rows: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)


def slices(table: pa.Table, rows: int) -> list[pa.Table]:
    """``table`` cut into consecutive slices of ``rows`` rows (the last one shorter; none for an empty table)."""
    return [table.slice(lo, rows) for lo in range(0, table.num_rows, rows)]
