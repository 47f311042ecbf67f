"""Staleness: model versions, admission control, the paper's fixed-lag queue, and the sample ledger.

Pure Python: this module sees ids, versions and counts, never tensors.

A *version* is the number of optimizer updates applied so far. A training step applies
`updates_per_step` updates (the optimizer mini-batches of one step) and consumes `groups_per_step`
prompt groups. The *staleness* of a sample is measured when its step begins:

    staleness = (trainer version at the start of the consuming step) - (version that generated it)

so the m-th mini-batch of a step (m = 0 .. updates_per_step-1) sees staleness + m. This is the paper's
convention: lag k = 64 batches with 4 updates per step is "s = 256" (256-259 counting within-step
updates). For a sample whose tokens span versions (partial rollouts, in-flight weight updates) the
generating version is the oldest token's.

Three pieces:
- `StalenessController`: `bounded` (asynchronous) mode; admission control so that nothing is generated
  that could not be trained within `max_staleness` updates.
- `FixedLagQueue`: `fixed_lag` mode, the released M2PO code's simulation (a FIFO of k finished batches).
- `SampleLedger`: every sample ends consumed, dropped (with a reason) or is still pending; the identity
  generated = consumed + dropped + pending is checked every step.
On-policy training is `FixedLagQueue(0)` or `StalenessController(max_staleness=0, ...)`.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

__all__ = [
    "DROP_REASONS",
    "FixedLagQueue",
    "LedgerError",
    "QueuedBatch",
    "SampleLedger",
    "StalenessBoundError",
    "StalenessController",
]

GroupId = Union[int, str]
SampleId = Union[int, str]

# Why a sample can end without being trained on. Every drop names one of these, so the counters add up.
DROP_REASONS = (
    "too_stale",  # would exceed max_staleness when trained (only if the loop lets it get that far)
    "aborted",  # generation aborted (server error, shutdown, weight update with retraction)
    "filtered",  # removed by a data filter, e.g. a group whose rewards are all equal (zero advantage)
    "overlong",  # response hit the length limit and the recipe discards such samples
    "error",  # reward or parsing failed
    "interrupted",  # in flight when the run stopped; regenerated after resume under a new id
)


class StalenessBoundError(RuntimeError):
    """A sample would be trained beyond max_staleness, or the controller's versions are inconsistent."""


class LedgerError(RuntimeError):
    """An illegal sample transition, or the ledger identity generated = consumed + dropped + pending broke."""


def _check_id(kind: str, x: Any) -> None:
    # ids go into JSON checkpoints: keep them to ints and strings (bool is an int, but surely a bug).
    if isinstance(x, bool) or not isinstance(x, (int, str)):
        raise TypeError(f"{kind} id {x!r} has type {type(x).__name__}; ids must be int or str")


def _nonneg_int(name: str, x: Any, minimum: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < minimum:
        raise ValueError(f"{name} = {x!r}: must be an integer >= {minimum}")
    return x


# ----------------------------------------------------------------------------------------------------
# Bounded (asynchronous) mode
# ----------------------------------------------------------------------------------------------------
class StalenessController:
    """Admission control for asynchronous training with staleness at most `max_staleness` updates.

    Notation: eta = max_staleness, U = updates_per_step, G = groups_per_step, V = `version`, the trainer
    version at which the *next batch to be formed* will start training (after `on_consumed` of a step
    and before its `on_step`, V is already the version after that step), v_s = `server_version`, the
    weights the rollout servers hold (the minimum over servers if they differ).

    Deadline. A group admitted now is generated at a version >= v_s (server versions only grow; partial
    rollouts and in-flight updates only make later tokens fresher), so it is within the bound if it is
    consumed by a step whose start version W satisfies W - v_s <= eta. Its *deadline* is therefore
    d = v_s + eta; once generated, d is raised to (oldest token's version) + eta. The steps that can
    still consume a group with deadline d start at V, V+U, V+2U, ..., i.e. there are

        slots(d) = floor((d - V) / U) + 1    (0 if d < V)

    of them, each taking G groups. In step indices (steps starting at versions 0, U, 2U, ...): a group
    admitted while the trainer has applied v updates is consumed at the earliest at step ceil(v / U)
    (the batch being formed next; V = ceil(v / U) * U unless that batch is already formed) and, with lag
    L = V - v_s, at the latest floor((eta - L) / U) steps after that one; its oldest token then has
    staleness <= V + U * floor((eta - L) / U) - v_s <= eta.

    Capacity. Training earliest-deadline-first meets every deadline iff, for every deadline T,
    N(<= T) <= slots(T) * G, where N(<= T) counts unconsumed groups (running or finished) with
    deadline <= T. A new group has the largest admission deadline d_new = v_s + eta, so

        capacity = min over T in {d_new} U {deadlines > d_new} of slots(T) * G - N(<= T)

    With one deadline class and no sync lag this is AReaL's formula in groups: with L = 0 and U = 1,
    capacity = (eta + 1) * G - unconsumed = (eta + v + 1) * G - (accepted + running) since
    consumed = v * G. With U updates per step the bound in steps is floor((eta - L) / U).

    Batch selection. `select_batch` takes the G finished groups with the earliest deadlines and
    returns None (wait) if leaving the rest would make some future deadline unmeetable; then a running
    group must finish (or be dropped) first. Following `try_admit` + `select_batch`, no consumed group
    exceeds eta, and generation never starves: when fewer than G groups are unconsumed, capacity >= G
    minus those.

    Weight sync. Weights are pushed when `needs_sync()` (trainer - server >= sync_interval, checked
    between steps). The lag L costs capacity (fewer steps of slack); at step boundaries it is at most
    U * (ceil(sync_interval / U) - 1), which must be <= eta or nothing could be admitted for the next
    step; the constructor rejects that. sync_interval <= max(1, eta) (the config's rule) always passes.
    """

    def __init__(self, max_staleness: int, groups_per_step: int, updates_per_step: int = 1,
                 sync_interval: Optional[int] = None, version: int = 0,
                 server_version: Optional[int] = None):
        self.max_staleness = _nonneg_int("max_staleness", max_staleness)
        self.groups_per_step = _nonneg_int("groups_per_step", groups_per_step, 1)
        self.updates_per_step = _nonneg_int("updates_per_step", updates_per_step, 1)
        self.sync_interval = _nonneg_int("sync_interval", self.updates_per_step if sync_interval is None
                                         else sync_interval, 1)
        worst_lag = self.updates_per_step * (math.ceil(self.sync_interval / self.updates_per_step) - 1)
        if worst_lag > self.max_staleness:
            raise ValueError(
                f"sync_interval = {self.sync_interval} with updates_per_step = {self.updates_per_step} lets the "
                f"servers lag {worst_lag} updates behind the trainer at a step boundary, more than "
                f"max_staleness = {self.max_staleness}: nothing could be admitted then. Use sync_interval <= "
                f"{self.updates_per_step * (self.max_staleness // self.updates_per_step + 1)}")
        self._version = _nonneg_int("version", version)
        self._trainer_version = self._version
        sv = self._version if server_version is None else _nonneg_int("server_version", server_version)
        if sv > self._version:
            raise ValueError(f"server_version = {sv} is ahead of the trainer version {self._version}")
        self._server_version = sv
        # A group's deadline is base + max_staleness, base = the server version at admission while it
        # runs, then its oldest token's version. Keeping bases (not deadlines) lets a resumed run change
        # max_staleness.
        self._running: dict[GroupId, int] = {}  # id -> server version at admission; admission order
        self._finished: dict[GroupId, int] = {}  # id -> generated (oldest token) version; completion order
        self._bases: Counter[int] = Counter()  # base version -> unconsumed groups
        self._step_updates = self.updates_per_step  # what the last on_consumed announced
        self.admitted = 0
        self.consumed = 0
        self.dropped = 0
        self.steps = 0

    # -- views --------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Trainer version at which the next batch will start training."""
        return self._version

    @property
    def trainer_version(self) -> int:
        """Updates applied so far (as reported by `on_step`)."""
        return self._trainer_version

    @property
    def server_version(self) -> int:
        return self._server_version

    def running(self) -> list[GroupId]:
        """Admitted groups not yet generated, in admission order."""
        return list(self._running)

    def finished(self) -> list[GroupId]:
        """Generated groups waiting to be trained, in completion order."""
        return list(self._finished)

    @property
    def unconsumed(self) -> int:
        return len(self._running) + len(self._finished)

    def deadline(self, group_id: GroupId) -> int:
        """Latest start version of a step that may still train this group."""
        if group_id in self._running:
            return self._running[group_id] + self.max_staleness
        if group_id in self._finished:
            return self._finished[group_id] + self.max_staleness
        raise KeyError(f"group {group_id!r} is not admitted (or already consumed/dropped)")

    def _slots(self, deadline: int, version: Optional[int] = None) -> int:
        v = self._version if version is None else version
        return 0 if deadline < v else (deadline - v) // self.updates_per_step + 1

    def _capacity_for(self, d_new: int) -> int:
        if self._slots(d_new) == 0:
            return 0
        # N(<= T) for T = d_new, then every larger deadline present (the min over [d_i, d_i+1) is at d_i).
        eta = self.max_staleness
        below = sum(c for b, c in self._bases.items() if b + eta <= d_new)
        cap = self._slots(d_new) * self.groups_per_step - below
        for b in sorted(b for b in self._bases if b + eta > d_new):
            below += self._bases[b]
            cap = min(cap, self._slots(b + eta) * self.groups_per_step - below)
        return max(0, cap)

    def capacity(self) -> int:
        """How many more groups may be admitted now without risking the staleness bound."""
        return self._capacity_for(self._server_version + self.max_staleness)

    def needs_sync(self) -> bool:
        """True when the servers should receive the trainer's weights (call between steps)."""
        return self._trainer_version - self._server_version >= self.sync_interval

    def overdue(self) -> list[GroupId]:
        """Unconsumed groups that can no longer be trained within the bound (empty when admission and
        `select_batch` are followed); drop them with reason 'too_stale' or abort them."""
        oldest = self._version - self.max_staleness
        return [g for g, b in self._running.items() if b < oldest] + \
               [g for g, b in self._finished.items() if b < oldest]

    # -- transitions ----------------------------------------------------------------------------------
    def try_admit(self, group_ids: Sequence[GroupId]) -> int:
        """Admit the longest prefix of `group_ids` that fits; returns how many were admitted. Start
        generating exactly those (with the servers' current weights or newer)."""
        group_ids = list(group_ids)
        for g in group_ids:
            _check_id("group", g)
            if g in self._running or g in self._finished:
                raise ValueError(f"group {g!r} is already admitted")
        if len(set(group_ids)) != len(group_ids):
            raise ValueError("try_admit got duplicate group ids")
        n = min(len(group_ids), self.capacity())
        for g in group_ids[:n]:
            self._running[g] = self._server_version
        if n:
            self._bases[self._server_version] += n
        self.admitted += n
        return n

    def on_generated(self, group_id: GroupId, version: int) -> None:
        """The group finished generating; `version` is the oldest version among its tokens."""
        if group_id not in self._running:
            where = "already generated" if group_id in self._finished else "not admitted"
            raise ValueError(f"on_generated: group {group_id!r} is {where}")
        version = _nonneg_int("version", version)
        admitted_at = self._running[group_id]
        if version < admitted_at:
            raise StalenessBoundError(
                f"group {group_id!r} reports version {version}, older than the server version "
                f"{admitted_at} at its admission; pass the minimum over all servers to on_sync")
        if version > self._server_version:
            raise StalenessBoundError(f"group {group_id!r} reports version {version} but the servers are at "
                                      f"{self._server_version}; call on_sync after every weight push")
        del self._running[group_id]
        self._move(admitted_at, version)
        self._finished[group_id] = version

    def _move(self, old: Optional[int], new: Optional[int]) -> None:
        if old is not None:
            self._bases[old] -= 1
            if not self._bases[old]:
                del self._bases[old]
        if new is not None:
            self._bases[new] += 1

    def on_dropped(self, group_id: GroupId) -> None:
        """The group will not be trained (aborted, filtered, too stale); its slot is freed."""
        if group_id in self._running:
            b = self._running.pop(group_id)
        elif group_id in self._finished:
            b = self._finished.pop(group_id)
        else:
            raise ValueError(f"on_dropped: group {group_id!r} is not admitted (or already consumed/dropped)")
        self._move(b, None)
        self.dropped += 1

    def select_batch(self, finished: Optional[Iterable[GroupId]] = None,
                     n: Optional[int] = None) -> Optional[list[GroupId]]:
        """The next step's batch: `n` (default groups_per_step) finished groups, earliest deadline first
        (completion order among equals). None means wait: too few finished groups, or a running group
        must be in this batch to keep every later deadline. `finished` restricts the choice (e.g. to
        groups already scored)."""
        n = self.groups_per_step if n is None else _nonneg_int("n", n, 1)
        late = self.overdue()
        if late:
            raise StalenessBoundError(
                f"{len(late)} group(s) can no longer be trained within max_staleness = {self.max_staleness} "
                f"(e.g. {late[:3]}); drop them with reason 'too_stale' first")
        pool = list(self._finished) if finished is None else list(finished)
        for g in pool:
            if g not in self._finished:
                raise ValueError(f"select_batch: group {g!r} is not a finished, unconsumed group")
        if len(pool) < n:
            return None
        order = {g: i for i, g in enumerate(pool)}
        batch = sorted(pool, key=lambda g: (self._finished[g], order[g]))[:n]
        left = self._bases.copy()
        for g in batch:
            left[self._finished[g]] -= 1
        nxt, below = self._version + self.updates_per_step, 0
        for b in sorted(left):
            below += left[b]
            if below > self._slots(b + self.max_staleness, nxt) * self.groups_per_step:
                return None
        return batch

    def on_consumed(self, group_ids: Sequence[GroupId], updates: Optional[int] = None) -> list[int]:
        """The groups form the batch of one step, which will apply `updates` (default updates_per_step)
        updates. Returns each group's staleness; raises StalenessBoundError beyond max_staleness."""
        updates = self.updates_per_step if updates is None else _nonneg_int("updates", updates, 1)
        group_ids = list(group_ids)
        if len(set(group_ids)) != len(group_ids):
            raise ValueError("on_consumed got duplicate group ids")
        stale = []
        for g in group_ids:
            if g not in self._finished:
                where = "still generating" if g in self._running else "not admitted, or consumed/dropped"
                raise ValueError(f"on_consumed: group {g!r} is {where}")
            s = self._version - self._finished[g]
            if s > self.max_staleness:
                raise StalenessBoundError(
                    f"group {g!r} would be trained with staleness {s} > max_staleness = {self.max_staleness} "
                    f"(generated at version {self._finished[g]}, step starts at {self._version}); "
                    f"drop it ('too_stale') or form batches with select_batch")
            stale.append(s)
        for g in group_ids:
            self._move(self._finished.pop(g), None)
        self.consumed += len(group_ids)
        self._version += updates
        self._step_updates = updates
        self.steps += 1
        return stale

    def on_step(self, version: int, updates: Optional[int] = None) -> None:
        """The trainer finished a step and is now at `version` updates. `updates`: how many it really
        applied, when fewer than on_consumed announced (0 when every sample of the batch was dropped);
        the controller then takes back the updates that did not happen, so V stays the trainer's count."""
        version = _nonneg_int("version", version)
        if updates is not None:
            announced = self._step_updates
            if not 0 <= updates <= announced:
                raise ValueError(f"on_step(updates={updates}): the step announced {announced} updates")
            self._version -= announced - updates
            self._step_updates = updates
        if version != self._version:
            raise StalenessBoundError(
                f"on_step({version}): the controller expected version {self._version} after the consumed "
                f"batches; pass updates= to on_consumed when a step applies a different number of updates")
        self._trainer_version = version

    def on_sync(self, version: int) -> None:
        """The servers now generate with weights `version` (the minimum over servers)."""
        version = _nonneg_int("version", version)
        if version < self._server_version or version > self._trainer_version:
            raise StalenessBoundError(f"on_sync({version}): server versions only grow (was "
                                      f"{self._server_version}) and cannot pass the trainer "
                                      f"({self._trainer_version})")
        self._server_version = version

    # -- checkpoint -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (ids keep their int/str type)."""
        return {
            "max_staleness": self.max_staleness, "groups_per_step": self.groups_per_step,
            "updates_per_step": self.updates_per_step, "sync_interval": self.sync_interval,
            "version": self._version, "trainer_version": self._trainer_version,
            "server_version": self._server_version,
            "running": [[g, b] for g, b in self._running.items()],
            "finished": [[g, v] for g, v in self._finished.items()],
            "admitted": self.admitted, "consumed": self.consumed, "dropped": self.dropped, "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; settings (max_staleness etc.) come from the constructor, so a resumed run may change
        them. Groups that were running at checkpoint time stay admitted: regenerate them (their deadline
        is still valid) or drop them with reason 'interrupted'. After resume, call on_sync with the
        version the restarted servers hold."""
        self._version = state["version"]
        self._trainer_version = state["trainer_version"]
        self._server_version = state["server_version"]
        self._running = {g: b for g, b in state["running"]}
        self._finished = {g: v for g, v in state["finished"]}
        self._bases = Counter(list(self._running.values()) + list(self._finished.values()))
        for k in ("admitted", "consumed", "dropped", "steps"):
            setattr(self, k, state[k])


# ----------------------------------------------------------------------------------------------------
# Fixed-lag (simulated) mode
# ----------------------------------------------------------------------------------------------------
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
        self.lag_steps = _nonneg_int("lag_steps", lag_steps)
        self.updates_per_step = _nonneg_int("updates_per_step", updates_per_step, 1)
        self._queue: deque[QueuedBatch] = deque()
        self._pushed = 0
        self._last_version = -1

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def warming_up(self) -> bool:
        """True while the queue does not yet hold k batches (the next push will not release one)."""
        return len(self._queue) < self.lag_steps

    def push(self, payload: Any, version: int) -> None:
        """Enqueue a batch just generated with weights `version`."""
        version = _nonneg_int("version", version)
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
        the result must be JSON-serialisable for `run_state.save_run_state`."""
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


# ----------------------------------------------------------------------------------------------------
# Sample ledger
# ----------------------------------------------------------------------------------------------------
_CONSUMED = "consumed"


class SampleLedger:
    """Every generated sample ends in exactly one state: consumed (at a step, with a staleness), dropped
    (with a reason from DROP_REASONS) or pending (in flight or buffered).

    `end_step()` checks generated = consumed + dropped + pending (optionally against the number of
    samples the loop really holds) and returns the step's counters and staleness statistics. Terminal
    states are remembered for the last `history` samples so that double consumption or dropping a
    consumed sample raises; older ids are forgotten (they then raise as unknown).
    """

    def __init__(self, history: int = 200_000):
        self.history = _nonneg_int("history", history)
        self._pending: dict[SampleId, None] = {}
        self._done: OrderedDict[SampleId, str] = OrderedDict()  # id -> "consumed" | drop reason
        self.generated = 0
        self.consumed = 0
        self.dropped: Counter[str] = Counter()
        self._step_stale: list[int] = []  # per-sample staleness of samples consumed since end_step
        self._step_tokens = [0, 0]  # sum of per-token staleness, token count (when given per token)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def is_pending(self, sample_id: SampleId) -> bool:
        return sample_id in self._pending

    def _state_of(self, sid: SampleId) -> str:
        if sid in self._pending:
            return "pending"
        if sid in self._done:
            s = self._done[sid]
            return "consumed" if s == _CONSUMED else f"dropped ({s})"
        return "unknown"

    def _require_pending(self, op: str, ids: Sequence[SampleId]) -> None:
        if len(set(ids)) != len(ids):
            raise LedgerError(f"{op}: duplicate sample ids in one call")
        bad = [(s, self._state_of(s)) for s in ids if s not in self._pending]
        if bad:
            s, st = bad[0]
            raise LedgerError(f"{op}: sample {s!r} is {st}, not pending ({len(bad)} such id(s)); "
                              f"a sample is generated once and then consumed or dropped once")

    def add(self, sample_ids: Iterable[SampleId]) -> None:
        """New samples exist (generation started or finished): they are pending."""
        ids = list(sample_ids)
        for s in ids:
            _check_id("sample", s)
        if len(set(ids)) != len(ids):
            raise LedgerError("add: duplicate sample ids in one call")
        seen = [s for s in ids if s in self._pending or s in self._done]
        if seen:
            raise LedgerError(f"add: sample {seen[0]!r} already exists ({self._state_of(seen[0])}); ids must be unique")
        for s in ids:
            self._pending[s] = None
        self.generated += len(ids)

    def _finish(self, sid: SampleId, state: str) -> None:
        del self._pending[sid]
        self._done[sid] = state
        while len(self._done) > self.history:
            self._done.popitem(last=False)

    def consume(self, sample_ids: Sequence[SampleId], version: int,
                behaviour_versions: Sequence[Union[int, Sequence[int]]]) -> list[int]:
        """The samples are trained on in a step starting at trainer `version`. `behaviour_versions[i]` is
        the version that generated sample i: one int, or one int per token (partial rollouts). Returns
        per-sample staleness (oldest token)."""
        ids = list(sample_ids)
        if len(behaviour_versions) != len(ids):
            raise LedgerError(f"consume: {len(ids)} sample ids but {len(behaviour_versions)} behaviour_versions")
        self._require_pending("consume", ids)
        stale, tok_sum, tok_n = [], 0, 0
        for sid, bv in zip(ids, behaviour_versions):
            per_token = not isinstance(bv, int)
            vs = list(bv) if per_token else [bv]
            if not vs:
                raise LedgerError(f"consume: sample {sid!r} has an empty per-token version list")
            if max(vs) > version or min(vs) < 0:
                raise LedgerError(f"consume: sample {sid!r} has behaviour version(s) {min(vs)}..{max(vs)} "
                                  f"outside 0..{version} (the trainer version)")
            stale.append(version - min(vs))
            if per_token:
                tok_sum += sum(version - v for v in vs)
                tok_n += len(vs)
        for sid in ids:
            self._finish(sid, _CONSUMED)
        self.consumed += len(ids)
        self._step_stale += stale
        self._step_tokens[0] += tok_sum
        self._step_tokens[1] += tok_n
        return stale

    def drop(self, sample_ids: Sequence[SampleId], reason: str) -> None:
        if reason not in DROP_REASONS:
            raise LedgerError(f"drop: reason {reason!r} is not one of {DROP_REASONS}")
        ids = list(sample_ids)
        self._require_pending("drop", ids)
        for sid in ids:
            self._finish(sid, reason)
        self.dropped[reason] += len(ids)

    def check(self, pending: Optional[int] = None) -> None:
        """Raise LedgerError unless generated = consumed + dropped + pending; `pending`, if given, is the
        number of samples the caller really holds (in flight + buffered) and must match too."""
        d = sum(self.dropped.values())
        if self.generated != self.consumed + d + len(self._pending):
            raise LedgerError(f"sample ledger broken: generated {self.generated} != consumed {self.consumed} + "
                              f"dropped {d} + pending {len(self._pending)}")
        if pending is not None and pending != len(self._pending):
            raise LedgerError(f"sample ledger: the loop holds {pending} samples in flight or buffered but the "
                              f"ledger has {len(self._pending)} pending; some sample was lost or not recorded")

    def counters(self) -> dict[str, float]:
        out = {"samples/generated": self.generated, "samples/consumed": self.consumed,
               "samples/dropped": sum(self.dropped.values()), "samples/pending": len(self._pending)}
        for r in DROP_REASONS:
            out[f"samples/dropped/{r}"] = self.dropped.get(r, 0)
        return out

    def end_step(self, pending: Optional[int] = None) -> dict[str, float]:
        """Check the identity, return counters plus staleness stats of the samples consumed since the last
        end_step (`staleness/token_mean` only when per-token versions were given), and reset the latter."""
        self.check(pending)
        out = self.counters()
        if self._step_stale:
            out["staleness/mean"] = sum(self._step_stale) / len(self._step_stale)
            out["staleness/max"] = max(self._step_stale)
            out["staleness/min"] = min(self._step_stale)
        if self._step_tokens[1]:
            out["staleness/token_mean"] = self._step_tokens[0] / self._step_tokens[1]
        self._step_stale, self._step_tokens = [], [0, 0]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "pending": list(self._pending),
                "done": [[s, st] for s, st in self._done.items()], "generated": self.generated,
                "consumed": self.consumed, "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; raises LedgerError if the restored counters do not add up (a corrupt state)."""
        self._pending = dict.fromkeys(state["pending"])
        self._done = OrderedDict((s, st) for s, st in state["done"])
        self.generated, self.consumed = state["generated"], state["consumed"]
        self.dropped = Counter(state["dropped"])
        self._step_stale, self._step_tokens = [], [0, 0]
        self.check()
