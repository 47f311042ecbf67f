"""Staleness: model versions, admission control, the paper's fixed-lag queue, and the sample ledger.

Pure Python: this package sees ids, versions and counts, never tensors.

A *version* is the number of optimizer updates applied so far. A training step applies
`updates_per_step` updates (the optimizer mini-batches of one step) and consumes `groups_per_step`
prompt groups. The *staleness* of a sample is measured when its step begins:

    staleness = (trainer version at the start of the consuming step) - (version that generated it)

so the m-th mini-batch of a step (m = 0 .. updates_per_step-1) sees staleness + m. This is the paper's
convention: lag k = 64 batches with 4 updates per step is "s = 256" (256-259 counting within-step
updates). For a sample whose tokens span versions (partial rollouts, in-flight weight updates) the
generating version is the oldest token's.

Three pieces, one module each:
- `StalenessController` (controller.py): `bounded` (asynchronous) mode; admission control so that nothing
  is generated that could not be trained within `max_staleness` updates.
- `FixedLagQueue` (fixed_lag.py): `fixed_lag` mode, the released M2PO code's simulation (a FIFO of k
  finished batches).
- `SampleLedger` (ledger.py): every sample ends consumed, dropped (with a reason) or is still pending;
  the identity generated = consumed + dropped + pending is checked every step.
On-policy training is `FixedLagQueue(0)` or `StalenessController(max_staleness=0, ...)`.
"""
from m2po_megatron.staleness.controller import StalenessBoundError, StalenessController
from m2po_megatron.staleness.fixed_lag import FixedLagQueue, QueuedBatch
from m2po_megatron.staleness.ledger import DROP_REASONS, LedgerError, SampleLedger

__all__ = [
    "DROP_REASONS",
    "FixedLagQueue",
    "LedgerError",
    "QueuedBatch",
    "SampleLedger",
    "StalenessBoundError",
    "StalenessController",
]
