# The README's two commands. Each does its own set-up (tools/bootstrap.sh) on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test setup clean

setup:
	@VENV=$(VENV) tools/bootstrap.sh

demo: setup
	$(PY) -m m2po_megatron.cli demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
