# The README's commands. Each does its own set-up (tools/bootstrap.sh, tools/sglang_env.sh) on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo demo-moe demo-agent test test-sglang setup clean toy-table1 toy-table1-fair toy-calibration

setup:
	@VENV=$(VENV) tools/bootstrap.sh

demo: setup
	$(PY) -m m2po_megatron.cli demo

# The embedded default for mixture-of-experts (recipes/tiny-moe-cpu.yaml, docs/moe.md): the same task with a tiny
# Qwen3-MoE built once under .cache/tiny-task-moe, two ranks with expert parallel 2, R3 routing replay. Resumable:
# a second call continues an interrupted run or, finished, only reports it.
demo-moe: setup
	@test -f .cache/tiny-task-moe/build_info.json || $(PY) tools/build_tiny_model.py .cache/tiny-task-moe --seed 0 \
		--target-accuracy 0.4 --moe
	$(PY) -m m2po_megatron.cli train recipes/tiny-moe-cpu.yaml --resume auto
	$(PY) -m m2po_megatron.cli plot runs/tiny-moe-cpu --out runs/tiny-moe-cpu/plot.png

# The embedded default for tool-using agents (recipes/tiny-agent-cpu.yaml, docs/demo.md): a tiny model that may call
# a calculator (multi-turn episodes of m2po_megatron/examples/calculator.py), task built once under
# .cache/tiny-agent-task; prints held-out success before and after. Resumable like demo-moe.
demo-agent: setup
	@test -f .cache/tiny-agent-task/build_info.json || $(PY) tools/build_tiny_model.py .cache/tiny-agent-task --seed 0 \
		--agent
	$(PY) -m m2po_megatron.cli train recipes/tiny-agent-cpu.yaml --resume auto
	$(PY) -m m2po_megatron.cli plot runs/tiny-agent-cpu --out runs/tiny-agent-cpu/plot.png
	$(PY) tools/demo_agent_report.py runs/tiny-agent-cpu

# Table 1 at toy scale on this machine (docs/reproduce.md): 15 runs, 2 at a time, resumable; then the report.
toy-table1: setup
	@test -f .cache/tiny-task-toy/build_info.json || $(PY) tools/build_tiny_model.py .cache/tiny-task-toy --seed 0 --target-accuracy 0.4
	$(PY) -m m2po_megatron.cli sweep recipes/sweeps/toy-table1.yaml --local -j 2
	$(PY) -m m2po_megatron.cli report runs/toy-table1 --out runs/toy-table1/report

# The same under the paper's ratios (docs/results/toy-table1.md, "The fair protocol"): 31 runs, 2 at a time, resumable.
toy-table1-fair: setup
	@test -f .cache/tiny-task-fair/build_info.json || $(PY) tools/build_tiny_model.py .cache/tiny-task-fair --seed 0 \
		--target-accuracy 0.35 --check-every 10 --n-eval 256 --n-train 256 --disjoint-train --uniform-splits
	$(PY) -m m2po_megatron.cli sweep recipes/sweeps/toy-table1-fair.yaml --local -j 2
	$(PY) -m m2po_megatron.cli report runs/toy-table1-fair --out runs/toy-table1-fair/report

# The pre-registered calibration of issue 34 (docs/reproduce.md): 30 runs of 100 steps, the fallback axis's 20
# (no cell of the first grid matched), then the criteria.
toy-calibration: setup
	@test -f .cache/tiny-task-fair/build_info.json || $(PY) tools/build_tiny_model.py .cache/tiny-task-fair --seed 0 \
		--target-accuracy 0.35 --check-every 10 --n-eval 256 --n-train 256 --disjoint-train --uniform-splits
	$(PY) -m m2po_megatron.cli sweep recipes/sweeps/toy-calibration.yaml --local -j 2
	$(PY) -m m2po_megatron.cli sweep recipes/sweeps/toy-calibration-low-lr.yaml --local -j 2  # the fallback axis
	$(PY) -m m2po_megatron.cli report results/toy-calibration results/toy-calibration-low-lr --calibration \
		--out results/calibration-report

# Two pytest workers: most of the suite waits on subprocesses (Ray, torchrun, Slurm, servers), so a second
# worker fills the idle core (CI's 2-core machine ran ~70 % of one core busy with one worker). --dist loadfile
# keeps a file's tests on one worker: its module fixtures (a trained run, a server) are built once, and the local
# Slurm cluster, one per machine, is only started by tests/slurm/test_slurm_job.py. TEST_WORKERS=0 for one.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The contract suite: tests/contract/ in a second environment with the real sglang==0.5.23 and sglang-router
# (tools/sglang_env.sh; built once per machine outside the checkout); the CPU server it compares with runs
# in .venv, with the project's own pins.
test-sglang: setup
	@py=$$(tools/sglang_env.sh) && env PYTHONPATH=$(CURDIR) M2PO_PROJECT_PYTHON=$(CURDIR)/$(PY) \
		$$py -m pytest tests/contract $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
