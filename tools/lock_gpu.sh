#!/usr/bin/env bash
# Re-lock the CUDA set: requirements-gpu.lock from pip's resolution of .[gpu,test] and GEM's runtime packages
# (tools/gpu_lock.py requirements) against the package index alone. `pip --isolated` reads no pip config file and no
# PIP_* variable, so no find-links folder of local CPU wheels (torch 2.13.0+cpu) stands in for the CUDA builds; a dry
# run downloads metadata only (a few minutes on a CPU machine).   tools/lock_gpu.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PY:-.venv/bin/python}}
report=$(mktemp)
trap 'rm -f "$report"' EXIT
# shellcheck disable=SC2046  # one requirement per line
# The current lock constrains the new resolution, so a re-lock after a change to pyproject.toml moves only what the
# change needs; LOCK_UPGRADE=1 resolves everything afresh from the index's newest releases.
constraints=()
if [ "${LOCK_UPGRADE:-0}" != 1 ] && [ -f requirements-gpu.lock ]; then constraints=(-c requirements-gpu.lock); fi
"$PY" -m pip install --isolated --dry-run --ignore-installed --quiet --report "$report" \
    "${constraints[@]}" $("$PY" tools/gpu_lock.py requirements)
"$PY" tools/gpu_lock.py write "$report"
