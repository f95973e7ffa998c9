"""Test modules that share a machine-wide resource and must not run at the same time on two pytest-xdist workers
(``make test`` runs ``-n 2 --dist loadgroup``; tests/conftest.py keeps every other module whole on one worker).
A module joins a group with ``pytestmark = GROUP`` (or a list holding it)."""

import pytest

# run the default model on every core (vLLM-CPU, DeepSpeed with 2 workers): two at once would only thrash
DEFAULT_MODEL = pytest.mark.xdist_group("default_model")
# run programs under the sandbox uids: tests/rewards/test_sandbox.py asserts that none of those is alive after a run
SANDBOX = pytest.mark.xdist_group("sandbox")
