"""The training workers of a run: one group of Ray actors, one per data-parallel rank, that lives across steps.

A training flow keeps its workers the way it keeps its generation engines: the group starts on the first step, each
step is a request sent to every rank, and the DeepSpeed engines stay in memory between steps when the next step
starts from the checkpoint the previous one wrote (:func:`stages.train.core.train_and_save`). Starting a group and
its engines costs seconds of a CPU iteration (a process per rank, imports, DeepSpeed set-up, loading the
checkpoint); a kept group pays it once per run. A step writes its weights, and DeepSpeed's state every
``save_steps`` steps and at the run's last; a resumed run rebuilds the engines from the newest state by replaying
the steps since (stages/train/checkpoint.py), so it trains exactly what the kept engines held.

The group is plain Ray actors in one placement group (PACK, one bundle per rank), which join one torch.distributed
process group (gloo on CPU, nccl on GPUs) as Ray Train would set it up: rank 0's node address and a free port on it,
RANK, WORLD_SIZE, LOCAL_RANK and NODE_RANK, and on a node with GPUs every worker seeing the node's training GPUs
(CUDA_VISIBLE_DEVICES: the union of the workers' GPUs there, LOCAL_RANK its own GPU's place in it, so NCCL can use
peer-to-peer). Ray Train itself is not used: docs/training.md says why, with the measured cost.

The driver sends a request to every rank as an actor call and waits for all of them, tracking each rank's state
(joining, building its engines, training, computing log-probs / values) and its time in it; past a limit of
``runtime.*_timeout_s`` the step fails naming the worker (:func:`stall`). A rank that raises fails the request with
its error (the user's error, out of Ray's wrapper), the group is dropped (actors killed, placement group removed),
and the next request starts a fresh one. ``keep_workers: false`` (or a one-off ``rollflow train-step``) makes a
group for one request.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, ClassVar

from schemas.errors import RollflowError, SchemaError
from schemas.train_config import TrainSection
from stages.ports import free_port
from stages.ray_errors import unplaced_hint
from stages.storage import Location

log = logging.getLogger("rollflow.train")

_POLL_S = 0.5
_KEPT_WORKER_MEMORY = 64 * 2**20
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
    """Why a request that has waited ``waited`` seconds since its group started should stop (None: keep waiting).
    ``states``: (state, pid, host, seconds in it) per rank whose process has started. Pure."""
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


@dataclass(frozen=True)
class Placed:
    """Where a worker's process runs: its node (Ray's id and address), the GPU ids Ray gave it, pid and host."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]
    pid: int
    host: str


def process_group_env(placed: list[Placed], master_port: int) -> list[dict[str, str]]:
    """The torch.distributed environment of each rank (in ``placed``'s order, rank 0 first): rank 0's node address
    and ``master_port``, RANK, WORLD_SIZE, NODE_RANK (nodes numbered in rank order), LOCAL_RANK and
    LOCAL_WORLD_SIZE; with GPUs, CUDA_VISIBLE_DEVICES is the sorted union of the GPU ids of the node's workers and
    LOCAL_RANK the place of the worker's own GPU in it (its CUDA device). Pure."""
    nodes = list(dict.fromkeys(p.node_id for p in placed))
    by_node: dict[str, list[int]] = defaultdict(list)
    for rank, p in enumerate(placed):
        by_node[p.node_id].append(rank)
    envs = []
    for rank, p in enumerate(placed):
        peers = by_node[p.node_id]
        env = {"MASTER_ADDR": placed[0].node_ip, "MASTER_PORT": str(master_port), "RANK": str(rank),
               "WORLD_SIZE": str(len(placed)), "NODE_RANK": str(nodes.index(p.node_id)),
               "LOCAL_WORLD_SIZE": str(len(peers)), "LOCAL_RANK": str(peers.index(rank))}
        if p.gpu_ids:
            visible = sorted({g for r in peers for g in placed[r].gpu_ids}, key=_gpu_order)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
            env["LOCAL_RANK"] = str(visible.index(p.gpu_ids[0]))
        envs.append(env)
    return envs


def _gpu_order(gpu_id: str) -> tuple[int, str]:
    return (int(gpu_id), "") if gpu_id.isdigit() else (1 << 30, gpu_id)


class TrainWorker:
    """One data-parallel rank, a Ray actor: joins the process group once (:meth:`join`), then runs each request
    sent to it (:meth:`run`) on the engines it keeps: a training step, or a forward request (``op: forward``,
    :mod:`stages.train.actor_forward`). ``keep``: the engines (and models loaded beside them) stay for the next
    request."""

    def __init__(self, keep: bool):
        self.keep, self.dist, self.held, self.models = keep, None, None, None

    def place(self) -> Placed:
        import ray

        ctx = ray.get_runtime_context()
        return Placed(ctx.get_node_id(), ray.util.get_node_ip_address(), tuple(str(g) for g in ray.get_gpu_ids()),
                      os.getpid(), socket.gethostname())

    def free_port(self) -> int:
        """A port free on every interface of this worker's node: rank 0's, where the other ranks meet it."""
        return free_port("")

    def join(self, env: dict[str, str], threads: int) -> None:
        """Set the process group's environment (:func:`process_group_env`) and join it: before anything in this
        process touches CUDA, so the visible devices take effect."""
        from stages.train.distributed import init_distributed

        os.environ.update(env)
        self.dist = init_distributed(threads)

    def run(self, request: dict[str, Any]) -> bool:
        """Run one request on this rank (a forward request waits for every rank's part to be written); whether the
        rank now holds DeepSpeed engines (its next training step starts from them, else builds them)."""
        import torch

        from stages.train.actor_forward import forward_on_rank
        from stages.train.core import train_and_save
        from stages.train.forward import ForwardModels
        from stages.train.train_table import read_train_table

        if self.models is None or not self.keep:
            self.models = ForwardModels()
        if request.get("op") == "forward":
            self.held = forward_on_rank(request, self.dist, self.held, self.models)
            torch.distributed.barrier()  # every rank's part is written before the request counts as done
        else:
            samples: Location = request["samples"]
            table = read_train_table(samples, request["columns"])
            if table is None or table.num_rows == 0:
                raise SchemaError(f"advantaged table at {samples.path} has no rows; nothing to train on")
            cfg = TrainSection.model_validate(request["section"])
            _, self.held = train_and_save(table, samples.uri(), request["checkpoint"], cfg, request["output"],
                                          self.dist, progress=request["progress"] if self.dist.rank == 0 else None,
                                          held=self.held, committed_as=request["committed_as"] if self.keep else None,
                                          full_state=request["full_state"], store=samples.fs)
        _return_cached_gpu_memory()  # a colocated engine wakes into it
        return self.held is not None


def _return_cached_gpu_memory() -> None:
    """Give the CUDA caching allocator's free blocks (activations of the step) back to the device, so an engine that
    shares the GPU can take them when it wakes; nothing on a CPU worker."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class TrainerGroup:
    """The run's training workers (:class:`TrainWorker` actors, DeepSpeed), started on the first :meth:`step` or
    :meth:`forward` and kept until :meth:`close` when ``keep``; else started and closed around each request. Besides
    training steps it serves the forward passes of the log-prob and values stages on the engines it holds (the
    actor group of issue 44, :mod:`stages.train.actor_forward`).

    ``runtime``: a :class:`schemas.train_config.TrainRuntimeConfig`. A kept group reserves no Ray CPUs: it computes
    only inside a training step, when the flow runs no other stage (the rule of an engine with
    ``num_cpus_per_engine: 0``), so the log-prob actors and Ray Data's tasks can use the CPUs between steps; its
    torch threads stay ``cpus_per_worker``."""

    worker_class: ClassVar[type] = TrainWorker  # what each rank runs (tests stand a stalling one in)

    def __init__(self, runtime, keep: bool = True, gpus_per_worker: float | None = None, section: dict | None = None):
        """``gpus_per_worker``: each worker's Ray GPU share when the run decides it (colocation with the engines,
        stages.plan.gpu_shares); default one GPU per worker with ``use_gpu``. ``section``: the training section the
        run trains under (a TrainSection's JSON dump): a forward request on a kept group builds the engines of its
        checkpoint under it when the group holds none, so the next training step finds them (one copy of the
        policy for both); None: a forward request uses held engines or loads models beside them."""
        self.runtime, self.keep = runtime, keep and runtime.keep_workers
        self.section = section
        self.gpus_per_worker = runtime.default_gpu_share() if gpus_per_worker is None else gpus_per_worker
        self._workers: list = []
        self._placement = None
        self._placed: list[Placed] = []
        self._holds = False
        self._states: dict[int, tuple[str, int, str, float]] = {}  # rank -> (state, pid, host, since)
        self._started = 0.0

    def step(self, request: dict[str, Any], unwrap) -> None:
        """Run one training step (``request``: samples Location, columns, checkpoint, output, committed_as,
        section, full_state, progress) on every rank and wait until all have written their part of the checkpoint.
        A failure of the group is raised as ``unwrap`` sees it (the user error inside Ray's wrappers) and the group
        is dropped."""
        self._call(request, BUILDING if not self._holds else TRAINING, unwrap)

    def forward(self, request: dict[str, Any], unwrap) -> None:
        """Run one forward request (:func:`stages.train.actor_forward.forward_on_rank`) on every rank and wait until
        each rank's part is written; failures as in :meth:`step`. The engines it builds (``request["section"]``) or
        uses stay held for the next training step."""
        self._call({**request, "op": "forward"}, FORWARD, unwrap)

    def _call(self, request: dict[str, Any], state: str, unwrap) -> None:
        try:
            if not self._workers:
                self._start()
            self._holds = all(self._wait([w.run.remote(request) for w in self._workers], state))
        except BaseException as err:
            self._drop()
            real = unwrap(err)
            if real is not err:
                raise real from None
            raise
        if not self.keep:
            self.close()

    def _start(self) -> None:
        """Place the group (one bundle per rank, PACK), start a worker in each bundle, and join the process group."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rt = self.runtime
        self._started, self._states, self._holds = time.monotonic(), {}, False
        bundle = self.worker_resources()
        self._placement = placement_group([bundle] * rt.num_workers, strategy="PACK")
        self._wait_placed(self._placement.ready())
        remote = ray.remote(max_restarts=0, **actor_options(bundle))(self.worker_class)
        self._workers = [remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement, i))
                         .remote(self.keep) for i in range(rt.num_workers)]
        places = [w.place.remote() for w in self._workers]
        self._wait_placed(*places)
        self._placed = ray.get(places)
        port = ray.get(self._workers[0].free_port.remote())
        envs = process_group_env(self._placed, port)
        self._wait([w.join.remote(env, rt.torch_threads()) for w, env in zip(self._workers, envs)], JOINING)
        log.info("training workers: %d (%s), kept across steps: %s", rt.num_workers,
                 "GPU" if rt.use_gpu else "CPU", self.keep)

    def _wait_placed(self, *refs) -> None:
        """Wait for ``refs`` (the placement group's readiness, then each worker's first answer), raising
        :class:`TrainingStalled` past ``runtime.placement_timeout_s``."""
        import ray

        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
            if pending:
                self._check_progress()

    def _wait(self, refs: list, state: str) -> list:
        """Wait for one call per rank (``refs`` in rank order), each rank in ``state`` until its call returns; their
        results in rank order. The first error is raised, a stall past its limit raises :class:`TrainingStalled`."""
        import ray

        now = time.monotonic()
        for rank, place in enumerate(self._placed):
            self._states[rank] = (state, place.pid, place.host, now)
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            for ref in done:
                ray.get(ref)  # the rank's error, if it failed
                _, pid, host, _ = self._states[rank_of[ref]]
                self._states[rank_of[ref]] = (IDLE, pid, host, time.monotonic())
            if pending and not done:
                self._check_progress()
        return ray.get(refs)

    def _check_progress(self) -> None:
        """Raise :class:`TrainingStalled` when a worker was not placed, or stalls, past its limit."""
        now = time.monotonic()
        states = {rank: (state, pid, host, now - since) for rank, (state, pid, host, since) in self._states.items()}
        problem = stall(states, self.runtime.num_workers, now - self._started, Limits.of(self.runtime))
        if problem is None:
            return
        if len(states) < self.runtime.num_workers:
            problem += ": " + unplaced_hint(self.worker_resources())
        raise TrainingStalled(problem)

    def worker_resources(self) -> dict[str, float]:
        """What each worker reserves in Ray (one placement-group bundle per worker). A kept worker reserves no CPU;
        Ray refuses a bundle of zeros, so it names a token of memory (no other task of a run reserves memory, so this
        blocks nothing). With ``use_gpu`` its GPU, or its share of a GPU colocated with the sleeping engines. And the
        custom resources that pin the workers to a node (``runtime.stage_resources``)."""
        rt = self.runtime
        resources: dict[str, float] = ({"CPU": 0, "memory": _KEPT_WORKER_MEMORY} if self.keep
                                       else {"CPU": rt.cpus_per_worker})
        if rt.use_gpu:
            resources["GPU"] = self.gpus_per_worker
        resources.update(rt.resources_for("train_step"))
        return resources

    def close(self) -> None:
        """Stop the workers (their processes end, and the engines with them) and free their placement group."""
        self._drop()

    def _drop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for worker in self._workers:
            try:
                ray.kill(worker)
            except Exception:  # noqa: BLE001 (already gone with its owner)
                pass
        if self._placement is not None:
            try:
                remove_placement_group(self._placement)
            except Exception:  # noqa: BLE001 (the cluster went away first)
                pass
        self._workers, self._placement, self._placed, self._states, self._holds = [], None, [], {}, False

    def __enter__(self) -> "TrainerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def actor_options(bundle: dict[str, float]) -> dict[str, Any]:
    """Ray actor options asking for exactly one placement-group bundle (``{"CPU", "GPU", "memory", custom...}``)."""
    named = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}
    options: dict[str, Any] = {named[k]: v for k, v in bundle.items() if k in named}
    custom = {k: v for k, v in bundle.items() if k not in named}
    return {**options, **({"resources": custom} if custom else {})}
