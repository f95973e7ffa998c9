"""flows/services.py: which Prefect server a command's flows report to, as Prefect's own settings say."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from prefect.settings import PREFECT_API_URL, temporary_settings

import stages.cluster
from flows import services


def test_a_server_given_by_prefects_settings_is_used_and_named(monkeypatch, caplog):
    """A server set in Prefect's settings (a profile, a settings context), not in the environment: no ephemeral
    server is started for the flows, and the 'services up' line names that server (it said None)."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(stages.cluster, "connect_runtime", lambda runtime: None)  # Ray is not what is checked here
    url = "http://127.0.0.1:9/api"
    with temporary_settings(updates={PREFECT_API_URL: url}), caplog.at_level(logging.INFO, logger="rollflow"):
        assert not services._ephemeral_prefect()
        services.start_services(SimpleNamespace(ray_address=None))
    assert f"services up: Prefect {url}, Ray " in caplog.text, caplog.text
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert services._api_url() is None and services._ephemeral_prefect()
