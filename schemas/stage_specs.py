"""Every stage of rollflow, declared once: what the rest of the system needs to know about it.

A :class:`StageSpec` names a stage (the name its manifests record), the config section it reads, the tables it reads
(the input names its manifest records) and the folder it writes in an iteration, the resource-plan phase it runs in,
whether runtime.stage_resources may pin it to nodes, how ``rollflow stage`` re-runs it (or how to redo its output
when it cannot), and the manifest state it carries to the next iteration. The readers look a stage up here and keep
no list of their own: node pinning (``RuntimeConfig.stage_resources``), re-run and ``--downstream``
(flows/restage.py, flows/rerun.py, flows/rerun_rollout.py), the one iteration loop's carried state
(flows/loop.py ``Run.carried``, ``first_state``), the resource plan (stages/plan.py) and the docs' table.

Plain data (no Ray, Prefect or ``stages/`` import), so ``schemas/`` may read it too. The stage's code names its
class as ``"module:Class"`` (``runner_class``), imported by the re-run when it is needed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

# the phases of an iteration a stage's reservations are held in (stages/plan.py checks each beside the resident ones)
PHASES = ("generation", "log-probs / values", "rewards / advantages", "training step")
# how `rollflow stage` re-runs a stage (flows/restage.py RERUN_KINDS holds one function per kind)
RERUN_KINDS = ("runner", "logprobs", "values", "train_step", "eval", "rollout")


@dataclass(frozen=True)
class StageSpec:
    """One stage, declared once."""

    name: str  # the stage name its manifests record (``manifest.json: stage``)
    section: str  # the config section model it reads (its manifest records the section; rollflow stage --set edits it)
    reads: tuple[str, ...]  # the inputs its manifest records, by name (what --downstream follows)
    writes: str  # the folder it writes in an iteration folder (iter_<k>/<writes>, step_<k>/<writes>)
    phase: str | None = None  # the resource-plan phase it runs in (PHASES); None: outside the iteration's phases
    pinnable: bool = False  # runtime.stage_resources may pin its tasks or actors to nodes with custom resources
    rerun: str | None = None  # how `rollflow stage` re-runs it (RERUN_KINDS); None: it is not re-run
    runner_class: str = ""  # "module:Class" of the Stage the runner runs from its section alone (rerun: runner)
    carries: tuple[str, Any] | None = None  # (state key, its value at the first iteration; None: absent until set)
    redo: str = ""  # for a stage that is not re-run: how to make its output again
    validates: bool = False  # an RLVR validation (rollflow eval) writes its output too, as <output>/<writes>

    def __post_init__(self) -> None:
        if self.phase is not None and self.phase not in PHASES:
            raise ValueError(f"stage {self.name}: phase {self.phase!r} is not one of {PHASES}")
        if self.rerun is not None and self.rerun not in RERUN_KINDS:
            raise ValueError(f"stage {self.name}: rerun {self.rerun!r} is not one of {RERUN_KINDS}")
        if (self.rerun == "runner") != bool(self.runner_class):
            raise ValueError(f"stage {self.name}: a stage re-run by the runner (rerun='runner') names its class "
                             "(runner_class='module:Class'), and only such a stage does")
        if self.rerun is None and not self.redo:
            raise ValueError(f"stage {self.name}: a stage rollflow stage cannot re-run says how to redo its output "
                             "(redo='...')")

    def first_carried(self) -> Any:
        """The value of the carried state at the first iteration (a fresh copy), None when nothing is carried."""
        return None if self.carries is None else copy.deepcopy(self.carries[1])


_SPECS: dict[str, StageSpec] = {}


def declare_stage(spec: StageSpec) -> StageSpec:
    """Add ``spec`` to the stages; a second declaration of the same name is refused."""
    if spec.name in _SPECS:
        raise ValueError(f"stage '{spec.name}' is declared twice; pick another name")
    _SPECS[spec.name] = spec
    return spec


def withdraw_stage(name: str) -> None:
    """Remove a declared stage (a test that declared one of its own)."""
    _SPECS.pop(name, None)


def stage_spec(name: str) -> StageSpec:
    """The one lookup: the declaration of stage ``name``; a KeyError naming the declared stages otherwise."""
    try:
        return _SPECS[name]
    except KeyError:
        raise KeyError(f"unknown stage '{name}'; declared: {', '.join(_SPECS)}") from None


def is_declared(name: str) -> bool:
    return name in _SPECS


def stage_specs() -> list[StageSpec]:
    """Every declared stage, in declaration order (an iteration's order)."""
    return list(_SPECS.values())


def pinnable_stages() -> tuple[str, ...]:
    """The stages whose tasks and actors runtime.stage_resources may pin to nodes."""
    return tuple(s.name for s in _SPECS.values() if s.pinnable)


def rollout_children() -> dict[str, tuple[str, ...]]:
    """The folders a rollout writes inside its output folder (``rollout/<child>``), each with the stages whose
    manifests it holds; a folder of outputs (``turns/turn_<t>``) with none: {"episodes": ("rollout_reset",), ...}."""
    children: dict[str, tuple[str, ...]] = {}
    for s in _SPECS.values():
        parts = s.writes.split("/")
        if parts[0] == "rollout":
            children[parts[1]] = (s.name,) if len(parts) == 2 else ()
    return children


def validation_children() -> dict[str, tuple[str, ...]]:
    """The folders an RLVR validation (rollflow eval) writes inside its output folder, each with its stage."""
    return {s.writes: (s.name,) for s in _SPECS.values() if s.validates}


def rerunnable_stages() -> tuple[str, ...]:
    """The stages ``rollflow stage`` re-runs."""
    return tuple(s.name for s in _SPECS.values() if s.rerun is not None)


_ROLLOUT_REDO = ("make a rollout's samples again by replaying its last turn (rollflow stage rollout_turn --from "
                 "<rollout>/turns/turn_<last>)")
_RLVR_REDO = ("redo a run's generation with rollflow train --config FILE --set run_name=NEW, then rollflow stage NAME "
              "--from ... re-runs what reads it")

# The built-in stages, in the order rollflow stage lists them (what it re-runs first, a rollout replay last).
for _spec in (
    # scored: under RLVR's section only
    StageSpec("response_rewards", "RewardsSection", ("samples", "scored"), "rewarded", phase="rewards / advantages",
              pinnable=True, rerun="runner", runner_class="stages.response_rewards:ResponseRewardsStage",
              carries=("running_moments", {})),
    StageSpec("advantages", "AdvantageSection", ("samples", "rewarded"), "advantaged", phase="rewards / advantages",
              pinnable=True, rerun="runner", runner_class="stages.advantages:AdvantagesStage",
              carries=("kl_ctrl", None)),
    # rule workers; an LLM judge's scores need rollflow score
    StageSpec("rewards", "RewardsConfig", ("responses",), "scored", phase="rewards / advantages", rerun="runner",
              runner_class="stages.rlvr.stages:RewardStage", validates=True),
    StageSpec("rlvr_samples", "rlvr SamplesSection", ("responses", "scored"), "samples",
              phase="rewards / advantages", rerun="runner", runner_class="stages.rlvr.stages:RLVRSamplesStage"),
    StageSpec("logprobs", "LogProbSection", ("samples",), "logprobs", phase="log-probs / values", pinnable=True,
              rerun="logprobs"),
    StageSpec("values", "ValuesSection", ("samples",), "values", phase="log-probs / values", rerun="values"),
    StageSpec("train_step", "TrainSection", ("samples", "checkpoint"), "checkpoint", phase="training step",
              pinnable=True, rerun="train_step"),
    StageSpec("eval", "RolloutConfig", ("checkpoint",), "eval", phase="generation", rerun="eval"),
    StageSpec("rollout_turn", "TurnSection", ("previous",), "rollout/turns/turn_<t>", phase="generation",
              rerun="rollout"),
    StageSpec("rollout_reset", "TurnSection", (), "rollout/episodes", phase="generation", rerun="rollout"),
    StageSpec("rollout_samples", "rollout SamplesSection", ("turn_<t>",), "rollout/samples", phase="generation",
              redo=_ROLLOUT_REDO),
    StageSpec("rlvr_prompts", "PromptsSection", (), "prompts", redo=_RLVR_REDO, validates=True),
    StageSpec("rlvr_generate", "GenerateSection", ("prompts",), "responses", phase="generation", redo=_RLVR_REDO,
              validates=True),
):
    declare_stage(_spec)
