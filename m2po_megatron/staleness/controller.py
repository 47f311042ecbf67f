"""Bounded (asynchronous) mode: admission control so that nothing is generated that could not be trained
within `max_staleness` optimizer updates (versions and the staleness convention: see the package docstring)."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable, Optional, Sequence

from m2po_megatron.staleness.ids import GroupId, check_id, nonneg_int


class StalenessBoundError(RuntimeError):
    """A sample would be trained beyond max_staleness, or the controller's versions are inconsistent."""


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
        self.max_staleness = nonneg_int("max_staleness", max_staleness)
        self.groups_per_step = nonneg_int("groups_per_step", groups_per_step, 1)
        self.updates_per_step = nonneg_int("updates_per_step", updates_per_step, 1)
        self.sync_interval = nonneg_int("sync_interval", self.updates_per_step if sync_interval is None
                                        else sync_interval, 1)
        worst_lag = self.updates_per_step * (math.ceil(self.sync_interval / self.updates_per_step) - 1)
        if worst_lag > self.max_staleness:
            raise ValueError(
                f"sync_interval = {self.sync_interval} with updates_per_step = {self.updates_per_step} lets the "
                f"servers lag {worst_lag} updates behind the trainer at a step boundary, more than "
                f"max_staleness = {self.max_staleness}: nothing could be admitted then. Use sync_interval <= "
                f"{self.updates_per_step * (self.max_staleness // self.updates_per_step + 1)}")
        self._version = nonneg_int("version", version)
        self._trainer_version = self._version
        sv = self._version if server_version is None else nonneg_int("server_version", server_version)
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
            check_id("group", g)
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
        version = nonneg_int("version", version)
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
        n = self.groups_per_step if n is None else nonneg_int("n", n, 1)
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
        updates = self.updates_per_step if updates is None else nonneg_int("updates", updates, 1)
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
        version = nonneg_int("version", version)
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
        version = nonneg_int("version", version)
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
