"""``run_rollout``: the episode loop as a chain of committed stages over one engine pool.

    <output>/episodes/             reset table (turn_idx -1): levels, first prompts
    <output>/turns/turn_000/ ...   one table per turn: the episodes still running at that turn
    <output>/samples/              training samples (step or trajectory level) + rollout metrics
    <output>/manifest.json         an evaluation's record (:func:`run_eval`): its config and the checkpoint it read

Every stage goes through the one runner, so re-running the same command skips committed work: a rollout killed in
turn k builds its engines once and continues at turn k. The pool is created here once per rollout (or passed in by a
training flow that reuses it across iterations with ``use_checkpoint``) and is built lazily, on the first turn that
actually runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from schemas.errors import ConfigError
from schemas.rollout_config import RolloutConfig, samples_section, turn_section
from stages import progress
from stages.cluster import require_ray
from stages.commit import commit_record
from stages.envs import ENVIRONMENTS, env_spec, make_env
from stages.generation.engines import check_engine_options, check_model_dir, preflight_model_dir
from stages.generation.model_store import default_model_dir
from stages.outputs import ROLLOUT_CHILDREN, Writes, check_output
from stages.rollout.engine_pool import EnginePool, checkpoint_fingerprint, local_model_dir
from stages.rollout.episode import env_kwargs
from stages.rollout.stages import ResetStage, SamplesStage, TurnStage
from stages.runner import run_stage, stage_fingerprint
from stages.stage import StageResult
from stages.storage import Location, damaged_manifest, is_uri, manifest_field, read_manifest
from stages.train.checkpoint import checkpoint_fingerprint as model_fingerprint

log = logging.getLogger("rollflow.rollout")

EPISODES_DIR, TURNS_DIR, SAMPLES_DIR = "episodes", "turns", "samples"


def turn_dir_name(turn: int) -> str:
    return f"turn_{turn:03d}"


@dataclass
class RolloutResult:
    """Where everything went and what it cost."""

    output: str
    model_dir: str
    episodes: StageResult
    turns: list[StageResult]
    samples: StageResult
    engine_build_seconds: float = 0.0
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    record: StageResult | None = None  # an evaluation's own manifest (run_eval): the whole folder as one output

    @property
    def metrics(self) -> dict[str, float]:
        return self.samples.metrics

    @property
    def skipped(self) -> bool:
        """Every table of it was committed earlier (a resumed run): the record of the run that played it stands."""
        return all(part.skipped for part in (self.episodes, *self.turns, self.samples, *filter(None, [self.record])))


def resolve_model_dir(checkpoint: str | None) -> str:
    """``checkpoint`` (an HF folder; a checkpoint on an object store: its local copy, downloaded once) or the
    default model, converted once."""
    return str(check_model_dir(local_model_dir(checkpoint)) if checkpoint else default_model_dir())


def pool_source(checkpoint: str | None, model_dir: str) -> str:
    """What an engine pool is given for ``checkpoint``, resolved to ``model_dir`` (:func:`resolve_model_dir`): the
    URI of a checkpoint on an object store (the pool resolves its local copy at each use, so a copy the cache
    removed meanwhile is downloaded again: stages/storage.py prune_fetched), else the local folder."""
    return str(checkpoint) if is_uri(checkpoint) else model_dir


def check_rollout(config: RolloutConfig, output: str | None = None, checkpoint: str | None = None,
                  field: str = "") -> None:
    """What a rollout of ``config`` can check before Prefect and Ray start (``rollflow rollout``; a training run and
    ``rollflow eval`` for their rollouts, ``field`` naming the config section they sit in, e.g. ``"rollout."``):
    every tag names a registered environment that builds from its env_config (map size, keyword names), the
    ``checkpoint`` is an HF model folder, the engine's options are its backend's and ``output`` can be written.
    Raises a ConfigError naming the field."""
    check_envs(config, field)
    check_engine_options(config.engine.backend, config.engine.options, f"{field}engine.options")
    if checkpoint is not None:
        preflight_model_dir(checkpoint)
    if output is not None:
        check_output(output, Writes("rollflow rollout", (), ROLLOUT_CHILDREN), {"--checkpoint": checkpoint})


def check_envs(config: RolloutConfig, field: str = "") -> None:
    """Every tag of ``config`` names a registered environment that builds from its env_config (map size, keyword
    names, data); else a ConfigError naming the field (``field``: the config section the rollout sits in)."""
    _check_env(config, field)
    section = turn_section(config)
    for entry in config.env_layout():
        config_field = _env_config_field(config, entry.tag, field)
        try:
            make_env(entry.env_type, **env_kwargs(section, entry))  # constructors check their arguments; cheap
        except ConfigError as err:  # the environment's own message says what is wrong and what to fix
            raise ConfigError(f"{config_field}: {err}") from None
        except (ValueError, OSError) as err:
            raise ConfigError(f"{config_field}: environment '{entry.tag}' cannot be built from it ({err}); fix "
                              f"{config_field}") from None


def _env_config_field(config: RolloutConfig, tag: str, field: str) -> str:
    """The config field that holds the constructor arguments of environment ``tag`` (for messages)."""
    declared = tag in (config.custom_envs or {})
    return f"{field}custom_envs.{tag}.env_config" if declared else f"{field}env.env_config"


def _check_env(config: RolloutConfig, field: str = "") -> None:
    """Every tag names a registered environment (itself, or its custom_envs env_type) and has the data it needs
    (``field``: the config section the rollout sits in, for the messages)."""
    for entry in config.env_layout():
        declared = entry.tag in (config.custom_envs or {})
        where = (f"{field}custom_envs.{entry.tag}.env_type '{entry.env_type}'" if declared else
                 f"{field}env.tag '{entry.tag}'" if config.env.tags is None else f"{field}env.tags entry '{entry.tag}'")
        try:
            spec = env_spec(entry.env_type)
        except KeyError:
            fix = ("declare the tag in rollout.custom_envs with an env_type, or " if not declared and
                   config.env.tags is not None else "")
            raise ConfigError(f"{where} is not a registered environment; {fix}use one of: "
                              f"{', '.join(ENVIRONMENTS.names())}") from None
        if spec.needs_data and not ({"data", "data_path"} & entry.env_config.keys()):
            config_field = _env_config_field(config, entry.tag, field)
            raise ConfigError(f"environment '{entry.tag}' needs data: set {config_field}.data_path to a local "
                              ".jsonl, .json or .parquet file of records")


def _remove_stale_turns(out: Location, last_turn: int) -> None:
    """After a forced re-run: drop turn tables beyond the last turn played now (they belong to the old run)."""
    turns = out.child(TURNS_DIR)
    if not turns.exists():
        return
    for info in turns.list():
        name = info.base_name
        if name.startswith("turn_") and name[5:].isdigit() and int(name[5:]) > last_turn:
            Location(turns.fs, info.path).rmtree()


@dataclass(frozen=True)
class Reuse:
    """Committed tables of an earlier rollout that a replay starts from (``rollflow stage rollout_turn``): its reset
    table and its turns 0..k-1, as folders in turn order; the replay plays turn k on. The replay's folder holds only
    what it plays: its turn k reads turn k-1 where it is, and its samples stage records every turn it read."""

    episodes: str
    turns: tuple[str, ...]

    @property
    def previous(self) -> str:
        """The table turn k plays from (turn k-1, or the reset table for k = 0)."""
        return self.turns[-1] if self.turns else self.episodes


def committed_result(path: str) -> StageResult:
    """The :class:`StageResult` of a committed stage output (its manifest), as a skipped stage reports it."""
    loc = Location.of(path)
    manifest = read_manifest(loc) if loc.is_dir() else None
    if manifest is None:
        raise ConfigError(f"{loc.path} is not a committed stage output (no manifest.json); re-run the rollout that "
                          "wrote it")
    return StageResult(loc.uri(), manifest["fingerprint"], True, int(manifest.get("rows", 0)), 0.0,
                       manifest.get("metrics", {}), manifest.get("state", {}))


def run_rollout(config: RolloutConfig, output: str, checkpoint: str | None = None, *, force: bool = False,
                pool: EnginePool | None = None,
                on_event: Callable[[str, dict[str, Any]], None] | None = None,
                label: str = "rollout", reuse: Reuse | None = None, staleness: int | None = None) -> RolloutResult:
    """Play ``config.num_episodes`` episodes with the policy in ``checkpoint`` and write the tables under ``output``.

    ``pool``: an engine pool to reuse (it is pointed at ``checkpoint`` with in-place weight loading and left open);
    without one a pool is created and closed here. ``on_event(name, info)`` is called after each committed stage
    (names ``episodes``, ``turn``, ``samples``) — for progress output. ``label`` heads each turn's progress bar (on a
    terminal, see :mod:`stages.progress`). ``reuse``: start from another rollout's committed reset table and turns
    0..k-1 (read where they are, not copied) and play turn k on (``rollflow stage rollout_turn``). ``staleness``:
    the samples' staleness column (a training run's rollout played ahead; None: none).
    """
    start = time.time()
    notify = on_event or (lambda name, info: None)
    _check_env(config)
    model_dir = resolve_model_dir(checkpoint)
    require_ray("the rollout")
    section = turn_section(config)
    state = {"checkpoint": checkpoint_fingerprint(checkpoint or model_dir)}  # a URI's identity: its manifest
    out = Location.of(output)
    timings: dict[str, float] = {}

    own_pool = pool is None
    if own_pool:
        pool = EnginePool(config.engine, pool_source(checkpoint, model_dir), section.engine.max_model_len)
    else:  # a training flow's pool: same engines, this iteration's weights
        timings["load_weights_seconds"] = pool.use_checkpoint(pool_source(checkpoint, model_dir))
    # not fingerprinted: the engine settings beyond the section's identity, for a replay from a turn
    context = {"engine": pool.config.model_dump(mode="json"), "batch_rows": config.runtime.batch_rows}
    turns: list[StageResult] = []
    try:
        if reuse is None:
            episodes = run_stage(ResetStage(pool), section, {}, out.child(EPISODES_DIR).uri(), force=force,
                                 state_in=state, batch_rows=config.runtime.batch_rows, context=context)
        else:
            episodes = committed_result(reuse.episodes)
            turns = [committed_result(path) for path in reuse.turns]
        timings["reset_seconds"] = episodes.seconds
        notify("episodes", {"result": episodes})
        previous = turns[-1] if turns else episodes
        for turn in range(len(turns), max(entry.max_steps for entry in config.env_layout())):
            active = int(previous.metrics.get("active", 0))
            if active == 0:
                break
            with progress.bar(f"{label} turn {turn}", "episodes", total=active) as ticker:
                result = run_stage(TurnStage(turn, pool, active, ticker), section, {"previous": previous.output},
                                   out.child(TURNS_DIR).child(turn_dir_name(turn)).uri(), force=force,
                                   state_in={**state, "turn": turn}, batch_rows=config.runtime.batch_rows,
                                   context=context)
            turns.append(result)
            notify("turn", {"turn": turn, "result": result})
            previous = result
        if force:
            _remove_stale_turns(out, len(turns) - 1)
        names = [turn_dir_name(t) for t in range(len(turns))]
        samples = run_stage(SamplesStage(names), samples_section(config, staleness),
                            {name: r.output for name, r in zip(names, turns)}, out.child(SAMPLES_DIR).uri(),
                            force=force, batch_rows=config.runtime.batch_rows)
        notify("samples", {"result": samples})
        build_seconds = pool.build_seconds if own_pool and pool.built else 0.0
    finally:
        if own_pool:
            pool.close()
    timings.update({
        "turn_seconds": sum(t.seconds for t in turns),
        "generate_seconds": sum(t.metrics.get("generate_seconds", 0.0) for t in turns if not t.skipped),
        "env_seconds": sum(t.metrics.get("env_seconds", 0.0) for t in turns if not t.skipped),
        "samples_seconds": samples.seconds,
    })
    return RolloutResult(out.uri(), model_dir, episodes, turns, samples, build_seconds, time.time() - start, timings)


class EvalStage:
    """An evaluation's identity for :func:`stages.runner.stage_fingerprint`: the rollout of a config's held-out levels
    with a checkpoint, recorded as one output (stage, config, checkpoint) by :func:`run_eval`."""

    name = "eval"
    version = "1"


def run_eval(config: RolloutConfig, output: str, checkpoint: str | None = None, *, force: bool = False,
             pool: EnginePool | None = None, on_event: Callable[[str, dict[str, Any]], None] | None = None,
             label: str = "eval") -> RolloutResult:
    """:func:`run_rollout` of the held-out rollout ``config`` with ``checkpoint`` into ``output``, then the folder's
    own manifest (:func:`stages.commit.commit_record`): stage ``eval``, the rollout config as its section, the
    checkpoint as its input. So ``rollflow lineage`` sees which checkpoint an evaluation read and ``rollflow stage``
    re-runs it (on a re-trained checkpoint too). The tables' own fingerprints are those of any rollout, so a run
    folder written before these records resumes with its evaluations up to date (only the manifest is added)."""
    result = run_rollout(config, output, checkpoint, force=force, pool=pool, on_event=on_event, label=label)
    start = time.time()
    # the checkpoint as named (a URI on an object store, not its local copy), so lineage and re-runs find it
    model = Location.of(checkpoint if is_uri(checkpoint) else result.model_dir)
    state_in = {"checkpoint": model_fingerprint(model.uri()), "samples": result.samples.fingerprint}
    fp = stage_fingerprint(EvalStage, config, {}, state_in)  # type: ignore[arg-type]

    def build() -> dict[str, Any]:
        return {"stage": EvalStage.name, "version": EvalStage.version, "table": "rollout",
                "section": config.model_dump(mode="json"),
                "inputs": {"checkpoint": {"path": model.uri(), "fingerprint": state_in["checkpoint"]}},
                "state_in": state_in, "rows": result.samples.rows, "metrics": result.samples.metrics, "state": {},
                "created_unix": time.time(), "seconds": round(result.seconds, 3)}

    manifest, skipped = commit_record(Location.of(result.output), fp, build, force=force)
    result.record = StageResult(result.output, fp, skipped and result.samples.skipped, manifest["rows"],
                                result.seconds + time.time() - start, manifest.get("metrics", {}), {})
    return result


def earlier_tables(turn: Location) -> list[Location]:
    """The tables turn folder ``turn`` was played from, oldest first: the reset table, then turns 0..k-1, found by
    following each turn manifest's ``previous`` input (a replay's first turn reads the turn before it in the
    rollout it replays). Raises a ConfigError naming a link that is gone or is not a rollout table, a SchemaError
    naming a turn manifest that records no previous table."""
    chain: list[Location] = []
    here = turn
    while True:
        manifest = read_manifest(here) if here.is_dir() else None
        if manifest is None or manifest.get("stage") not in (ResetStage.name, TurnStage.name):
            raise ConfigError(f"{here.path} is not a committed rollout table (episodes/ or turns/turn_<k>/), but "
                              f"{turn.path} was played from it; restore it, or replay from an earlier turn")
        if manifest["stage"] == ResetStage.name:
            return chain[::-1]
        inputs = manifest_field(here, manifest, "inputs")
        if "previous" not in inputs:
            raise damaged_manifest(here, "it records no input 'previous' (the table its turn was played from)")
        here = here.recorded(inputs["previous"]["path"])
        chain.append(here)


def committed_turn_dirs(output: str) -> list[Location]:
    """The turn tables of a rollout folder, in turn order: those the samples stage read if it committed, else every
    committed ``turns/turn_*`` folder (a rollout still running or killed). A replay from a turn
    (``rollflow stage rollout_turn``) holds only the turns it played: the earlier ones are where it read them."""
    out = Location.of(output)
    manifest = read_manifest(out.child(SAMPLES_DIR)) if out.child(SAMPLES_DIR).exists() else None
    turns = out.child(TURNS_DIR)
    if manifest:  # the names, resolved inside this folder (it may have been moved since), else where they were read
        inputs = manifest.get("inputs", {})
        return [turns.child(name) if turns.child(name).is_dir() else out.recorded(inputs[name]["path"])
                for name in sorted(inputs)]
    if not turns.exists():
        return []
    found = sorted(i.base_name for i in turns.list() if i.base_name.startswith("turn_"))
    played = [turns.child(name) for name in found if read_manifest(turns.child(name)) is not None]
    return (earlier_tables(played[0])[1:] if played else []) + played


def reset_dir(output: str) -> Location | None:
    """The reset table of the rollout folder ``output``: its ``episodes/``, or for a replay from a turn the one its
    first turn was played from; None when there is none."""
    out = Location.of(output)
    if out.child(EPISODES_DIR).exists():
        return out.child(EPISODES_DIR)
    turns = committed_turn_dirs(output)
    return earlier_tables(turns[0])[0] if turns else None
