# The whole set-up story: `make demo` and `make test` (both install on first use).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.paraprop-installed

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/paraprop demo

test: install
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest

bench: install
	$(BIN)/paraprop bench core

clean:
	rm -rf $(VENV) build dist results src/*.egg-info .pytest_cache .ruff_cache
