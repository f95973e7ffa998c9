"""Fixtures of the flow-infrastructure tests. Prefect's temporary home and logging set-up: ``tests/conftest.py``."""
