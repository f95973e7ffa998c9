"""The training workers of a run two ways, on the same steps (issue 44: whether Ray Train stays): (a) today's
:class:`stages.train.group.TrainerGroup` (a Ray Train ``TorchTrainer`` whose workers wait on a mailbox), driven the
way a training flow drives it (``run_train_step(..., trainer=group)``, one group kept across the steps), against
(b) :class:`ActorGroup`: N plain Ray actors in a placement group of the same bundles, each joining the process group
with the project's own :func:`stages.train.distributed.init_distributed` (MASTER_ADDR/PORT from rank 0, gloo on
CPU) and running the same :func:`stages.train.core.train_and_save` on the engines it keeps. Both go through the same
train-step stage (fingerprint, temporary folder, manifest), on the tiny random model; only the group differs.

Each measurement is a child process of its own with a fresh local Ray cluster (started, and left to settle, before
the clock starts, as a run starts Ray before its first step). In the child, from "start group" to the group closed,
the process and all its descendants (the driver, Ray's daemons, every worker) are read from /proc every 0.2 s
(benchmarks/cpu_per_test.py's ``tree_cpu`` / ``used_between``): their CPU-seconds, the peak of their summed RSS, and
the processes that started meanwhile (distinct pid and start time), named by kind as
benchmarks/iteration_overhead.py names them. Other processes on the machine are not counted. The ways alternate,
the order turned each round, for 1 and 2 workers.

    python benchmarks/worker_group.py --rounds 2 --steps 3

Prints one line per measurement, the medians per way and worker count, the processes by kind, and last
``RESULT raytrain_start_s=.. actors_start_s=.. raytrain_step_s=.. actors_step_s=.. raytrain_processes=..
actors_processes=.. raytrain_cpu_s=.. actors_cpu_s=..`` for 1 worker (the CPU configs' ``num_workers``), then the
same figures for 2 workers with the suffix ``_2w`` and the peak RSS (``_rss_gib``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from _common import make_table, model_folder, set_up_process
from cpu_per_test import tree_cpu, used_between
from iteration_overhead import process_kind
from schemas.config import validate_config
from schemas.train_config import TrainSection, TrainStepConfig
from stages.cluster import ensure_ray
from stages.train.core import train_and_save
from stages.train.distributed import _free_port, init_distributed
from stages.train.group import TrainerGroup
from stages.train.stage import run_train_step
from stages.train.train_table import read_train_table
from stages.watchdog import ProcessTable, cmdline
from train import add_old_log_probs

WAYS = ("raytrain", "actors")
MARK = "MEASURED "
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---- (b) plain Ray actors --------------------------------------------------------------------------------------

class PlainWorker:
    """One rank as a plain Ray actor: joins the process group, then runs each training step on the engines it keeps
    (what a Ray Train worker's loop in stages/train/group.py does with a step request, without the mailbox)."""

    def address(self) -> tuple[str, int]:
        """The node's address and a free port: rank 0's, where the others meet it."""
        return ray.util.get_node_ip_address(), _free_port()

    def join(self, rank: int, world: int, addr: str, port: int, threads: int) -> None:
        os.environ.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank),
                           "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})  # one node: local rank = rank
        self.dist, self.held = init_distributed(threads), None

    def step(self, request: dict) -> None:
        samples = request["samples"]
        table = read_train_table(samples, request["columns"])
        _, self.held = train_and_save(table, samples.uri(), request["checkpoint"],
                                      TrainSection.model_validate(request["section"]), request["output"], self.dist,
                                      progress=request["progress"] if self.dist.rank == 0 else None, held=self.held,
                                      committed_as=request["committed_as"], full_state=request["full_state"],
                                      store=samples.fs)


def actor_options(bundle: dict[str, float]) -> dict:
    """Ray actor options asking for exactly one placement-group bundle (``{"CPU", "GPU", "memory", custom...}``)."""
    named = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}
    options = {named[k]: v for k, v in bundle.items() if k in named}
    custom = {k: v for k, v in bundle.items() if k not in named}
    return {**options, **({"resources": custom} if custom else {})}


class ActorGroup:
    """``runtime.num_workers`` :class:`PlainWorker` actors in a placement group of the bundles a kept
    :class:`TrainerGroup` asks for (PACK, Ray Train's default), started on the first step and kept until
    :meth:`close`; :meth:`step` is TrainerGroup's, so ``run_train_step(..., trainer=group)`` drives either."""

    def __init__(self, runtime):
        self.runtime, self.workers, self.group = runtime, None, None

    def _start(self) -> None:
        n, bundle = self.runtime.num_workers, TrainerGroup(self.runtime).worker_resources()
        self.group = placement_group([bundle] * n, strategy="PACK")
        ray.get(self.group.ready())
        cls = ray.remote(PlainWorker)
        self.workers = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, i),
                                    **actor_options(bundle)).remote() for i in range(n)]
        addr, port = ray.get(self.workers[0].address.remote())
        ray.get([w.join.remote(i, n, addr, port, self.runtime.torch_threads()) for i, w in enumerate(self.workers)])

    def step(self, request: dict, unwrap) -> None:
        """One training step on every rank; a failure closes the group and is raised as ``unwrap`` sees it."""
        if self.workers is None:
            self._start()
        try:
            ray.get([w.step.remote(request) for w in self.workers])
        except BaseException as err:
            self.close()
            raise unwrap(err) from err

    def close(self) -> None:
        for worker in self.workers or []:
            ray.kill(worker)
        if self.group is not None:
            remove_placement_group(self.group)
        self.workers, self.group = None, None


# ---- the measurement of one way, in a child process ------------------------------------------------------------

def updated_kind(seen: str | None, command: str, name: str = "") -> str:
    """The kind of a process seen again with ``command`` (iteration_overhead's naming): a Ray worker starts as
    ``setup_worker.py``/``default_worker.py`` and idles as ``ray::IDLE``, so it keeps the first ``ray::`` title other
    than ``ray::IDLE`` it shows; any other kind is named afresh."""
    if seen is not None and seen.startswith("ray::") and seen != "ray::IDLE":
        return seen
    return process_kind(command.split(), name)


class TreeMeter:
    """This process and its descendants between :meth:`start` and :meth:`stop`, read every ``interval`` s: CPU
    seconds used, the peak of the summed RSS (bytes) and the kind of each process that started meanwhile."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.cpu_s, self.peak_rss = interval, 0.0, 0
        self.kinds: dict[tuple[int, str], str] = {}
        self._table, self._stop = ProcessTable(), threading.Event()

    def start(self) -> None:
        self._last = tree_cpu(os.getpid(), self._table)
        self._before = set(self._last)
        self._thread = threading.Thread(target=self._run, daemon=True, name="tree-meter")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._read()

    def _read(self) -> None:
        now = tree_cpu(os.getpid(), self._table)
        self.cpu_s += used_between(self._last, now)
        self._last = now
        self.peak_rss = max(self.peak_rss, sum(_rss(pid) for pid, _ in now))
        for key in now.keys() - self._before:
            self.kinds[key] = updated_kind(self.kinds.get(key), cmdline(key[0]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._read()


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def step_config(workers: int, threads: int) -> TrainStepConfig:
    """One optimizer step over every row per training step, ``threads`` torch threads in all."""
    return validate_config(TrainStepConfig, {
        "adv_estimator": "grpo", "compute_entropy_metric": False,
        "actor_train": {"training_args": {"learning_rate": 1e-5, "per_device_train_batch_size": 64}},
        "runtime": {"num_workers": workers, "cpus_per_worker": 1, "threads": max(1, threads // workers),
                    "num_cpus": max(2, threads)}})


def measure(way: str, workers: int, samples: str, model_dir: str, steps: int, threads: int, work: Path) -> dict:
    """Start the group, run ``steps`` chained training steps (each from the previous checkpoint, as a run's
    iterations), close it; seconds to the first step done, each later step, the close, and the meter's figures."""
    cfg = step_config(workers, threads)
    ensure_ray(None, cfg.runtime.num_cpus, progress=False)
    time.sleep(5.0)  # the cluster's start-up (its prestarted workers) settles before the clock starts
    meter = TreeMeter()
    meter.start()
    start = time.perf_counter()
    group = TrainerGroup(cfg.runtime, storage=str(work)) if way == "raytrain" else ActorGroup(cfg.runtime)
    marks, checkpoint = [], model_dir
    for k in range(steps):
        output = str(work / f"step_{k}")
        run_train_step(samples, checkpoint, cfg, output, trainer=group, full_state=cfg.full_state_at(k, steps))
        marks.append(time.perf_counter())
        checkpoint = output
    group.close()
    closed = time.perf_counter()
    meter.stop()
    ray.shutdown()
    later = [b - a for a, b in zip(marks, marks[1:])]
    return {"way": way, "workers": workers, "start_s": marks[0] - start, "step_s": statistics.mean(later),
            "close_s": closed - marks[-1], "cpu_s": meter.cpu_s, "rss_gib": meter.peak_rss / 2**30,
            "processes": len(meter.kinds), "kinds": dict(Counter(meter.kinds.values()))}


# ---- the driver: alternate the ways ----------------------------------------------------------------------------

def run_child(way: str, workers: int, samples: Path, model: str, steps: int, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--one", way, "--workers", str(workers), "--samples", str(samples),
           "--model", model, "--steps", str(steps), "--threads", str(threads)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        sys.exit(f"error: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])


def medians(runs: list[dict]) -> dict[tuple[str, int], dict[str, float]]:
    """Per (way, workers): the median of each figure over the rounds, and the processes by kind (the largest count
    of each kind seen in one round)."""
    out: dict[tuple[str, int], dict] = {}
    for key in sorted({(r["way"], r["workers"]) for r in runs}):
        mine = [r for r in runs if (r["way"], r["workers"]) == key]
        out[key] = {f: statistics.median(r[f] for r in mine)
                    for f in ("start_s", "step_s", "close_s", "cpu_s", "rss_gib", "processes")}
        out[key]["kinds"] = {k: max(r["kinds"].get(k, 0) for r in mine) for r in mine for k in r["kinds"]}
    return out


def result_line(figures: dict[tuple[str, int], dict[str, float]]) -> str:
    """``RESULT`` with the 1-worker figures under the issue's names, then the 2-worker ones suffixed ``_2w``."""
    parts = []
    for workers, suffix in ((1, ""), (2, "_2w")):
        for name, fmt in (("start_s", ".1f"), ("step_s", ".2f"), ("processes", "g"), ("cpu_s", ".0f"),
                          ("rss_gib", ".2f")):
            for way in WAYS:
                if (way, workers) in figures:
                    parts.append(f"{way}_{name}{suffix}={figures[way, workers][name]:{fmt}}")
    return "RESULT " + " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="training steps per group (>= 2)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of all workers together")
    parser.add_argument("--model", default="tiny", help="tiny (random weights), default (SmolLM2-135M) or a folder")
    parser.add_argument("--one", choices=WAYS, help="(internal) measure one way in this process")
    parser.add_argument("--samples", help="(internal, with --one) the advantaged table's folder")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step pays the start, the later ones are the step time")
    set_up_process()
    model_dir = model_folder(args.model)
    if args.one:
        with tempfile.TemporaryDirectory(prefix="rollflow-bench-group-") as work:
            figures = measure(args.one, args.workers[0], args.samples, model_dir, args.steps, args.threads,
                              Path(work))
        print(MARK + json.dumps(figures), flush=True)
        return
    runs = []
    with tempfile.TemporaryDirectory(prefix="rollflow-bench-group-") as work:
        table = add_old_log_probs(make_table(args.rows, (48, 96), seed=0), model_dir, args.threads)
        (Path(work) / "adv").mkdir()
        pq.write_table(table, Path(work) / "adv" / "part-00000.parquet")
        for r in range(args.rounds):
            for workers in args.workers:
                for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                    runs.append(run_child(way, workers, Path(work) / "adv", args.model, args.steps, args.threads))
                    m = runs[-1]
                    print(f"round {r} {way:<8} workers={workers} start_s={m['start_s']:.1f} step_s={m['step_s']:.2f} "
                          f"close_s={m['close_s']:.1f} cpu_s={m['cpu_s']:.1f} rss_gib={m['rss_gib']:.2f} "
                          f"processes={m['processes']}", flush=True)
    figures = medians(runs)
    print(f"model {args.model}, {args.rows} rows x 48-96 tokens, {args.steps} steps per group, {args.threads} "
          f"threads in all; medians of {args.rounds} rounds")
    print(f"{'way':<9}{'workers':>8}{'start s':>9}{'step s':>8}{'close s':>9}{'CPU s':>8}{'RSS GiB':>9}{'procs':>7}")
    for (way, workers), f in figures.items():
        print(f"{way:<9}{workers:>8}{f['start_s']:>9.1f}{f['step_s']:>8.2f}{f['close_s']:>9.1f}{f['cpu_s']:>8.1f}"
              f"{f['rss_gib']:>9.2f}{f['processes']:>7.0f}")
    for (way, workers), f in figures.items():
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(f["kinds"].items()))
        print(f"processes of {way}, {workers} worker(s): {kinds}")
    print(result_line(figures))


if __name__ == "__main__":
    main()
