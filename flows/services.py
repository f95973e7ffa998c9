"""Start the two services a command's flow needs side by side: Prefect's ephemeral API server (a subprocess; about
10-15 s on two cores, its database migrating on a new PREFECT_HOME) and the local Ray cluster (about 5 s). The flow
would start them one after the other; started here, the flow finds both running. A flow started any other way (a
deployment, a test calling it) starts them itself, so this is only a head start; but only a server started here is
deaf to a terminal's Ctrl-C (below), so every command that runs a flow starts its services here."""

from __future__ import annotations

import logging
import os
import signal
import threading

from stages import cluster

log = logging.getLogger("rollflow")


def _api_url() -> str | None:
    """The Prefect server this process's flows report to: Prefect's own setting (the environment, a profile, or a
    settings context such as the test workers' shared server), None for none."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def _ephemeral_prefect() -> bool:
    """Whether this process's flows will start Prefect's ephemeral server (no PREFECT_API_URL, ephemeral allowed)."""
    from prefect.settings import PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    return _api_url() is None and bool(PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value())


class _PrefectStart(threading.Thread):
    """Prefect's own ephemeral server object, started on a thread; the flow's client later gets the same (running)
    instance, as Prefect keeps one per process."""

    def __init__(self):
        super().__init__(name="prefect-ephemeral-start", daemon=True)
        self.error: BaseException | None = None

    def run(self) -> None:
        # the server is started with SIGINT blocked, which it inherits (a blocked signal stays blocked across exec,
        # and uvicorn installs handlers without unblocking it): a terminal's Ctrl-C, sent to the whole process group,
        # reaches the command only, which marks its flow run and then stops the server (flows/interrupt.py). Blocked
        # on this thread only; Python runs signal handlers on the main thread anyway.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            from prefect.server.api.server import SubprocessASGIServer

            SubprocessASGIServer().start()
        except BaseException as err:  # re-raised on the command's thread by start_services
            self.error = err


def start_services(runtime) -> None:
    """Start Prefect's ephemeral server (when the flows will use one) on a thread while Ray starts on this one, as
    the config's ``runtime`` section says (address, CPUs, Ray Data's memory bound: ``connect_runtime``); return once
    both are up. A failure of either is raised here, as the flow would have raised it."""
    prefect = _PrefectStart() if _ephemeral_prefect() else None
    if prefect is not None:
        prefect.start()
    try:
        cluster.connect_runtime(runtime)
    finally:
        if prefect is not None:
            prefect.join()
    if prefect is not None and prefect.error is not None:
        raise prefect.error
    log.info("services up: Prefect %s, Ray %s", "ephemeral" if prefect else _api_url(),
             runtime.ray_address or os.environ.get("RAY_ADDRESS") or "local")
