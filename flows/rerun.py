"""Re-running one stage of a past run with changed settings, keeping the old output (``rollflow stage``).

A stage output's manifest records its stage, section, inputs and state; a re-run applies ``--set`` overrides to the
section and runs the stage again on the same inputs into a new folder beside the old one (``<old>@<fingerprint>``).
``--downstream`` then re-runs every output in the same folder that read it (found through the manifests' inputs,
breadth first: a re-run of the log-probs re-runs the rewards and advantages that read them), each into its own
``@<fingerprint>`` folder. The originals are never touched.

Which stages can be re-run, and how, is their declaration's (``StageSpec.rerun``, schemas/stage_specs.py): a
function of flows/restage.py per kind runs the stage from its section, its inputs and the rest of its old manifest.
That includes the training step (a new checkpoint beside the old one, e.g. with another learning rate) and an
evaluation (its own manifest records the checkpoint it read), so a walk from the log-probs goes through rewards,
advantages and training to the evaluation. A rollout is replayed from one of its turns (``rollout_turn``) or from
its episodes (``rollout_reset``) by :mod:`flows.rerun_rollout` into a new rollout folder beside the old one; its
downstream walk starts at the rollout's samples, from the outputs beside the rollout folder. RLVR generation is not
re-run (the error names the command that redoes it), and a downstream walk that reaches an output it cannot re-run
reports it stale.
"""

from __future__ import annotations

from pydantic import BaseModel

from flows.restage import apply_overrides, check_record, known, rerun_downstream, rerun_of, rerun_tag, result_line
from flows.restage import downstream as downstream_of
from flows.rerun_rollout import rerun_rollout
from schemas.config import parse_overrides, validate_config
from schemas.errors import RollflowError
from schemas.stage_specs import is_declared, stage_spec, stage_specs
from stages import cluster
from stages.outputs import check_output, stage_writes
from stages.storage import Location, is_uri, manifest_field, read_manifest
from stages.train.checkpoint import read_checkpoint


def _redo() -> str:
    """How to make the outputs of the declared stages rollflow stage does not re-run, grouped by the advice."""
    advice: dict[str, list[str]] = {}
    for spec in stage_specs():
        if spec.rerun is None:
            advice.setdefault(spec.redo, []).append(spec.name)
    return "; ".join(f"{', '.join(names)}: {redo}" for redo, names in advice.items())


def _rollout_stages() -> str:
    return ", ".join(s.name for s in stage_specs() if s.rerun == "rollout")


def rerun_stage(name: str, old_output: str, overrides: list[str], output: str | None, downstream: bool,
                force: bool, checkpoint: str | None = None) -> list[str]:
    """Re-run stage ``name`` on the inputs recorded in ``old_output``'s manifest with ``overrides`` applied to its
    config section; write to ``output`` (default ``<old>@<fingerprint>``). Returns lines to print. A rollout
    (``rollout_turn``, ``rollout_reset``) is replayed by :func:`flows.rerun_rollout.rerun_rollout`; ``checkpoint``
    (a copy of the checkpoint it was played with) is for it alone."""
    spec = stage_spec(name) if is_declared(name) else None
    if spec is not None and spec.rerun == "rollout":
        return rerun_rollout(name, old_output, overrides, output, downstream, force, checkpoint)
    found = rerun_of(name)
    if found is None:
        raise RollflowError(f"unknown stage '{name}'; rollflow stage re-runs {known()}. " + _redo())
    if checkpoint is not None:
        raise RollflowError(f"--checkpoint is for a rollout replay ({_rollout_stages()}); stage {name} re-runs on the "
                            "inputs its manifest records: leave --checkpoint out")
    old = Location.of(old_output)
    manifest = read_manifest(old) if old.is_dir() else None
    if manifest is None or manifest.get("stage") != name:
        holds = (f"it holds an output of stage {manifest.get('stage')}" if manifest is not None
                 else "it has no manifest.json" if old.is_dir() else "it is not a folder")
        raise RollflowError(f"{old.path} is not an output of stage {name} ({holds}); pass the folder the stage "
                            "wrote, e.g. runs/<run>/iter_0000/rewarded for response_rewards, "
                            "runs/<run>/iter_0000/checkpoint for train_step, runs/<run>/iter_0000/eval for eval")
    check_record(old, manifest)
    section_model, rerun = found
    section = validate_config(section_model, apply_overrides(manifest_field(old, manifest, "section"),
                                                             parse_overrides(overrides)),
                              f"{old.path}/manifest.json + overrides")
    inputs = {k: v["path"] for k, v in manifest_field(old, manifest, "inputs").items()}
    for key, path in inputs.items():
        if not Location.of(path).is_dir():
            raise RollflowError(f"input '{key}' of {old.path} (recorded in its manifest.json) no longer exists at "
                                f"{path}; restore it, or re-run the command that wrote it first")
    _check_models(section, inputs)
    if downstream:
        downstream_of(old)  # a damaged manifest there is refused before anything runs
    tag = rerun_tag(section, inputs)
    target = output or Location(old.fs, f"{old.path}@{tag}").uri()

    check_output(target, stage_writes(f"rollflow stage {name}", name),
                 {"--from": old.uri(), **{f"'{key}' (recorded in {old.path}/manifest.json)": path
                                          for key, path in inputs.items()}},
                 records=inputs)  # an output of this stage from other inputs is another command's, e.g. a run's

    # once the request is valid (the manifest holds no runtime settings: $RAY_ADDRESS or a local cluster)
    cluster.ensure_ray()
    result = rerun(section, inputs, target, force, manifest)
    lines = [result_line(name, result, old)]
    if downstream:
        lines += rerun_downstream(old, result.output, tag, force)
    return lines


def _check_models(section: BaseModel, inputs: dict[str, str]) -> None:
    """The model folders a re-run reads (a recorded checkpoint input: training step, evaluation; a log-prob section's
    checkpoint and reference, a values section's critic) must be whole, before Ray starts: read_checkpoint names a
    damaged file. Folders on an object store are left to their download."""
    named = [inputs.get("checkpoint"), *(getattr(section, key, None) for key in ("checkpoint", "reference", "critic"))]
    for folder in named:
        if isinstance(folder, str) and not is_uri(folder):
            read_checkpoint(folder)

