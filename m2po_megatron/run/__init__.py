"""One run's on-disk state: its directory rules, checkpoints and run-state file, and its metrics."""
