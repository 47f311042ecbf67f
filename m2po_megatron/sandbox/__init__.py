"""Running untrusted programs (the `code` reward's generated Python) in a bubblewrap sandbox.

- :func:`run_sandboxed`: run a program under :class:`Limits` with no network and a read-only view of the system;
- :func:`sandbox_status`: whether that works on this machine (probed once per process);
- :func:`run_unsandboxed`: the same limits as a plain subprocess, for machines without a sandbox (unsafe).

See docs/sandbox.md for what is isolated and how.
"""
from .bwrap import HOW_TO_GET_BWRAP, SandboxStatus, find_bwrap, run_sandboxed, sandbox_status
from .limits import FAILURE_REASONS, RUN_REASONS, Limits, RunResult
from .process import run_unsandboxed

__all__ = ["HOW_TO_GET_BWRAP", "SandboxStatus", "find_bwrap", "run_sandboxed", "sandbox_status", "FAILURE_REASONS",
           "RUN_REASONS", "Limits", "RunResult", "run_unsandboxed"]
