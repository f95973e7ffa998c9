"""The training workers of a run two ways, on the same steps (issue 44: whether Ray Train stays): (a)
:class:`RayTrainGroup`, a Ray Train ``TorchTrainer`` whose workers wait on an inbox actor between steps (how
rollflow ran its workers until issue 44), against (b) :class:`stages.train.group.TrainerGroup`, today's: plain Ray
actors in a placement group of the same bundles, joining the process group the group sets up. Both run each step
with the same :meth:`stages.train.group.TrainWorker.run` on the engines they keep, driven the way a training flow
drives them (``run_train_step(..., trainer=group)``, one group kept across the steps), through the same train-step
stage (fingerprint, temporary folder, manifest), on the tiny random model; only the group differs.

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
import queue
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

from _common import make_table, model_folder, set_up_process
from cpu_per_test import tree_cpu, used_between
from iteration_overhead import process_kind
from schemas.config import validate_config
from schemas.train_config import TrainStepConfig
from stages.cluster import ensure_ray
from stages.train.distributed import init_distributed
from stages.train.group import TrainerGroup, TrainWorker
from stages.train.stage import run_train_step
from stages.watchdog import ProcessTable, cmdline
from train import add_old_log_probs

WAYS = ("raytrain", "actors")
MARK = "MEASURED "
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---- (a) Ray Train, the way rollflow ran its training workers until issue 44 -----------------------------------

class _Inbox:
    """The step requests of a Ray Train group (one queue per rank) and rank 0's replies, in one threaded Ray actor."""

    def __init__(self, ranks: int):
        self.inboxes, self.replies = [queue.Queue() for _ in range(ranks)], queue.Queue()

    def send(self, request: dict | None) -> None:
        for inbox in self.inboxes:
            inbox.put(request)

    def receive(self, rank: int) -> dict | None:
        return self.inboxes[rank].get()

    def reply(self) -> None:
        self.replies.put("done")

    def answer(self) -> str:
        return self.replies.get()


def _serve(config: dict) -> None:
    """One Ray Train worker: joins the process group Ray Train made, then runs each request with the product's
    :meth:`TrainWorker.run` (the same step on the same kept engines) until a ``None`` request."""
    import ray.train

    inbox, rank = config["inbox"], ray.train.get_context().get_world_rank()
    worker = TrainWorker(keep=True)
    worker.dist = init_distributed(config["threads"])
    while (request := ray.get(inbox.receive.remote(rank))) is not None:
        worker.run(request)
        if rank == 0:
            ray.get(inbox.reply.remote())


class RayTrainGroup:
    """``runtime.num_workers`` Ray Train workers (a ``TorchTrainer`` whose fit runs in a thread, the preemption
    watcher off, ``max_failures=0``) on the bundles :class:`TrainerGroup` asks for, started on the first step and
    kept until :meth:`close`; :meth:`step` is TrainerGroup's, so ``run_train_step(..., trainer=group)`` drives
    either."""

    def __init__(self, runtime, storage: Path):
        self.runtime, self.storage, self.fit, self.failure, self.inbox = runtime, storage, None, None, None

    def _start(self) -> None:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        n = self.runtime.num_workers
        self.inbox = ray.remote(num_cpus=0, max_concurrency=n + 3)(_Inbox).remote(n)
        trainer = TorchTrainer(
            _serve, train_loop_config={"inbox": self.inbox, "threads": self.runtime.torch_threads()},
            scaling_config=ScalingConfig(num_workers=n, resources_per_worker=TrainerGroup(self.runtime)
                                         .worker_resources()),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(name="bench", storage_path=str(self.storage),
                                 failure_config=FailureConfig(max_failures=0)))
        self.fit = threading.Thread(target=self._run, args=(trainer,), daemon=True)
        self.fit.start()

    def _run(self, trainer) -> None:
        try:
            trainer.fit()
        except BaseException as err:  # noqa: BLE001 (handed to step)
            self.failure = err

    def step(self, request: dict, unwrap) -> None:
        """One training step on every rank; a failure of the group is raised as ``unwrap`` sees it."""
        if self.fit is None:
            self._start()
        ray.get(self.inbox.send.remote(request))
        answer = self.inbox.answer.remote()
        while not ray.wait([answer], timeout=0.5)[0]:
            if not self.fit.is_alive():
                raise unwrap(self.failure or RuntimeError("the Ray Train workers stopped"))

    def close(self) -> None:
        if self.fit is not None:
            ray.get(self.inbox.send.remote(None))
            self.fit.join(timeout=60)
            ray.kill(self.inbox)
        self.fit = None


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
    group = RayTrainGroup(cfg.runtime, work) if way == "raytrain" else TrainerGroup(cfg.runtime)
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
