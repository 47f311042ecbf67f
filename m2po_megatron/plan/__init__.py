"""Sizing a cluster for a recipe (issue 23, in progress): a discrete-event simulation (sim.py) that drives the
project's own generators and staleness controller, cost models from datasheets (costs.py, hardware.py), and
the enumeration and ranking of layouts (search.py). The `m2po plan` command and the calibration on a run are
not built yet."""
