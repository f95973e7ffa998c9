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
"$PY" -m pip install --isolated --dry-run --ignore-installed --quiet --report "$report" \
    $("$PY" tools/gpu_lock.py requirements)
"$PY" tools/gpu_lock.py write "$report"
