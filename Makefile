# The whole set-up story: `make demo` and `make test` (both install on first use).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.paraprop-installed

.PHONY: install demo test test-oldest bench clean docs

# pyproject.toml states ranges; constraints.txt pins the tested releases, and installs use it.
# torch is installed first, as PyTorch's CPU build on a machine without an NVIDIA GPU:
#   TORCH=auto  (default) no NVIDIA GPU: the CPU build of the pinned torch and torchvision if pip
#               finds one (its configured sources, or TORCH_CPU_INDEX), else PyPI's default build
#   TORCH=cpu   the CPU build, or fail;   TORCH=pypi   PyPI's default build (CUDA on Linux x86_64)
TORCH           ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
NVIDIA          := $(shell test -e /proc/driver/nvidia/version || nvidia-smi -L >/dev/null 2>&1 \
                     && echo yes)
pin              = $(shell sed -n 's/^$(1)==//p' constraints.txt)

# $(call torch_step,VENV,TORCH_VERSION,OTHER_REQUIREMENTS,CONSTRAINTS): nothing if VENV has that
# torch already, or if PyPI's default build is wanted (the install that follows brings it)
define torch_step
@have=$$($(1)/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))' \
	  2>/dev/null); case "$$have" in $(2)|$(2)+*) exit 0;; esac; \
	case "$(TORCH)/$(NVIDIA)" in pypi/*|auto/yes) exit 0;; auto/|cpu/*) ;; \
	  *) echo "TORCH must be auto, cpu or pypi, not '$(TORCH)'" >&2; exit 2;; esac; \
	cpu="torch==$(2)+cpu $(foreach r,$(3),$(r)+cpu)"; pip="$(1)/bin/python -m pip install -c $(4)"; \
	echo "== torch: looking for PyTorch's CPU build: $$cpu"; \
	if $$pip $$cpu; then exit 0; fi; \
	if [ -n "$(TORCH_CPU_INDEX)" ] && echo "== torch: and in $(TORCH_CPU_INDEX)" && \
	  $$pip --retries 1 --extra-index-url "$(TORCH_CPU_INDEX)" $$cpu; then exit 0; fi; \
	if [ "$(TORCH)" = cpu ]; then echo "TORCH=cpu: no CPU build of $$cpu" >&2; exit 1; fi; \
	echo "== torch: no CPU build of $$cpu found; PyPI's default build instead" \
	  "(on Linux x86_64 that is a CUDA build: about 5.5 GB in $(1))"
endef

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(call torch_step,$(VENV),$(call pin,torch),torchvision==$(call pin,torchvision),constraints.txt)
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The suite on the oldest torch the library supports (pyproject.toml: torch>=2.13), every other
# pin of constraints.txt, in a venv of its own. No torchvision there (no build of it imports
# beside torch 2.13.0+cpu on this machine), so the tests that need it skip.
OLDEST_TORCH ?= 2.13.0
OLDEST       := .venv-oldest

$(OLDEST)/.paraprop-installed: pyproject.toml constraints.txt
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --upgrade pip
	grep -v -E '^(torch|torchvision)==' constraints.txt > $(OLDEST)/constraints.txt
	echo 'torch==$(OLDEST_TORCH)' >> $(OLDEST)/constraints.txt
	$(call torch_step,$(OLDEST),$(OLDEST_TORCH),,$(OLDEST)/constraints.txt)
	$(OLDEST)/bin/python -m pip install -c $(OLDEST)/constraints.txt -e '.[test]'
	$(OLDEST)/bin/python -c "import torch; v = torch.__version__; print('torch', v); \
	  assert v.split('+')[0] == '$(OLDEST_TORCH)', 'pip replaced the oldest torch'"
	touch $@

test-oldest: $(OLDEST)/.paraprop-installed
	$(OLDEST)/bin/python -m pytest -p no:cacheprovider

demo: install
	$(BIN)/paraprop demo

test: install
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest

bench: install
	$(BIN)/paraprop bench core

# the documentation site (mkdocs.yml) into site/; any warning fails it
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(OLDEST) build dist results site src/*.egg-info .pytest_cache .ruff_cache
