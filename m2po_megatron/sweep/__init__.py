"""Many runs at once: expand a sweep grid and submit it to Slurm (grid) or run it here (local), then plot and
report the runs' metrics."""
