"""A training run's folder and its frozen config, and what ``rollflow train`` checks of them before anything starts:
the folder ``<runs_dir>/<run_name>`` of a config, the config.json the run was started with (what ``--resume`` reads),
a config against the one frozen in its folder, and :func:`check_run`. ``config`` in these functions is a validated
training config of either pipeline (``TrainFlowConfig`` or ``RLVRTrainConfig``).

No Prefect, Ray or torch: a config error found here (a run folder of another config, a frozen config that is not a
mapping) is reported before the run kit (flows/runkit.py, which loads Prefect) is imported
(tests/spine/test_config_error_imports.py)."""

from __future__ import annotations

import json
import logging
import os
from typing import Protocol

from pyarrow.fs import FileType

from schemas.config import validate_config
from schemas.errors import ConfigError, RollflowError
from schemas.names import folder_name, name_max
from stages.generation.engines import preflight_model_dir
from stages.outputs import check_output
from stages.storage import Location
from stages.trackers import check_trackers
from stages.train.checkpoint import read_checkpoint

log = logging.getLogger("rollflow.train")
CONFIG_FILE = "config.json"


class RunPipeline(Protocol):
    """What :func:`check_run` needs of a pipeline (flows/pipeline_specs.py ``PipelineSpec``): its iteration folders,
    and its refusal of options no command would read."""

    def step_dir(self, run: str, step: int) -> str: ...

    def committed_steps(self, run: str) -> int: ...

    def refuse_unread(self, config) -> None: ...


def run_folder(config) -> Location:
    """The run folder ``<runs_dir>/<run_name>`` of a training config (either pipeline). ``run_name`` becomes its name
    through :func:`schemas.names.folder_name`, against the longest name the filesystem of ``runs_dir`` allows: a
    ConfigError naming the rule and the fix, before anything is created."""
    try:
        name = folder_name(config.run_name, "run_name", name_max(config.runs_dir))
    except ValueError as err:
        raise ConfigError(f"{err} (runs_dir {config.runs_dir})") from None
    return Location.of(f"{config.runs_dir}/{name}")


def check_resumed_folder(folder: Location, config) -> None:
    """``rollflow train --resume FOLDER``: the run folder the frozen ``config`` names (runs_dir/run_name) must be
    FOLDER itself, or the resume would write into (or start anew) another folder."""
    run = run_folder(config)
    local = run.atomic_rename and folder.atomic_rename
    same = os.path.realpath(run.path) == os.path.realpath(folder.path) if local else run.uri() == folder.uri()
    if not same:
        raise ConfigError(f"{folder.uri()}/{CONFIG_FILE} names the run folder {run.uri()} (runs_dir/run_name), not "
                          f"{folder.uri()}: the folder was moved or copied, or runs_dir is relative to another working "
                          f"directory; resume it from the directory it was started in, or move it back to {run.uri()}")


def read_frozen_config(run: Location) -> dict | None:
    """The config the run in the folder ``run`` was frozen with (its config.json), None when it has none. Raises a
    ConfigError naming the file and the fix when it is not a file, not JSON or not a mapping of options."""
    path = run.child(CONFIG_FILE)
    kind = run.fs.get_file_info(path.path).type
    if kind == FileType.NotFound:
        return None
    fix = ("restore it from a copy, or start a new run (another run_name): it is the config the run was started "
           "with, which a resume reads")
    try:
        data = json.loads(path.read_text()) if kind == FileType.File else None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"run config {path.uri()} is not valid JSON ({err}); {fix}") from None
    if not isinstance(data, dict):
        what = "not a file" if kind != FileType.File else "not a mapping of options"
        raise ConfigError(f"run config {path.uri()} is {what}; {fix}")
    return data


def frozen_config_state(run: Location, config, cfg: dict) -> str:
    """How the run folder ``run`` stands to the config ``cfg`` (``config`` validated): ``"new"`` (no frozen config
    yet), ``"same"``, or ``"max_steps"`` (the same run lengthened or shortened). Refuses a different config with a
    RollflowError that says how to resume it or start another run; a frozen config that validates to the same one
    is the same run (an earlier version may have written it with other defaults spelled out)."""
    path = run.child(CONFIG_FILE)
    old = read_frozen_config(run)
    if old is None:
        return "new"
    if old == cfg:
        return "same"
    frozen = validate_config(type(config), old, path.path)
    if frozen.model_copy(update={"max_steps": config.max_steps}) != config:
        raise RollflowError(f"run folder {run.path} was started with another config; resume it with "
                            f"`rollflow train --resume {run.path}`, or choose a new run_name")
    return "same" if frozen.max_steps == config.max_steps else "max_steps"


def save_run_config(run: Location, config, cfg: dict) -> None:
    """Freeze the run's config ``cfg`` (``config`` validated) next to its outputs (what ``--resume`` reads). Refuses
    a different config (:func:`frozen_config_state`). A run may be lengthened or shortened: a config that differs in
    ``max_steps`` alone continues the same run (its committed iterations are skipped) and is frozen anew."""
    state = frozen_config_state(run, config, cfg)
    if state == "same":
        return
    if state == "max_steps":
        log.info("run %s: max_steps -> %d", run.path, config.max_steps)
    path = run.child(CONFIG_FILE)
    run.fs.create_dir(run.path, recursive=True)
    tmp = run.child(f".{CONFIG_FILE}.tmp")
    tmp.write_text(json.dumps(cfg, indent=1, sort_keys=True))
    run.fs.move(tmp.path, path.path)  # a reader sees the old file or the new one, never half of it


def check_run(config, cfg: dict, pipeline: RunPipeline) -> None:
    """What ``rollflow train`` checks of the run itself before Prefect and Ray start and before anything is written
    into the run folder (its log included): the folder can be written, a folder started with another config is
    refused, a new run's config sets no option that nothing reads (``pipeline.refuse_unread``; a run folder frozen
    with the config resumes as it was started, also where a later version refuses one of its options), ``pretrain``
    (when set) is an HF model folder, the run's newest checkpoint is whole (the pipeline's iteration folders), and
    every tracker of ``track_with`` is installed and reachable (stages/trackers.py)."""
    run = run_folder(config)
    check_output(run.uri(), None, {"pretrain": config.pretrain}, flag="run folder (runs_dir/run_name)")
    if frozen_config_state(run, config, cfg) == "new":
        pipeline.refuse_unread(config)
    if config.pretrain:
        preflight_model_dir(config.pretrain)
    check_last_checkpoint(run, pipeline)
    check_trackers(config, run)


def check_last_checkpoint(run: Location, steps: RunPipeline) -> None:
    """The newest committed checkpoint of the run folder ``run`` (what a resumed run continues from) and, when it
    holds weights only, the checkpoint its training replays from must be model folders whose files are whole
    (stages/train/checkpoint.py ``read_checkpoint``); a SchemaError naming the damaged file otherwise. A run folder
    on an object store is left to the download of its checkpoint."""
    done = steps.committed_steps(run.uri()) if run.atomic_rename else 0
    if done:
        info = read_checkpoint(f"{steps.step_dir(run.uri(), done - 1)}/checkpoint")
        if info.replay is not None:
            read_checkpoint(info.replay["from"])
