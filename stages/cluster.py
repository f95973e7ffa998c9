"""Process-wide execution settings, set in one place at flow start and logged (DESIGN.md "Code").

``ensure_ray`` joins the cluster named by the config or ``$RAY_ADDRESS`` (an existing Ray cluster: the code runs
there unchanged) or starts a local one. Ray Data keeps row order so stage outputs are deterministic.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("rollflow.cluster")


def configure_threads() -> None:
    """One intra-op thread per process next to Ray workers (STACK.md: oversubscription slows torch 6-10x)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def ensure_ray(address: str | None = None, num_cpus: int | None = None, progress: bool = True,
               data_memory_mb: float | None = None) -> dict:
    """Connect to (or start) Ray and set the Ray Data context. Returns the settings used, for logging.
    ``data_memory_mb``: bound on the blocks Ray Data keeps in flight in the object store (None: Ray's default, which
    grows with the object store)."""
    import ray
    import ray.data

    configure_threads()
    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    if data_memory_mb:
        from ray.data._internal.execution.interfaces import ExecutionResources

        ctx.execution_options.resource_limits = ExecutionResources(object_store_memory=float(data_memory_mb) * 2**20)
    ctx.enable_progress_bars = progress
    ctx.print_on_execution_start = False
    settings = {"ray_address": address or "local", "cpus": ray.cluster_resources().get("CPU"),
                "preserve_order": True, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    log.info("execution settings: %s", settings)
    return settings
