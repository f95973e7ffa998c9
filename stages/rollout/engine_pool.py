"""Long-lived engine actors: built once per rollout (or once per training run), reused by every turn.

Building a vLLM engine on a CPU machine takes 20–80 s (STACK.md), so the engine must not live inside a Ray Data
operator (Ray Data creates and destroys its actors with every dataset execution, i.e. every turn). Instead the
driver owns an :class:`EnginePool` of ``EngineActor``\\ s; a turn stage's Ray Data tasks hold the actor handles and
send each batch to one actor. New weights between iterations go through ``load_weights`` (in place where the backend
allows it), not a rebuild. The pool is lazy: a rollout whose turns are all committed already never builds it.

The actor also runs the pure per-episode code (:mod:`stages.rollout.episode`) for the batch it generated: building
prompts needs the checkpoint's tokenizer, which the actor has loaded anyway, while a Ray Data task would have to
import transformers (and torch) first — 5–15 s per fresh worker process on a loaded 2-core machine. Environment steps
are pure Python and take milliseconds. The Ray Data task stays thin: rows in, rows out, partials written.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import pyarrow as pa

from schemas.errors import ConfigError, RollflowError
from schemas.rollout_config import EngineConfig
from stages.generation.engines import EngineMemory, GenRequest, GenResult, build_engine, load_tokenizer
from stages.ray_errors import unplaced_hint
from stages.rollout.episode import play_turn, reset_row, turn_request
from stages.rollout.prompts import ChatFormat
from stages.rollout.tables import rows_to_table
from stages.storage import ATTEMPT_KEY, Location, is_uri, read_manifest
from stages.train.checkpoint import local_path

if TYPE_CHECKING:
    from schemas.rollout_config import TurnSection

log = logging.getLogger("rollflow.rollout")


class EngineStalled(RollflowError):
    """An engine actor was not placed, or stalled building or reloading, past its limit (engine.*_timeout_s)."""


class EngineActor:
    """One generation engine in a Ray actor (wrapped with ``ray.remote`` by :class:`EnginePool`). Created empty (its
    process placed and started: :meth:`where` answers), then built (:meth:`build`), so the pool tells an engine Ray
    never placed from one that stalls while it builds."""

    def __init__(self, backend: str, model_dir: str, options: dict[str, Any]) -> None:
        self.backend, self.model_dir, self.options = backend, model_dir, dict(options)
        self.engine: Any = None
        self.build_seconds = 0.0
        self.transitions: list[str] = []  # "sleep1" / "sleep2" / "wake", in order (info())

    def where(self) -> tuple[int, str]:
        """This engine's process id and host."""
        return os.getpid(), socket.gethostname()

    def build(self) -> dict[str, Any]:
        """Build the engine on the actor's checkpoint; returns :meth:`info`."""
        start = time.time()
        self.engine = build_engine(self.backend, self.model_dir, **self.options)
        self.build_seconds = time.time() - start
        return self.info()

    def _tokenizer(self) -> Any:
        """The tokenizer of the actor's checkpoint: the engine's when it loaded that folder's (the hf backend: one
        parse of tokenizer.json per actor, not two), else loaded."""
        shared = getattr(self.engine, "tokenizer_dir", None)
        if shared is not None and os.path.realpath(shared) == os.path.realpath(self.model_dir):
            return self.engine.tokenizer
        return load_tokenizer(self.model_dir)

    def _chat(self, prompt):
        """The chat format of a rollout's prompt config (see :meth:`_chat_format`)."""
        return self._chat_format(prompt.system_prompt, prompt.example_turns())

    def _chat_format(self, system_prompt: str, examples: tuple = ()):
        """The checkpoint's chat format (tokenizer + template pieces), loaded once per checkpoint and prompt."""
        key = (self.model_dir, system_prompt, examples)
        if getattr(self, "_chat_key", None) != key:
            self._chat_cache = ChatFormat.of(self._tokenizer(), system_prompt, examples)
            self._chat_key = key
        return self._chat_cache

    def reset(self, section: "TurnSection", env_ids: list[int]) -> pa.Table:
        """The reset rows (first prompts) of episodes ``env_ids``."""
        chat = self._chat(section.prompt)
        return rows_to_table([reset_row(section, chat, env_id) for env_id in env_ids])

    def play(self, section: "TurnSection", previous: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        """One turn of the episodes in ``previous`` (their latest rows): generate, step, build next prompts."""
        chat = self._chat(section.prompt)
        rows = previous.to_pylist()
        start = time.time()
        results = self.engine.generate([turn_request(section, row) for row in rows])
        generate_seconds = time.time() - start
        start = time.time()
        played = [play_turn(section, chat, row, result) for row, result in zip(rows, results)]
        env_seconds = time.time() - start
        return rows_to_table(played), {"generate_seconds": generate_seconds, "env_seconds": env_seconds}

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "model_dir": self.model_dir, "build_seconds": self.build_seconds,
                "omp_threads": os.environ.get("OMP_NUM_THREADS"), "transitions": list(self.transitions)}

    def generate(self, requests: Sequence[GenRequest]) -> tuple[list[GenResult], float]:
        """The engine's results for ``requests`` and the seconds the engine took."""
        start = time.time()
        results = self.engine.generate(list(requests))
        return results, time.time() - start

    def complete(self, system_prompt: str, user_messages: Sequence[str], sampling: Sequence[Any],
                 sequence_length: int) -> tuple[list[GenResult], float]:
        """Single-turn chat completions: each user message after ``system_prompt``, sampled with its
        :class:`SamplingSpec` (``n`` samples each), the token budget cut to fit ``sequence_length``. Returns the
        results and the engine's seconds."""
        chat = self._chat_format(system_prompt)
        requests = []
        for message, spec in zip(user_messages, sampling):
            ids = chat.single_turn_ids(message)
            room = sequence_length - len(ids)
            if room < 1:
                raise ConfigError(f"a prompt has {len(ids)} tokens, which does not fit sequence_length="
                                  f"{sequence_length}; raise sequence_length or shorten the prompt ({message[:60]!r})")
            budget = dataclasses.replace(spec, max_new_tokens=min(spec.max_new_tokens, room))
            requests.append(GenRequest(prompt_token_ids=ids, sampling=budget))
        return self.generate(requests)

    def load_weights(self, checkpoint_dir: str) -> float:
        start = time.time()
        self.engine.load_weights(checkpoint_dir)
        self.model_dir = checkpoint_dir
        return time.time() - start

    def sleep(self, level: int) -> dict[str, int]:
        """Give the engine's memory back (:class:`~stages.generation.engines.EngineMemory`); what it released."""
        if not isinstance(self.engine, EngineMemory):
            raise ConfigError(f"the {type(self.engine).__name__} engine cannot sleep; set sleep_level: 0 in the "
                              "engine section")
        report = self.engine.sleep(level)
        self.transitions.append(f"sleep{level}")
        return report

    def wake(self, checkpoint_dir: str | None) -> None:
        """Take the memory again, with the weights of ``checkpoint_dir`` when given (loaded in place)."""
        self.engine.wake(checkpoint_dir)
        if checkpoint_dir is not None:
            self.model_dir = checkpoint_dir
        self.transitions.append("wake")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def local_model_dir(model_dir: str | os.PathLike) -> str:
    """The local folder an engine loads for ``model_dir``: the folder itself, or for a checkpoint on an object store
    (``s3://...``) its local copy in the rollflow cache (stages.train.checkpoint.local_path; downloaded once)."""
    if is_uri(model_dir):
        return str(local_path(str(model_dir)))
    return str(Path(model_dir).resolve())


def checkpoint_fingerprint(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Identity of a checkpoint folder for stage fingerprints: its path and its weight/config files' sizes and
    modification times (a retrained checkpoint written to the same folder gets a new fingerprint). A checkpoint on
    an object store: its URI, its manifest's fingerprint and the attempt that holds it (a retrained checkpoint is a
    new attempt), not its local copy's times, so a copy downloaded anew (another machine, a cleared cache) leaves
    the rollouts played with it up to date."""
    if is_uri(model_dir):
        return _store_checkpoint_identity(str(model_dir))
    folder = Path(model_dir).resolve()
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    return {"path": str(folder), "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def _store_checkpoint_identity(uri: str) -> dict[str, Any]:
    loc = Location.of(uri)
    manifest = read_manifest(loc)
    if manifest is None or ATTEMPT_KEY not in manifest:
        raise RollflowError(f"{uri} holds no committed checkpoint (no manifest naming an attempt); pass a checkpoint "
                            "a rollflow command wrote to this store, or a local folder")
    return {"path": loc.uri(), "fingerprint": manifest["fingerprint"], "attempt": manifest[ATTEMPT_KEY]}


class EnginePool:
    """``num_engines`` engine actors over one checkpoint. Built on first use; ``close`` kills them.

    Nothing waits forever: engines Ray does not place within ``engine.placement_timeout_s`` fail with what each asks
    and what the cluster has free; an engine that takes longer than ``build_timeout_s`` to build, or than
    ``reload_timeout_s`` to load new weights, sleep or wake, fails the pool naming its process and host
    (:class:`EngineStalled`)."""

    actor_class: ClassVar[type] = EngineActor  # what each engine actor runs (tests stand a stalling one in)

    def __init__(self, engine: EngineConfig, model_dir: str | os.PathLike, max_model_len: int,
                 gpus_per_engine: float | None = None) -> None:
        self.config = engine
        self.source = str(model_dir)  # as given: a checkpoint on an object store is resolved again at each use
        self.model_dir = local_model_dir(model_dir)
        self.max_model_len = int(max_model_len)
        self._actors: list[Any] = []
        self.build_seconds = 0.0
        self.asleep = False
        self.gpus_per_engine = engine.num_gpus_per_engine if gpus_per_engine is None else float(gpus_per_engine)
        self._where: list[tuple[int, str]] = []  # (pid, host) of each actor, once placed

    def asks(self) -> dict[str, float]:
        """What each engine actor reserves in Ray."""
        return {"CPU": self.config.num_cpus_per_engine, **({"GPU": self.gpus_per_engine} if self.gpus_per_engine
                                                             else {})}

    def _await(self, actors: list[Any], method: str, args: tuple, limit: float | None, doing: str,
               field: str) -> list[Any]:
        """``method(*args)`` on every actor, its results; :class:`EngineStalled` when one has not answered within
        ``limit`` seconds (None: no limit), naming it (its process, once placed), ``doing`` and the ``field``."""
        import ray

        refs = [getattr(a, method).remote(*args) for a in actors]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=limit)
        if pending:
            late = [i for i, ref in enumerate(refs) if ref in pending]
            raise EngineStalled(self._stalled(late, len(actors), limit, doing, field))
        return ray.get(refs)

    def _stalled(self, late: list[int], total: int, limit: float | None, doing: str, field: str) -> str:
        """Why the engines ``late`` (indexes) stopped the pool: not placed (no process yet), or stalled ``doing``."""
        backend, limit_text = self.config.backend, f"engine.{field} ({limit:g} s)"
        if not self._where:
            return (f"{len(late)} of {total} {backend} engine(s) (engine(s) {late}) were not placed by Ray within "
                    f"{limit_text}: {unplaced_hint(self.asks())}")
        pid, host = self._where[late[0]]
        more = f" and {len(late) - 1} more" if len(late) > 1 else ""
        return (f"{backend} engine {late[0]} (pid {pid} on {host}){more} has been {doing} for more than {limit_text}; "
                f"py-spy dump --pid {pid} shows where it waits, or raise engine.{field} (null: no limit)")

    def _threads(self) -> int:
        return self.config.threads or max(1, (os.cpu_count() or 1) // self.config.num_engines)

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"dtype": self.config.dtype, "max_model_len": self.max_model_len,
                                   "num_threads": self._threads()}
        if self.config.backend == "hf" and self.config.num_gpus_per_engine > 0:
            options["device"] = "cuda"
        if self.config.backend == "vllm" and self.config.sleep_level:
            options["sleep_mode"] = True
        options.update(self.config.options)
        return options

    @property
    def built(self) -> bool:
        return bool(self._actors)

    def handles(self) -> list[Any]:
        """The actor handles, building the actors (in parallel) on first call."""
        if self._actors:
            if self.asleep:  # whoever generates next finds the engines awake (with the pool's checkpoint)
                self.wake()
            return self._actors
        import ray

        start = time.time()
        self.model_dir = local_model_dir(self.source)  # an object store's copy, downloaded again if it was removed
        threads = str(self._threads())
        env_vars = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
                    **self.config.backend_env(), **self.config.env_vars}
        remote = ray.remote(self.actor_class).options(num_cpus=self.config.num_cpus_per_engine,
                                                      num_gpus=self.gpus_per_engine,
                                                      runtime_env={"env_vars": env_vars}, max_restarts=0)
        actors = [remote.remote(self.config.backend, self.model_dir, self._options())
                  for _ in range(self.config.num_engines)]
        try:
            self._where = []
            self._where = self._await(actors, "where", (), self.config.placement_timeout_s, "placed",
                                      "placement_timeout_s")
            infos = self._await(actors, "build", (), self.config.build_timeout_s,
                                f"building its engine on {self.model_dir}", "build_timeout_s")
        except BaseException:
            self._where = []
            for a in actors:
                ray.kill(a)
            raise
        self._actors = actors
        self.build_seconds = time.time() - start
        log.info("built %d %s engine(s) on %s in %.1fs: %s", len(actors), self.config.backend, self.model_dir,
                 self.build_seconds, infos)
        return actors

    def use_checkpoint(self, model_dir: str | os.PathLike) -> float:
        """Point the pool at ``model_dir``: in-place weight loading if the actors run; returns seconds spent."""
        source, model_dir = str(model_dir), local_model_dir(model_dir)
        if self.asleep and self._actors:  # wake with the new weights: the GPU never holds both
            reload = model_dir != self.model_dir or self.config.sleep_level >= 2  # (level 2 kept no weights)
            return self._wake(source, model_dir) if reload else self._wake(None, None)
        if not self._actors or model_dir == self.model_dir:
            self.source, self.model_dir = source, model_dir
            return 0.0
        start = time.time()
        self._await(self._actors, "load_weights", (model_dir,), self.config.reload_timeout_s,
                    f"loading the weights of {model_dir}", "reload_timeout_s")
        self.source, self.model_dir = source, model_dir
        return time.time() - start

    def sleep(self) -> dict[str, float] | None:
        """Between rollouts (after generation, before the log-prob, values and training stages), the engines give
        their memory back at the config's ``sleep_level`` (ROLL's colocation; the CPU engines release what they
        can, stages/generation/engines.py ``EngineMemory``). Returns the metrics of the transition: the level, GiB
        released and offloaded over all engines, seconds; None when the engines never sleep (sleep_level 0), are
        not built (every rollout was committed already) or sleep already."""
        level = self.config.sleep_level
        if not level or not self._actors or self.asleep:
            return None
        start = time.time()
        reports = self._await(self._actors, "sleep", (level,), self.config.reload_timeout_s,
                              f"going to sleep (level {level})", "reload_timeout_s")
        self.asleep = True
        gib = float(2**30)
        return {"engine/sleep_level": float(level),
                "engine/released_gib": sum(r["released_bytes"] for r in reports) / gib,
                "engine/offloaded_gib": sum(r["offloaded_bytes"] for r in reports) / gib,
                "engine/sleep_seconds": time.time() - start}

    def wake(self, model_dir: str | os.PathLike | None = None) -> float:
        """Wake sleeping engines, loading ``model_dir``'s weights in place when given; after a level 2 sleep (weights
        discarded) the pool's checkpoint is reloaded when no other is given. Returns the seconds it took."""
        if not self.asleep:
            return 0.0
        source = str(model_dir) if model_dir is not None else None
        if source is None and self.config.sleep_level >= 2:  # reloaded: an object store's copy may have been removed
            source = self.source
        return self._wake(source, local_model_dir(source) if source is not None else None)

    def _wake(self, source: str | None, target: str | None) -> float:
        """Wake the engines with the weights of the local folder ``target`` (the copy of ``source``), or with those
        they kept when None. Returns the seconds it took."""
        start = time.time()
        self._await(self._actors, "wake", (target,), self.config.reload_timeout_s,
                    f"waking{f' with the weights of {target}' if target else ''}", "reload_timeout_s")
        self.asleep = False
        if target is not None:
            self.source, self.model_dir = source, target
        return time.time() - start

    def actor_info(self) -> list[dict[str, Any]]:
        """pid, model folder, build time and sleep/wake transitions of every engine actor (builds them if needed;
        sleeping engines stay asleep)."""
        import ray

        return ray.get([a.info.remote() for a in (self._actors or self.handles())])

    def generate(self, requests: Sequence[GenRequest], engine_index: int = 0) -> tuple[list[GenResult], float]:
        """Call one engine directly (what the benchmark compares the stage with)."""
        import ray

        return ray.get(self.handles()[engine_index].generate.remote(list(requests)))

    def close(self) -> None:
        if not self._actors:
            return
        import ray

        actors, self._actors, self.asleep = self._actors, [], False
        try:
            ray.get([a.close.remote() for a in actors], timeout=60)
        except Exception as err:  # the actor may be gone already; killing it below is what matters
            log.warning("engine close failed (%s); killing the actors", err)
        for a in actors:
            ray.kill(a)

    def __enter__(self) -> "EnginePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
