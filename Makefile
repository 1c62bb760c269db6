# slurmrl developer entry points. Every target installs what it needs into .venv first.
#   make run  [ARGS="orchestrator.max_off_policy_steps=0 trainer.lr=3e-4"]
#   make test [PYTEST_ARGS="-k engine"]
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_PIN := torch==2.13.0

.PHONY: install run test test-fast bench lint clean-runs

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/slurmrl experiment=tiny_local $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slurm and not slow" $(PYTEST_ARGS)

bench: install
	$(PY) -m benchmarks $(ARGS)

clean-runs:
	rm -rf runs
