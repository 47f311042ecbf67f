"""The error that stops a run, defined below every package that raises it (rollout, run, the loop)."""


class RunError(RuntimeError):
    """The run stopped for a reason the message explains (a dead rank or server, a wait that timed out),
    naming what to do next; the CLI prints it without a traceback."""
