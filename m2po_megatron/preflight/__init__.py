"""`m2po preflight`: one command to run first on a fresh allocation (docs/preflight.md). Each check is a module
here with a `run(cfg, ctx)` function, run by checks.py in its own process group under its own time limit:
comm (all-reduce and broadcast bandwidth), te (Transformer Engine and FP8), engine (a tiny rollout server and a
weight update it must reflect), ray_check (the recipe's placement) and memory (the estimate against one step).
summary.py turns the results into the table and the JSON summary."""
