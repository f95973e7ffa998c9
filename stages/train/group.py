"""The training workers of a run: one Ray Train worker group (``TorchTrainer``) that lives across training steps.

A training flow keeps its workers the way it keeps its generation engines: the group starts on the first step, each
step is a request sent to every rank, and the DeepSpeed engines stay in memory between steps when the next step
starts from the checkpoint the previous one wrote (:func:`stages.train.core.train_and_save`). Starting a group and
its engines costs 15-30 s of a CPU iteration (Ray Train's controller and worker processes, imports, DeepSpeed set-up,
loading the checkpoint); a kept group pays it once per run. A step writes its weights, and DeepSpeed's state every
``save_steps`` steps and at the run's last; a resumed run rebuilds the engines from the newest state by replaying
the steps since (stages/train/checkpoint.py), so it trains exactly what the kept engines held.

The protocol: a :class:`Mailbox` actor with one inbox per rank (each rank waits on its own inbox between steps, so
no collective waits on a timeout) and the replies rank 0 sends once the checkpoint is written. A failed step raises
out of the worker loop, which ends the group; the error reaches the caller as the fit's error and the next step
starts a fresh group. ``keep_workers: false`` (or a one-off ``rollflow train-step``) makes a group for one step.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

from schemas.errors import RollflowError, SchemaError
from schemas.train_config import TrainSection
from stages.ray_errors import unplaced_hint
from stages.storage import Location, is_uri

log = logging.getLogger("rollflow.train")

_POLL_S = 0.5
_KEPT_WORKER_MEMORY = 64 * 2**20
# Ray Train 2.60 starts a PreemptionWatcher actor per worker group, which only reports a cloud node's preemption
# notice to the workers (``ray.train.get_preemption_info``). A group here runs with ``max_failures=0`` and nothing in
# it asks, so the actor is off: one process (about 3 CPU-seconds to start) less per group. Set
# RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=1 to have it.
_RAY_TRAIN_DEFAULTS = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


class Mailbox:
    """The requests of a worker group (one inbox per rank) and rank 0's replies, in one threaded Ray actor (a single
    process). Blocking gets wait at most ``timeout`` seconds: :meth:`receive` then returns ``_NOTHING`` (``None`` is
    the request to stop), :meth:`answer` returns None."""

    def __init__(self, ranks: int):
        self._inboxes = [queue.Queue() for _ in range(ranks)]
        self._replies = queue.Queue()
        self._states: dict[int, tuple[str, int, str, float]] = {}

    def send(self, request: Any) -> None:
        for inbox in self._inboxes:
            inbox.put(request)

    def receive(self, rank: int, timeout: float) -> Any:
        try:
            return self._inboxes[rank].get(timeout=timeout)
        except queue.Empty:
            return _NOTHING

    def checkin(self, rank: int, state: str, pid: int, host: str) -> None:
        """``rank`` is now in ``state`` (joining, idle, building engines, training), in process ``pid`` on ``host``."""
        self._states[rank] = (state, pid, host, time.monotonic())

    def states(self) -> dict[int, tuple[str, int, str, float]]:
        """Each rank that checked in: (state, pid, host, seconds in that state, by this actor's clock)."""
        now = time.monotonic()
        return {rank: (state, pid, host, now - since) for rank, (state, pid, host, since) in self._states.items()}

    def reply(self, answer: str) -> None:
        self._replies.put(answer)

    def answer(self, timeout: float) -> str | None:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            return None


_NOTHING = "<nothing>"
JOINING, IDLE, BUILDING, TRAINING = "joining the process group", "idle", "building its engines", "training"
FORWARD = "computing log-probs / values"


class TrainingStalled(RollflowError):
    """A training worker was not placed, or stalled, past its limit (runtime.*_timeout_s)."""


@dataclass(frozen=True)
class Limits:
    """The limits of ``runtime`` (TrainRuntimeConfig), seconds or None (no limit)."""

    placement: float | None
    build: float | None
    step: float | None

    @classmethod
    def of(cls, runtime) -> "Limits":
        return cls(runtime.placement_timeout_s, runtime.engine_build_timeout_s, runtime.step_timeout_s)

    def of_state(self, state: str) -> tuple[float | None, str]:
        """The limit on one stay in ``state`` and the fields that set it."""
        if state in (TRAINING, FORWARD):
            return self.step, "step_timeout_s"
        if state in (BUILDING, JOINING):
            if self.build is None and self.step is None:
                return None, ""
            return (self.build or 0.0) + (self.step or 0.0), "engine_build_timeout_s + step_timeout_s"
        return None, ""


def stall(states: dict[int, tuple[str, int, str, float]], ranks: int, waited: float, limits: Limits) -> str | None:
    """Why a step that has waited ``waited`` seconds since its group started should stop (None: keep waiting).
    ``states``: the mailbox's (state, pid, host, seconds in it) per rank that checked in. Pure."""
    missing = [r for r in range(ranks) if r not in states]
    if missing:
        if limits.placement is not None and waited > limits.placement:
            return (f"{len(missing)} of {ranks} training workers (rank(s) {missing}) were not placed by Ray within "
                    f"runtime.placement_timeout_s ({limits.placement:g} s)")
        return None
    for rank, (state, pid, host, age) in sorted(states.items()):
        limit, fields = limits.of_state(state)
        if limit is not None and age > limit:
            return (f"training worker rank {rank} (pid {pid} on {host}) has been {state} for {age:.0f} s, past "
                    f"runtime.{fields} ({limit:g} s); py-spy dump --pid {pid} shows where it waits")
    return None


def _requests(mailbox, rank: int):
    """The step requests of ``rank``, in order, until the group closes (a ``None`` request)."""
    import ray

    while True:
        request = ray.get(mailbox.receive.remote(rank, 30.0))
        if request is None:
            return
        if request != _NOTHING:
            yield request


def _serve(config: dict) -> None:
    """One Ray Train worker: join the process group once, then run every request sent to this rank until the group
    closes: a training step, or a forward request (``op: forward``, :mod:`stages.train.actor_forward`). Rank 0
    replies with the request's id once the checkpoint folder (or every rank's part of the forward output) is
    written."""
    import torch

    from stages.train.actor_forward import forward_on_rank
    from stages.train.core import train_and_save
    from stages.train.distributed import init_distributed
    from stages.train.forward import ForwardModels
    from stages.train.train_table import read_train_table

    import ray.train

    mailbox = config["mailbox"]
    rank = ray.train.get_context().get_world_rank()
    checkin = partial(_checkin, mailbox, rank)
    checkin(JOINING)
    dist = init_distributed(config["threads"])
    checkin(IDLE)
    held, models = None, ForwardModels()
    for request in _requests(mailbox, dist.rank):
        if request.get("op") == "forward":
            checkin(FORWARD)
            held = forward_on_rank(request, dist, held, models if config["keep"] else ForwardModels())
            torch.distributed.barrier()  # every rank's part is written before rank 0 replies
            _return_cached_gpu_memory()
            checkin(IDLE)
            if dist.rank == 0:
                mailbox.reply.remote(request["id"])
            continue
        checkin(BUILDING if held is None else TRAINING)
        samples: Location = request["samples"]
        table = read_train_table(samples, request["columns"])
        if table is None or table.num_rows == 0:
            raise SchemaError(f"advantaged table at {samples.path} has no rows; nothing to train on")
        cfg = TrainSection.model_validate(request["section"])
        _, held = train_and_save(table, samples.uri(), request["checkpoint"], cfg, request["output"], dist,
                                 progress=request["progress"] if dist.rank == 0 else None, held=held,
                                 committed_as=request["committed_as"] if config["keep"] else None,
                                 full_state=request["full_state"], store=samples.fs)
        _return_cached_gpu_memory()  # a colocated engine wakes into it
        checkin(IDLE)
        if dist.rank == 0:
            mailbox.reply.remote(request["id"])


def _checkin(mailbox, rank: int, state: str) -> None:
    import ray

    ray.get(mailbox.checkin.remote(rank, state, os.getpid(), socket.gethostname()))


def _return_cached_gpu_memory() -> None:
    """Give the CUDA caching allocator's free blocks (activations of the step) back to the device, so an engine that
    shares the GPU can take them when it wakes; nothing on a CPU worker."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class TrainerGroup:
    """The run's training workers (Ray Train, DeepSpeed), started on the first :meth:`step` or :meth:`forward` and
    kept until :meth:`close` when ``keep``; else started and closed around each request. Besides training steps it
    serves the forward passes of the log-prob and values stages on the engines it holds (the actor group of issue
    44, :mod:`stages.train.actor_forward`).

    ``runtime``: a :class:`schemas.train_config.TrainRuntimeConfig`. ``storage``: a folder for Ray Train's own run
    files (removed on close). A kept group reserves no Ray CPUs: it computes only inside a training step, when the
    flow runs no other stage (the rule of an engine with ``num_cpus_per_engine: 0``), so the log-prob actors and
    Ray Data's tasks can use the CPUs between steps; its torch threads stay ``cpus_per_worker``."""

    def __init__(self, runtime, storage: str | None = None, keep: bool = True, gpus_per_worker: float | None = None,
                 section: dict | None = None):
        """``gpus_per_worker``: each worker's Ray GPU share when the run decides it (colocation with the engines,
        stages.plan.gpu_shares); default one GPU per worker with ``use_gpu``. ``section``: the training section the
        run trains under (a TrainSection's JSON dump): a forward request on a kept group builds the engines of its
        checkpoint under it when the group holds none, so the next training step finds them (one copy of the
        policy for both); None: a forward request uses held engines or loads models beside them."""
        self.runtime, self.keep = runtime, keep and runtime.keep_workers
        self.section = section
        self.gpus_per_worker = (1.0 if runtime.use_gpu else 0.0) if gpus_per_worker is None else gpus_per_worker
        self._storage_root = storage
        self._fit: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._mailbox = None
        self._storage: str | None = None

    def step(self, request: dict[str, Any], unwrap) -> None:
        """Run one training step (``request``: samples Location, columns, checkpoint, output, committed_as, section,
        full_state, progress) on every rank and wait until rank 0 reports the checkpoint written. A failure of the group is
        raised as ``unwrap`` sees it (the user error inside Ray's wrappers) and the group is dropped."""
        self._call(request, unwrap)

    def forward(self, request: dict[str, Any], unwrap) -> None:
        """Run one forward request (:func:`stages.train.actor_forward.forward_on_rank`) on every rank and wait until
        each rank's part is written; failures as in :meth:`step`. The engines it builds (``request["section"]``) or
        uses stay held for the next training step."""
        self._call({**request, "op": "forward"}, unwrap)

    def _call(self, request: dict[str, Any], unwrap) -> None:
        import ray

        if self._fit is None:
            self._start()
        request = {**request, "id": uuid.uuid4().hex}
        ray.get(self._mailbox.send.remote(request))
        try:
            while not self._reply(request["id"]):
                if not self._fit.is_alive():
                    raise self._failure or RuntimeError("the training workers stopped before finishing the request")
                self._check_progress()
        except BaseException as err:
            self._drop()
            real = unwrap(err)
            if real is not err:
                raise real from None
            raise
        if not self.keep:
            self.close()

    def _check_progress(self) -> None:
        """Raise :class:`TrainingStalled` when a worker was not placed, or stalls, past its limit."""
        import ray

        states = ray.get(self._mailbox.states.remote())
        problem = stall(states, self.runtime.num_workers, time.monotonic() - self._started, Limits.of(self.runtime))
        if problem is None:
            return
        if len(states) < self.runtime.num_workers:
            problem += ": " + unplaced_hint(self.worker_resources())
        raise TrainingStalled(problem)

    def _reply(self, want: str) -> bool:
        import ray

        return ray.get(self._mailbox.answer.remote(_POLL_S)) == want

    def _start(self) -> None:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig

        for name, value in _RAY_TRAIN_DEFAULTS.items():  # Ray Train hands these on from the driver's environment
            os.environ.setdefault(name, value)
        rt = self.runtime
        root = self._storage_root if self._storage_root and not is_uri(self._storage_root) else None
        if root is not None:  # a run folder on object storage: Ray Train's few files go to a local temporary folder
            os.makedirs(root, exist_ok=True)
        self._storage = tempfile.mkdtemp(prefix=".ray-train-", dir=root)
        self._mailbox = ray.remote(num_cpus=0, max_concurrency=rt.num_workers + 3)(Mailbox).remote(rt.num_workers)
        kwargs = {
            "train_loop_config": {"mailbox": self._mailbox, "threads": rt.torch_threads(), "keep": self.keep},
            "scaling_config": ScalingConfig(num_workers=rt.num_workers, use_gpu=rt.use_gpu,
                                            resources_per_worker=self.worker_resources()),
            "torch_config": TorchConfig(backend="nccl" if rt.use_gpu else "gloo"),
            "run_config": RunConfig(name=f"train-{uuid.uuid4().hex[:8]}", storage_path=self._storage,
                                    failure_config=FailureConfig(max_failures=0)),
        }
        self._failure = None
        self._started = time.monotonic()
        self._fit = threading.Thread(target=self._run, args=(kwargs,), name="rollflow-train-group", daemon=True)
        self._fit.start()
        log.info("training workers: %d (%s), kept across steps: %s", rt.num_workers,
                 "GPU" if rt.use_gpu else "CPU", self.keep)

    def worker_resources(self) -> dict[str, float]:
        """What each worker reserves in Ray (Ray Train's ``resources_per_worker``: one bundle per worker). A kept
        worker reserves no CPU; Ray refuses a bundle of zeros, so it names a token of memory (no other task of a run
        reserves memory, so this blocks nothing). With ``use_gpu`` its GPU, or its share of a GPU colocated with the
        sleeping engines (Ray Train accepts a fraction). And the custom resources that pin the workers to a node
        (``runtime.stage_resources``)."""
        rt = self.runtime
        resources: dict[str, float] = ({"CPU": 0, "memory": _KEPT_WORKER_MEMORY} if self.keep
                                       else {"CPU": rt.cpus_per_worker})
        if rt.use_gpu:
            resources["GPU"] = self.gpus_per_worker
        resources.update(rt.resources_for("train_step"))
        return resources

    def _run(self, kwargs: dict) -> None:
        """The worker group's whole life, in a thread of this process (``TorchTrainer.fit`` returns when the group
        closes; Ray Train supports a fit outside the main thread). A failure is kept for :meth:`step`."""
        from ray.train.torch import TorchTrainer

        try:
            TorchTrainer(_serve, **kwargs).fit()
        except BaseException as err:  # noqa: BLE001 (handed to the caller's thread)
            self._failure = err

    def close(self) -> None:
        """Stop the workers (each rank leaves its loop, the fit returns) and remove Ray Train's run files."""
        import ray

        if self._fit is not None:
            ray.get(self._mailbox.send.remote(None))
            self._fit.join(timeout=60)
            if self._failure is not None:  # the step that failed already raised its error
                log.info("training workers ended with: %s", self._failure)
        self._drop()

    def _drop(self) -> None:
        """Forget the group. A fit still running (a close that timed out) ends with this process: Ray Train's
        controller and workers belong to it."""
        import ray

        if self._mailbox is not None:
            ray.kill(self._mailbox)
        self._fit, self._mailbox = None, None
        if self._storage is not None:
            shutil.rmtree(self._storage, ignore_errors=True)
            self._storage = None

    def __enter__(self) -> "TrainerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
