"""Progress bars for long work that runs in Ray workers (generation, training micro-batches), on a terminal only.

The driver opens a bar with :func:`bar`, which yields a :class:`Ticker` — picklable: hand it to Ray tasks and actors —
or None when bars are off (the default, and whenever stderr is not a terminal, e.g. in CI and tests, where every
stage and turn prints its one line anyway). Workers call ``ticker.add(n)``, and ``ticker.total(n)`` when only they
know the amount of work. One small counter actor (no CPU) per Ray job collects the counts; a driver thread redraws
the bar twice a second. The bar is erased when the work ends: the stage's progress line follows.
"""

from __future__ import annotations

import itertools
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

_settings = {"bars": False, "ray_data": False}
_counters: dict[str, Any] = {}  # Ray job id -> counter actor
_keys = itertools.count(1)


def enable(bars: bool, ray_data: bool = False) -> None:
    """Show rollflow's progress bars (the CLI: when stderr is a terminal), and with ``ray_data`` Ray Data's own
    per-operator bars too (the CLI: with ``--verbose``)."""
    _settings["bars"], _settings["ray_data"] = bool(bars), bool(bars and ray_data)


def enabled() -> bool:
    return _settings["bars"]


def ray_data_bars() -> bool:
    return _settings["ray_data"]


class _Counter:
    """Counts of the open bar (``key``); counts of a closed bar that arrive late are dropped."""

    def __init__(self) -> None:
        self.key, self.done, self.total = 0, 0, None

    def reset(self, key: int, total: int | None) -> None:
        self.key, self.done, self.total = key, 0, total

    def add(self, key: int, n: int) -> None:
        if key == self.key:
            self.done += n

    def set_total(self, key: int, total: int) -> None:
        if key == self.key:
            self.total = total

    def read(self) -> tuple[int, int | None]:
        return self.done, self.total


@dataclass(frozen=True)
class Ticker:
    """What a worker reports progress with (fire-and-forget calls to the counter actor)."""

    counter: Any
    key: int

    def add(self, n: int = 1) -> None:
        self.counter.add.remote(self.key, int(n))

    def total(self, n: int) -> None:
        self.counter.set_total.remote(self.key, int(n))


def _counter():
    import ray

    job = ray.get_runtime_context().get_job_id()
    if job not in _counters:
        _counters.clear()
        _counters[job] = ray.remote(num_cpus=0, max_restarts=0)(_Counter).remote()
    return _counters[job]


@contextmanager
def bar(description: str, unit: str, total: int | None = None) -> Iterator[Ticker | None]:
    """A progress bar on stderr while the block runs; yields its :class:`Ticker`, or None when bars are off."""
    if not _settings["bars"]:
        yield None
        return
    import ray
    from tqdm import tqdm

    counter, key = _counter(), next(_keys)
    ray.get(counter.reset.remote(key, total))
    stop = threading.Event()
    with tqdm(desc=description, unit=f" {unit}", total=total, leave=False, file=sys.stderr, dynamic_ncols=True,
              bar_format="{desc}: {n_fmt}/{total_fmt}{unit} |{bar}| [{elapsed}]") as shown:
        def poll() -> None:
            while not stop.wait(0.5):
                try:
                    done, known = ray.get(counter.read.remote(), timeout=5)
                except Exception:  # a busy or stopping cluster: the next poll tries again
                    continue
                if known is not None and shown.total != known:
                    shown.total = known
                shown.n = done
                shown.refresh()

        thread = threading.Thread(target=poll, name="rollflow-progress", daemon=True)
        thread.start()
        try:
            yield Ticker(counter, key)
        finally:
            stop.set()
            thread.join()
