# The README's two commands. Each does its own set-up (tools/bootstrap.sh) on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test setup clean toy-table1

setup:
	@VENV=$(VENV) tools/bootstrap.sh

demo: setup
	$(PY) -m m2po_megatron.cli demo

# Table 1 at toy scale on this machine (docs/reproduce.md): 15 runs, 2 at a time, resumable; then the report.
toy-table1: setup
	@test -f .cache/tiny-task-toy/build_info.json || $(PY) tools/build_tiny_model.py .cache/tiny-task-toy --seed 0 --target-accuracy 0.4
	$(PY) -m m2po_megatron.cli sweep recipes/sweeps/toy-table1.yaml --local -j 2
	$(PY) -m m2po_megatron.cli report runs/toy-table1 --out runs/toy-table1/report

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
