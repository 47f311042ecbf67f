"""A run, assembled from its config and kept on disk: inputs (tokenizer, prompts, eval sets), the rollout servers,
the trainer ranks (Ray actors around the Megatron actor), the run directory, checkpoints and run-state file,
and the metrics. It sits above the domain packages (data, rollout, actor, config), which never import it."""
