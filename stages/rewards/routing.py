"""Route a batch to reward workers by a domain/tag column and reassemble the outputs in the original row order.

ROLL gives each domain its own reward cluster (``rewards: {math_rule: {worker_cls: ..., tag_included: [...]}}``);
here a config maps a domain value to a worker spec and its kwargs::

    routes = {"math": {"worker": "math_rule"},
              "code": {"worker": "code_sandbox", "kwargs": {"concurrency": 2}},
              "*":    {"worker": "my_pkg.rewards:length_reward"}}     # optional fallback for other domains

Each worker is built once; every call splits the batch by domain (order of first appearance), calls each worker on
its rows only, validates the outputs (length, finite or None) and scatters them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from schemas.errors import ConfigError, SchemaError
from stages.rewards.base import DOMAIN, RewardOutputs, RewardWorker, Rows, batch_size, check_outputs
from stages.rewards.registry import build_worker

FALLBACK_DOMAIN = "*"


@dataclass(frozen=True)
class RewardRoute:
    """One domain's worker: ``worker`` is a registered name or ``"module:name"``; ``kwargs`` go to its constructor
    (or to the function on every call)."""

    worker: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, domain: str, value: "RewardRoute | Mapping[str, Any] | str") -> "RewardRoute":
        if isinstance(value, RewardRoute):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping) and set(value) <= {"worker", "kwargs"} and "worker" in value:
            return cls(str(value["worker"]), dict(value.get("kwargs") or {}))
        raise ConfigError(f"reward route for domain '{domain}': expected a worker name or {{worker: ..., kwargs: "
                          f"{{...}}}}, got {value!r}")


class RewardRouter:
    """Scores batches whose rows belong to several domains. ``services`` (e.g. ``generate``) go to workers that
    declare them in ``requires``; ``context`` values (e.g. ``training_progress``) to workers that read them."""

    def __init__(self, routes: Mapping[str, RewardRoute | Mapping[str, Any] | str], domain_column: str = DOMAIN,
                 services: Mapping[str, Any] | None = None, context: Mapping[str, Any] | None = None) -> None:
        if not routes:
            raise ConfigError("reward routes are empty; map at least one domain to a worker, e.g. "
                              "{'math': {'worker': 'math_rule'}}")
        self.domain_column = domain_column
        self.routes = {str(d): RewardRoute.parse(str(d), r) for d, r in routes.items()}
        self.workers: dict[str, RewardWorker] = {
            domain: build_worker(route.worker, route.kwargs, services, context)
            for domain, route in self.routes.items()}

    def worker_for(self, domain: str) -> tuple[str, RewardWorker]:
        """The route key and worker that score ``domain`` (the fallback ``*`` when it has no route of its own)."""
        for key in (domain, FALLBACK_DOMAIN):
            if key in self.workers:
                return key, self.workers[key]
        raise ConfigError(f"reward routing: no worker for {self.domain_column} '{domain}'; routed domains: "
                          f"{', '.join(sorted(self.workers))}; add a route for it or a '{FALLBACK_DOMAIN}' fallback")

    def score(self, rows: Rows) -> RewardOutputs:
        """Score a batch: ``rows`` maps column → ``B`` values and must hold the domain column."""
        num_rows = batch_size(rows)
        if self.domain_column not in rows:
            raise SchemaError(f"reward batch has no '{self.domain_column}' column (columns: {sorted(rows)}); the "
                              "router sends each row to the worker of its domain")
        scores = np.full(num_rows, np.nan, np.float32)
        rewards = np.full(num_rows, np.nan, np.float32)
        worker_names = np.empty(num_rows, dtype=object)
        for domain, index in split_by_domain(rows[self.domain_column]).items():
            key, worker = self.worker_for(domain)
            spec = self.routes[key].worker
            missing = [c for c in getattr(worker, "columns", ()) if c not in rows]
            if missing:
                raise SchemaError(f"reward worker '{spec}' (domain '{domain}') needs columns {missing}; the batch "
                                  f"has {sorted(rows)}")
            sub_rows = {name: [values[i] for i in index] for name, values in rows.items()}
            sub_scores, sub_rewards = check_outputs(worker.score_batch(sub_rows), len(index), spec)
            scores[index] = sub_scores
            rewards[index] = sub_rewards
            worker_names[index] = spec
        return RewardOutputs(scores, rewards, worker_names)


def split_by_domain(domains: Any) -> dict[str, np.ndarray]:
    """Row indices per domain value, domains in order of first appearance, indices ascending. ``(B,)`` → dict."""
    groups: dict[str, list[int]] = {}
    for i, domain in enumerate(domains):
        groups.setdefault(str(domain), []).append(i)
    return {domain: np.asarray(index, dtype=np.int64) for domain, index in groups.items()}


def score_batch(rows: Rows, routes: Mapping[str, Any], domain_column: str = DOMAIN,
                services: Mapping[str, Any] | None = None) -> RewardOutputs:
    """One-shot convenience: build a :class:`RewardRouter` and score ``rows`` (stages keep the router instead)."""
    return RewardRouter(routes, domain_column, services).score(rows)
