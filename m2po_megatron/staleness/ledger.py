"""The sample ledger: every generated sample ends consumed, dropped with a counted reason, or is still pending."""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any, Iterable, Optional, Sequence, Union

from m2po_megatron.staleness.ids import SampleId, check_id, nonneg_int

# Why a sample can end without being trained on. Every drop names one of these, so the counters add up.
DROP_REASONS = (
    "too_stale",  # would exceed max_staleness when trained (only if the loop lets it get that far)
    "aborted",  # generation aborted (server error, shutdown, weight update with retraction)
    "filtered",  # removed by a data filter (today: a sample with no output tokens)
    "interrupted",  # in flight when the run stopped; regenerated after resume under a new id
    "zero_variance",  # its group's rewards were all equal (train.filter_groups: zero advantage, nothing to learn)
    "bad_routing",  # algo.routing_replay=r3: the engine's routed experts were missing or malformed (rollout/routing.py)
    "bad_rollout",  # rollout.function's result was unusable: raised, timed out, malformed (agents/runner.py)
    "reward_error",  # a reward term failed (time limit, exception, service down) and reward.on_error = drop
)


class LedgerError(RuntimeError):
    """An illegal sample transition, or the ledger identity generated = consumed + dropped + pending broke."""


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
        self.history = nonneg_int("history", history)
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
            check_id("sample", s)
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
