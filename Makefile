# Two entry points for a fresh machine: `make demo` (install, prepare Fashion-MNIST, train
# the main job: ResNet-8 on Fashion-MNIST with the paper's recipe, a few CPU minutes) and
# `make test` (install + lint + the test suite on 8 fake CPU devices).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pytest processes: one per core, at most 4 (each test's runs use 8 fake devices).
TEST_PROCESSES ?= $(shell n=$$(nproc); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: install data demo test lint wheels

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,tpu,gpu-compiler]'
	touch $@

data:
	bash scripts/install_fashion_mnist.sh

demo: install data
	$(BIN)/python -m largebatch_jax.data.prepare fashion_mnist
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python main.py \
	  --config=configs/fashion_mnist.py --workdir=workdirs/fashion_mnist

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The SLURM and MPI tests share one pytest process (--dist loadgroup: their xdist_group),
# and skip with one line where scripts/install_cluster_engines.sh has not run.
test: lint data
	REQUIRE_TPU_COMPILER=1 REQUIRE_GPU_COMPILER=1 $(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadgroup --durations=20

# Wheels the GPU check installs offline where the GPU host lacks them (scripts/gpu_check.sh).
wheels:
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: -d wheels ml_collections
