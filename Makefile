# The whole set-up story: `make demo` and `make test` (both install on first use).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.paraprop-installed

.PHONY: install demo test test-oldest test-gpu gpu-check gpu-wheels bench clean docs

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

# The suite on the oldest torch the library supports (pyproject.toml: torch>=2.11, the torch of
# the GPU machine `make gpu-check` runs on: docs/gpu.md), every other pin of constraints.txt, in
# a venv of its own. PyTorch's CPU build of 2.11.0 is not found here (its index is unreachable),
# so torch_step falls back to PyPI's default build: on Linux x86_64 the CUDA 13 build, which pins
# its own nvidia-*, cuda-* and triton 3.6 wheels (5.3 GB in .venv-oldest); the pins of those
# in constraints.txt belong to the newest torch and are dropped here. The suite runs on the CPU
# there, Triton's interpreter tests with the GPU machine's Triton; Triton 3.6's interpreter
# fails under NumPy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars"), so
# this venv takes the last NumPy before that. No torchvision in this venv (its tests and
# doctests skip, as the conftest says).
OLDEST_TORCH ?= 2.11.0
OLDEST_NUMPY ?= 2.3.5
OLDEST       := .venv-oldest

$(OLDEST)/.paraprop-installed: pyproject.toml constraints.txt
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --upgrade pip
	grep -v -E '^(torch|torchvision|triton|numpy|nvidia-[A-Za-z0-9_.-]+|cuda-[A-Za-z0-9_.-]+)==' \
	  constraints.txt > $(OLDEST)/constraints.txt
	printf 'torch==$(OLDEST_TORCH)\nnumpy==$(OLDEST_NUMPY)\n' >> $(OLDEST)/constraints.txt
	$(call torch_step,$(OLDEST),$(OLDEST_TORCH),,$(OLDEST)/constraints.txt)
	$(OLDEST)/bin/python -m pip install -c $(OLDEST)/constraints.txt -e '.[test]'
	$(OLDEST)/bin/python -c "import torch; v = torch.__version__; print('torch', v); \
	  assert v.split('+')[0] == '$(OLDEST_TORCH)', 'pip replaced the oldest torch'"
	touch $@

test-oldest: $(OLDEST)/.paraprop-installed
	$(OLDEST)/bin/python -m pytest -p no:cacheprovider

# The cuda half of the tests (the `device` fixture's cases marked gpu), where a GPU is. Without
# one they skip, and pytest reports the skips (exit 0); make test and CI are unchanged.
test-gpu: install
	$(BIN)/python -m pytest -p no:cacheprovider -m gpu -rs

# One prepared check for a GPU machine (docs/gpu.md): environment report, pytest -m gpu, the
# papers' headline rows (paraprop bench gpu) and their report, at most 7 files in $(GPU_OUT),
# under 8 minutes. It installs nothing from the network: the wheels and data of `make
# gpu-wheels`, carried in .gpu/, are installed with pip --no-index --no-deps, and paraprop runs
# from src/. On the GPU machine python3 is the one that has torch (no .venv there).
# DEVICE=cpu runs the same flow on the CPU at tiny sizes (a test runs it too).
DEVICE  ?= cuda
GPU_OUT ?= $(or $(OUT),results/gpu-check)
GPU_PY  ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) src/paraprop_lab/bench/gpu_check.py \
	  --device $(DEVICE) --out $(GPU_OUT)

# What the GPU machine lacks (no network there; Python 3.12): wheels of the packages below, at
# the versions constraints.txt pins, into .gpu/wheels, and the MNIST test files into .gpu/mnist.
# All are pure Python (a py3-none-any wheel fits any Python 3; the check below refuses any
# other): `pip wheel` takes the published wheel, or builds one from the sdist where PyPI has
# none (nflows 0.14). .gpu/ is ignored by git; the device run carries it.
GPU_DIR    ?= .gpu
GPU_WHEELS := diffusers zuko nflows normflows importlib_metadata lazy-importer
MNIST_DIR  ?= $(or $(PARAPROP_MNIST_DIR),../shared/data/mnist)
gpu-wheels:
	rm -rf $(GPU_DIR)/wheels && mkdir -p $(GPU_DIR)/wheels $(GPU_DIR)/mnist
	$(PYTHON) -m pip wheel --no-deps -w $(GPU_DIR)/wheels \
	  $(foreach p,$(GPU_WHEELS),$(p)==$(call pin,$(p)))
	@if ls $(GPU_DIR)/wheels/*.whl | grep -v -e '-none-any\.whl$$'; then \
	  echo "gpu-wheels: the wheels above are not pure Python" >&2; exit 1; fi
	cp -f $(MNIST_DIR)/t10k-*-ubyte* $(GPU_DIR)/mnist/
	ls -l $(GPU_DIR)/wheels $(GPU_DIR)/mnist

demo: install
	$(BIN)/paraprop demo

# ruff, the type checker on the library package (pyproject.toml [tool.mypy]), then the suite
test: install
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/python -m pytest

bench: install
	$(BIN)/paraprop bench core

# the documentation site (mkdocs.yml) into site/; any warning fails it
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(OLDEST) $(GPU_DIR) build dist results site src/*.egg-info .pytest_cache \
	  .ruff_cache .mypy_cache
