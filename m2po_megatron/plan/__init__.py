"""Sizing a cluster for a recipe (`m2po plan`, docs/plan.md): a discrete-event simulation (sim.py) that drives
the project's own generators and staleness controller, cost models from datasheets (costs.py, hardware.py) or
fitted on a run's timeline (calibrate.py), and the enumeration and ranking of layouts (search.py)."""
