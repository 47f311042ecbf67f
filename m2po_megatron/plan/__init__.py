"""`m2po plan`: size a cluster for a recipe from a discrete-event simulation (sim.py) that drives the project's
own generators and staleness controller, with cost models from datasheets or fitted on a run (costs.py,
hardware.py, calibrate.py); search.py enumerates and ranks the layouts."""
