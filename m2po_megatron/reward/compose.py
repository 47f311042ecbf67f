"""The recipe's reward: its weighted terms scored together, failures handled as reward.on_error says, DAPO's
over-long buffer applied, and the counters logged as reward/*.

Function terms run in the killable worker pool (pool.py); `remote` terms (a reward service, reward/remote.py)
are scored in batches by this process. Every sample gets a `Scored`: a score, or None when a term failed
and the recipe drops such samples (the ledger's `reward_error`)."""
from __future__ import annotations

import sys
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional

from .functions import Term, terms_of
from .overlong import overlong_penalty
from .pool import RewardPool
from .types import RewardInput, RewardOutput

ON_ERROR = ("score", "drop")


@dataclass
class Scored:
    score: Optional[float]  # None: a term failed and reward.on_error = drop
    extras: dict[str, float] = field(default_factory=dict)  # as logged, without the reward/ prefix
    acc: Optional[float] = None  # the first term's `acc` extra, when it gives one (eval's pass@1, filter_groups)
    failed: Optional[str] = None  # the status of the first term that failed (timeout, error, ...)


@dataclass
class Overlong:
    """reward.overlong_buffer, resolved against rollout.max_new_tokens."""
    max_tokens: int
    buffer: int
    factor: float


class Rewards:
    """`score(items) -> list[Scored]`; `stats()` -> the reward/* counters since the previous call; `close()`."""

    def __init__(self, terms: list[Term], *, num_workers: int = 1, timeout_s: float = 5.0, on_error: str = "score",
                 error_score: float = 0.0, overlong: Optional[Overlong] = None) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"reward.on_error = {on_error!r}; one of {ON_ERROR}")
        self.terms, self.on_error, self.error_score, self.overlong = terms, on_error, float(error_score), overlong
        local = [t for t in terms if not t.remote]
        self.pool_index = {id(t): i for i, t in enumerate(local)}
        self.pool = RewardPool([(t.target, t.args) for t in local], num_workers=num_workers, timeout_s=timeout_s,
                               timeouts=[t.timeout_s for t in local]) if local else None
        self.remote = {id(t): _remote(t.args) for t in terms if t.remote}
        self.needs_prompt = bool(self.remote)  # a reward model or judge reads the prompt; functions get the row
        self.lock = threading.Lock()  # stats are written by the generation thread and read by the loop's
        self.warned: set[tuple[str, str]] = set()
        self._reset()

    def _reset(self) -> None:
        self.counts: Counter = Counter()
        self.sums: dict[str, float] = defaultdict(float)
        self.ns: Counter = Counter()

    # ------------------------------------------------------------------------------------------------
    def score(self, items: list[RewardInput], record: bool = True) -> list[Scored]:
        """Score every item with every term. record=False (evaluation) leaves the training counters alone."""
        if not items:
            return []
        per_term: list[list[RewardOutput]] = []
        pool_stats = None
        if self.pool is not None:
            jobs = [(self.pool_index[id(t)], it) for t in self.terms if not t.remote for it in items]
            outs, pool_stats = self.pool.score(jobs)
        k = 0
        for t in self.terms:
            if t.remote:
                per_term.append(self.remote[id(t)].score(items))
            else:
                per_term.append(outs[k:k + len(items)])
                k += len(items)
        scored = [self._combine([per_term[j][i] for j in range(len(self.terms))], items[i])
                  for i in range(len(items))]
        if record:
            self._record(scored, per_term, pool_stats)
        return scored

    def _combine(self, outs: list[RewardOutput], item: RewardInput) -> Scored:
        total, extras, acc, failed = 0.0, {}, None, None
        single = len(self.terms) == 1
        for t, o in zip(self.terms, outs):
            if o.score is None:
                failed = failed or o.status
                s = self.error_score
            else:
                s = o.score
            total += t.weight * s
            if acc is None and "acc" in o.extras:
                acc = o.extras["acc"]
            if single:
                extras.update(o.extras)
            else:
                extras[f"{t.name}/score"] = s
                extras.update({f"{t.name}/{k}": v for k, v in o.extras.items()})
        if self.overlong is not None:
            pen = overlong_penalty(len(item.token_ids), self.overlong.max_tokens, self.overlong.buffer,
                                   self.overlong.factor)
            extras["overlong_penalty"] = pen
            total += pen
        if failed is not None and self.on_error == "drop":
            return Scored(None, extras, acc, failed)
        return Scored(total, extras, acc, failed)

    def _record(self, scored: list[Scored], per_term: list[list[RewardOutput]], pool_stats) -> None:
        with self.lock:
            self.counts["n"] += len(scored)
            for s in scored:
                for k, v in s.extras.items():
                    self.sums[k] += v
                    self.ns[k] += 1
                if s.failed is not None:
                    self.counts["failed"] += 1
                    self.counts[f"failed/{s.failed}"] += 1
                    if s.score is None:
                        self.counts["dropped"] += 1
            if pool_stats is not None:
                for k in ("timeouts", "errors", "bad_values", "worker_restarts", "seconds"):
                    self.counts[k] += getattr(pool_stats, k)  # seconds: the pool's wall time
            for t, outs in zip(self.terms, per_term):
                for o in outs:  # say why a term fails, once per term and kind (the counters say how often)
                    if o.score is None and (t.name, o.status) not in self.warned:
                        self.warned.add((t.name, o.status))
                        print(f"[m2po] reward term {t.name} ({t.spec}) failed: {o.status}: {o.detail or 'no detail'}"
                              f" (counted as reward/failed/{o.status}; reward.on_error = {self.on_error}; said once "
                              f"per term and kind)", file=sys.stderr, flush=True)

    def stats(self) -> dict[str, float]:
        """reward/* since the previous call: counters (n, failed, dropped, timeouts, errors, bad_values,
        worker_restarts, remote/...), reward/seconds, and the mean of every extra value. reward/dropped counts
        at scoring time; the ledger's samples/dropped/reward_error when the step's batch is built, so in bounded
        mode the two may differ by the samples scored in one step and batched in the next."""
        with self.lock:
            for t in self.terms:  # a service's counters since the previous call (its own clock, its own lock)
                if t.remote:
                    prefix = "remote/" if sum(x.remote for x in self.terms) == 1 else f"{t.name}/remote/"
                    for k, v in self.remote[id(t)].stats().items():
                        self.counts[prefix + k] += v
            out = {f"reward/{k}": v for k, v in self.counts.items()}
            out.update({f"reward/{k}": self.sums[k] / self.ns[k] for k in self.sums if self.ns[k]})
            self._reset()
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        for r in self.remote.values():
            r.close()

    def __enter__(self) -> "Rewards":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remote(args: dict):
    from .remote import RemoteReward  # a service client only where a recipe names one

    return RemoteReward(dict(args))


def overlong_of(cfg) -> Optional[Overlong]:
    b = cfg.reward.overlong_buffer
    if not b.enable:
        return None
    return Overlong(int(cfg.rollout.max_new_tokens), int(b.len), float(b.penalty_factor))


def rewards_from_config(cfg) -> Rewards:
    """The run's reward, as reward.* (and data.label_key, rollout.max_new_tokens) say."""
    return Rewards(run_terms(cfg), num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
                   on_error=cfg.reward.on_error, error_score=cfg.reward.error_score, overlong=overlong_of(cfg))


def run_terms(cfg) -> list[Term]:
    """terms_of(reward) with the built-in math_verify's defaults from the recipe: the label column
    (data.label_key) and reward.format_score, unless the term's args set them."""
    terms = terms_of(cfg.reward)
    for t in terms:
        if t.target.endswith("math_verify_reward:math_verify_fn"):
            t.args = {"label_key": cfg.data.label_key or "answer", "format_score": float(cfg.reward.format_score),
                      **t.args}
        elif t.remote and cfg.data.label_key:  # a judge's {label}: the recipe's label column unless told otherwise
            t.args = {"label_key": cfg.data.label_key, **t.args}
    return terms
