"""The warnings megatron-core (0.19.x) prints on every run that say nothing about the run, silenced one by one.

Each entry matches one message from one library; nothing else is filtered, so a new warning (or one of these
from another module) still shows. Installed once, from the package's __init__, so that every process (the CLI,
Ray actors, spawned test ranks) has them before megatron is first imported.
"""
from __future__ import annotations

import logging
import warnings

# (category, message regex (matched at the start), module regex): why each one is noise.
KNOWN_WARNINGS = [
    # Apex and Transformer Engine are optional (README, "Install"): without them megatron uses torch's optimizer,
    # multi_tensor_* and norm, which is what the actor is built for; it says so once per importing module.
    (UserWarning, r"Transformer Engine and Apex are not installed", r"megatron\."),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm", r"megatron\."),
    (UserWarning, r"absl\.logging is not installed", r"megatron\.core\.hyper_comm_grid"),
    # TransformerConfig's own default (cuda_graph_modules="full") warns about itself; CUDA graphs are off here.
    (UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config"),
    # megatron imports its experimental multi-modal config itself; nothing here uses it.
    (UserWarning, r"MimoModelConfig is experimental", r"megatron\."),
    # megatron's inference package warns about its own re-exports on import.
    (DeprecationWarning, r"The following imports from `dynamic_context\.py`", r"megatron\."),
    # torch deprecates the collectives megatron's DDP and distributed optimizer call (megatron's to change, not
    # ours: this package calls neither); torch reports them from its logging wrapper, whoever the caller.
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
     r"torch\.distributed\.c10d_logger"),
]

# Lines megatron logs as WARNING on every rank: (logger name, message start). GPTModel is the model class this
# package builds (docs/models.md); the DDP line asks callers for a layout it then computes itself.
KNOWN_LOG_LINES = [
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel: full_param_layout not provided"),
]


class _DropLines(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


_logs_filtered = False


def silence_known_warnings() -> None:
    """Install the filters above. Idempotent; warnings filters are checked rather than remembered, because a
    `warnings.catch_warnings()` block (pytest wraps each test in one) drops filters added inside it."""
    global _logs_filtered
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)  # replaces a copy
    if not _logs_filtered:
        _logs_filtered = True
        by_logger: dict[str, list[str]] = {}
        for name, start in KNOWN_LOG_LINES:
            by_logger.setdefault(name, []).append(start)
        for name, starts in by_logger.items():
            logging.getLogger(name).addFilter(_DropLines(tuple(starts)))
