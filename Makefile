# Two entry points for a fresh machine: `make demo` (the package's install, prepare
# Fashion-MNIST, train the main job: ResNet-8 on Fashion-MNIST with the paper's recipe, a
# few CPU minutes) and `make test` (the tests' install on top, lint, the test suite on 8
# fake CPU devices).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pytest processes: one per core, at most 4 (each test's runs use 8 fake devices).
TEST_PROCESSES ?= $(shell n=$$(nproc); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: install install-test data demo test lint wheels

# Two installs into one venv, each pinned to the versions CI tested (constraints.txt):
# the demo's (the package alone: what `make demo` and a user's run need), then the tests'
# on top (pytest, ruff, the notebook kernel, mpi4py, and the TPU and GPU compilers the
# compile tests use: libtpu and JAX's CUDA plugin, Linux wheels of ~1.3 GB).
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e .
	touch $@

install-test: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,tpu,gpu-compiler]'
	touch $@

data:
	bash scripts/install_fashion_mnist.sh

demo: install data
	$(BIN)/python -m largebatch_jax.data.prepare fashion_mnist
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python main.py \
	  --config=configs/fashion_mnist.py --workdir=workdirs/fashion_mnist

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The SLURM and MPI tests share one pytest process (--dist loadgroup: their xdist_group),
# and skip with one line where scripts/install_cluster_engines.sh has not run.
test: lint data
	REQUIRE_TPU_COMPILER=1 REQUIRE_GPU_COMPILER=1 $(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadgroup --durations=20

# Wheels the GPU check installs offline where the GPU host lacks them (scripts/gpu_check.sh).
wheels:
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: -d wheels ml_collections
