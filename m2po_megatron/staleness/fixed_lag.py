"""Fixed-lag (simulated) mode: the released M2PO code's FIFO of k finished batches."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from m2po_megatron.staleness.ids import nonneg_int


@dataclass
class QueuedBatch:
    payload: Any  # opaque to this module: the caller's batch, or a path to where it was saved
    version: int  # weights it was generated with
    index: int  # generation iteration (0, 1, 2, ...)


class FixedLagQueue:
    """The released M2PO code's staleness simulation, `stale_iteration` = k batches of lag.

    The released trainer (verl fork, `RayPPOTrainer.fit`) is synchronous: every iteration draws the
    next prompt batch, generates it with the current weights, recomputes behaviour log-probs and appends
    the batch to a FIFO list. If the list then holds more than k batches it pops the oldest and trains
    on it (reward and advantages are computed after the pop); otherwise the iteration only generates
    and `continue`s (the step counter does not advance). So the first k iterations are warm-up: they
    only generate, with the base weights.

    Consequences, with U updates per step and training step j = 0, 1, ... (iteration k + j): batch i is
    generated at version max(0, i - k) * U; step j trains batch j at version j * U, so its staleness is
    min(j, k) * U: the first k steps train on base-model data with staleness 0, U, ..., (k-1) U, and
    every later step has exactly k * U (plus the within-step offset m for its m-th mini-batch). Equivalently,
    the batch trained at step j >= k was generated with the weights after step j - 1 - k. k = 0 is
    on-policy. The released code saves the queue with each checkpoint (and, during warm-up, every 20
    queued batches) and reloads it on resume.

    Use: `batch = q.step(payload, version)` once per iteration; train on `batch.payload` if not None.
    """

    def __init__(self, lag_steps: int, updates_per_step: int = 1):
        self.lag_steps = nonneg_int("lag_steps", lag_steps)
        self.updates_per_step = nonneg_int("updates_per_step", updates_per_step, 1)
        self._queue: deque[QueuedBatch] = deque()
        self._pushed = 0
        self._last_version = -1

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def warming_up(self) -> bool:
        """True while the queue does not yet hold k batches (the next push will not release one)."""
        return len(self._queue) < self.lag_steps

    def payloads(self) -> list[Any]:
        """The queued batches' payloads, oldest first."""
        return [b.payload for b in self._queue]

    def push(self, payload: Any, version: int) -> None:
        """Enqueue a batch just generated with weights `version`."""
        version = nonneg_int("version", version)
        if version < self._last_version:
            raise ValueError(f"push: version {version} is older than the previous batch's "
                             f"{self._last_version}; batches must be pushed in generation order")
        self._queue.append(QueuedBatch(payload, version, self._pushed))
        self._pushed += 1
        self._last_version = version

    def pop(self) -> Optional[QueuedBatch]:
        """The oldest batch if more than k are queued, else None (this iteration only generates)."""
        return self._queue.popleft() if len(self._queue) > self.lag_steps else None

    def step(self, payload: Any, version: int) -> Optional[QueuedBatch]:
        """One iteration of the released loop: enqueue the new batch, then pop the one to train on."""
        self.push(payload, version)
        return self.pop()

    def state_dict(self, encode: Callable[[Any], Any] = lambda p: p) -> dict[str, Any]:
        """The queue with each payload passed through `encode` (e.g. save it and return the file path);
        the result must be JSON-serialisable for `run.state.save_run_state`."""
        return {"lag_steps": self.lag_steps, "pushed": self._pushed, "last_version": self._last_version,
                "queue": [{"payload": encode(b.payload), "version": b.version, "index": b.index}
                          for b in self._queue]}

    def load_state_dict(self, state: dict[str, Any], decode: Callable[[Any], Any] = lambda s: s) -> None:
        """Restore the queue; `decode` inverts the `encode` given to state_dict. The queue length may
        exceed a smaller new lag_steps: the extra batches then come out one per iteration as usual
        (the queue never shrinks by more than one per step), so staleness settles over a few steps."""
        self._queue = deque(QueuedBatch(decode(b["payload"]), b["version"], b["index"]) for b in state["queue"])
        self._pushed = state["pushed"]
        self._last_version = state["last_version"]
