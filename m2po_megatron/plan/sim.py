"""A discrete-event simulation of the RL loop on a simulated clock, driving the project's own control code.

What is real: the generators (rollout/generators.py: SyncGenerator for on_policy and fixed_lag, AsyncGenerator's
`pump`, `finish_one` and `take_batch` for bounded), the StalenessController and FixedLagQueue they hold, the
SampleLedger, and GroupMaker's dynamic-sampling filter. What is simulated: the rollout servers, the trainer
and the weight sync, from a `Costs` (plan/costs.py), and the rewards (Bernoulli at the recipe's accuracy).

Servers batch continuously: a sequence waits in its server's queue until fewer than `max_running` run, joins
after a prefill (which stalls the server's decoding), then gains one token per decode step until its length,
drawn from `LengthDist`. A step of B sequences holding K KV tokens costs Costs.decode_s; between events the
batch is fixed, so the time to the next completion is one closed-form sum. Requests go to the server with
the fewest samples in flight, as the client's picker does. Pushing weights pauses every server (generation
retracted and resumed, as SGLang's pause_generation does) for Costs.sync_s; tokens generated before keep
their version, so a sample's version is its server's version when it started.

The loop is train.py's order: take a batch (waiting as long as the generator makes it), train for
Costs.train_s while the servers go on, step the version by updates_per_step, push weights when the generator
asks, then the loop's own Costs.loop_fixed_s. The rollout client's host time outside the engine (sending
requests, scoring, grouping: Costs.client_per_sample_s, measured by a calibration) is charged for the samples
answered while the loop waits for its batch, after they are answered: in the synchronous modes every sample the
step generates; in bounded mode only those answered during a wait, since the client's work on the others runs
while the trainer trains and is off the step's critical path. On a host whose cores the trainer and the servers share
(Costs.shared_cores, the CPU machine), every busy component runs at Costs.speed(number busy): the clock counts
work and maps it to wall time between events. The staleness of a sample is the trainer version at its step
minus its version, as in rollout/samples.build_step_batch.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from m2po_megatron.plan.costs import Costs
from m2po_megatron.rollout.generators import AsyncGenerator, SyncGenerator
from m2po_megatron.rollout.groups import GroupMaker
from m2po_megatron.rollout.samples import Group, Sample, sample_ids_for
from m2po_megatron.staleness import FixedLagQueue, SampleLedger, StalenessController

__all__ = ["LengthDist", "SimSpec", "SimResult", "simulate"]


@dataclass(frozen=True)
class LengthDist:
    """Response lengths: a gamma distribution of this mean and coefficient of variation, cut at `max`
    (a cut response ends with finish_reason "length")."""

    mean: float
    cv: float
    max: int

    def sample(self, rng: random.Random) -> int:
        if self.cv <= 0:
            return max(1, min(self.max, round(self.mean)))
        k = 1 / (self.cv * self.cv)
        return max(1, min(self.max, round(rng.gammavariate(k, self.mean / k))))


@dataclass(frozen=True)
class SimSpec:
    mode: str  # on_policy | fixed_lag | bounded
    groups_per_step: int
    n: int
    updates_per_step: int
    prompt_len: int
    response: LengthDist
    num_servers: int = 1
    max_staleness: int = 0
    sync_interval: Optional[int] = None
    lag_steps: int = 0
    max_concurrency: int = 1 << 30  # samples in flight per server (rollout.max_concurrency)
    logprob_pass: bool = False  # the trainer makes a no-grad pass per step
    recompute_behaviour: bool = False  # behav_logprob_source=trainer: a log-prob pass at generation (sync modes)
    max_gen_batches: Optional[int] = None  # train.filter_groups (None: off)
    accuracy: float = 0.5  # P(reward 1) per sample, for the filter


@dataclass
class SimResult:
    # per step: t_end, step_s, wait_s, train_s, sync_s, tokens, samples, recompute_tokens and recompute_s (the
    # trainer's log-prob pass inside the wait, sync modes), server_busy_s (the servers' busy seconds summed,
    # cumulative), staleness_mean, staleness_max
    steps: list[dict]
    server_busy_s: list[float]  # per server, over the whole run
    window_s: float
    skip: int

    def summary(self) -> dict:
        """Means over the measured steps (after `skip`). trainer_idle_frac: the share of their wall time the
        trainer waits for a batch (not training, not making its log-prob pass, not pushing weights);
        rollout_idle_frac: the share of it a server decodes nothing (paused for a push, or nothing to do),
        the mean over servers."""
        first = self.skip if self.skip < len(self.steps) else 0
        rows = self.steps[first:]
        span = sum(r["step_s"] for r in rows)
        mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
        tokens = sum(r["tokens"] for r in rows)
        busy = rows[-1]["server_busy_s"] - (self.steps[first - 1]["server_busy_s"] if first else 0.0)
        waiting = sum(r["wait_s"] - r["recompute_s"] for r in rows)
        return {"step_s": mean("step_s"), "wait_s": mean("wait_s"), "train_s": mean("train_s"),
                "sync_s": mean("sync_s"), "tokens_per_s": tokens / span if span else 0.0,
                "steps_per_hour": 3600 * len(rows) / span if span else 0.0,
                "trainer_idle_frac": waiting / span if span else 0.0,
                "rollout_idle_frac": 1 - busy / (len(self.server_busy_s) * span) if span and self.server_busy_s
                else 0.0,
                "staleness_mean": sum(r["staleness_mean"] * r["samples"] for r in rows) / max(
                    sum(r["samples"] for r in rows), 1),
                "staleness_max": max(r["staleness_max"] for r in rows)}


class _Clock:
    """Events in work time (`now`: seconds of work done by a component running alone), and the wall time they
    take (`wall`). Between events the set of busy components is fixed, so every busy one runs at
    Costs.speed(number busy) and work time maps to wall time piecewise; with dedicated devices the two are equal.
    Components report their own transitions (`became`), so an event costs O(1), not O(components): a plan
    simulates dozens of servers over tens of thousands of events."""

    def __init__(self, speed: Callable[[int], float] = lambda n: 1.0):
        self.now = 0.0
        self.wall = 0.0
        self.speed = speed
        self.busy_count = 0  # components busy now
        self.completions = 0  # requests answered so far: the generator's state changes only when this does
        self._events: list = []
        self._seq = itertools.count()
        self.after_event: Optional[Callable[[], None]] = None

    def became(self, c, busy: bool) -> None:
        """Component `c` (with busy_wall and since floats) turned busy or idle now; its wall-clock busy time
        is summed interval by interval."""
        if busy:
            c.since = self.wall
            self.busy_count += 1
        else:
            c.busy_wall += self.wall - c.since
            self.busy_count -= 1

    def busy_wall(self, c, busy: bool) -> float:
        """`c`'s wall-clock busy time so far, its open interval included."""
        return c.busy_wall + (self.wall - c.since if busy else 0.0)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def _move(self, t: float) -> None:
        if t <= self.now:
            return
        self.wall += (t - self.now) / self.speed(self.busy_count)
        self.now = t

    def run_next(self) -> bool:
        if not self._events:
            return False
        t, _, fn = heapq.heappop(self._events)
        self._move(t)
        fn()
        if self.after_event is not None:
            self.after_event()
        return True

    def run_until(self, t: float) -> None:
        while self._events and self._events[0][0] <= t:
            self.run_next()
        self._move(t)


class _Busy:
    """The trainer (or the loop's own work): busy while `on`."""

    def __init__(self):
        self.on, self.busy_wall, self.since = False, 0.0, 0.0

    def work(self, clock: _Clock, seconds: float) -> None:
        self.on = True
        clock.became(self, True)
        clock.run_until(clock.now + seconds)
        self.on = False
        clock.became(self, False)


class _Future:
    """concurrent.futures.Future's surface the generators use; `result` runs the clock until it is set."""

    def __init__(self, clock: _Clock):
        self.clock, self._result, self._done, self._callbacks = clock, None, False, []

    def set_result(self, r) -> None:
        self._result, self._done = r, True
        self.clock.completions += 1
        for cb in self._callbacks:
            cb(self)

    def add_done_callback(self, cb) -> None:
        if self._done:
            cb(self)
        else:
            self._callbacks.append(cb)

    def result(self, timeout=None):
        while not self._done:
            if not self.clock.run_next():
                raise RuntimeError("the simulated rollout servers have nothing left to do, yet a request is "
                                   "unanswered (a bug in plan/sim.py)")
        return self._result


@dataclass
class _Result:  # rollout.client.SampleResult's fields GroupMaker.fill reads
    output_ids: range
    output_logprobs: list
    token_versions: list
    finish_reason: str


class _Request:
    def __init__(self, n: int, fut: _Future):
        self.left, self.results, self.fut = n, [None] * n, fut


class _Server:
    def __init__(self, clock: _Clock, costs: Costs, max_running: int):
        self.clock, self.c, self.max_running = clock, costs, max_running
        self.queue: deque = deque()  # (request, index, prompt_len, length)
        self.running: list = []  # heap of (finish_step, seq id, request, index, prompt_len, length, version)
        self.step = 0  # decode steps done
        self.kv = 0.0  # KV tokens of the running sequences
        self.t = 0.0  # the time `step` and `kv` are exact at
        self.ready = 0.0  # prefill ends
        self.paused = False
        self.version = 0
        self.epoch = 0  # invalidates scheduled completions
        self.inflight = 0  # samples sent and not answered (the client's view)
        self.busy, self.busy_wall, self.since = False, 0.0, 0.0  # decoding (not paused, sequences running)
        self.due = (0, 0.0)  # the scheduled completion's decode steps and time
        self._ids = itertools.count()

    def _advance(self, now: float) -> None:
        """Bring step/kv to the last whole decode step finished by `now`."""
        if self.paused or not self.running:
            self.t = max(self.t, now)
            return
        start = max(self.t, self.ready)
        if now <= start:
            return
        b = len(self.running)
        k = min(self.c.steps_within(now - start, b, self.kv), self.running[0][0] - self.step)
        dt = self.c.decode_s(k, b, self.kv)
        self.step += k
        self.kv += k * b
        self.t = start + dt

    def _schedule(self) -> None:
        """Schedule the next completion; every change of state ends here, so this is where the server tells
        the clock that it turned busy or idle."""
        self.epoch += 1
        busy = not self.paused and bool(self.running)
        if busy != self.busy:
            self.busy = busy
            self.clock.became(self, busy)
        if not busy:
            return
        b = len(self.running)
        k = self.running[0][0] - self.step
        t = max(self.t, self.ready) + self.c.decode_s(k, b, self.kv)
        self.due = (k, t)
        epoch = self.epoch
        self.clock.at(t, lambda: self._on_finish(epoch))

    def _join(self) -> None:
        prefill = 0
        while self.queue and len(self.running) < self.max_running:
            req, i, p, length = self.queue.popleft()
            heapq.heappush(self.running, (self.step + length, next(self._ids), req, i, p, length, self.version))
            self.kv += p
            prefill += p
        if prefill:
            cost = prefill * self.c.prefill_per_token_s
            self.ready = max(self.ready, self.t, self.clock.now) + cost

    def submit(self, req: _Request, prompt_len: int, lengths: list[int]) -> None:
        self._advance(self.clock.now)
        self.inflight += len(lengths)
        for i, length in enumerate(lengths):
            self.queue.append((req, i, prompt_len, length))
        if not self.paused:
            self._join()
        self._schedule()

    def _on_finish(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        k, t = self.due
        if k > 0:  # nothing changed since it was scheduled: its k steps are done at t (what _advance finds)
            self.step += k
            self.kv += k * len(self.running)
            self.t = t
        else:
            self._advance(self.clock.now)
        done = []
        while self.running and self.running[0][0] <= self.step:
            _, _, req, i, p, length, version = heapq.heappop(self.running)
            self.kv -= p + length
            done.append((req, i, length, version))
        self._join()
        self._schedule()
        for req, i, length, version in done:
            self.inflight -= 1
            req.results[i] = _Result(range(length), [], [version], "stop")
            req.left -= 1
            if req.left == 0:
                req.fut.set_result(req.results)

    def pause(self) -> None:
        self._advance(self.clock.now)
        self.paused = True
        self._schedule()

    def resume(self, version: int) -> None:
        self.t = max(self.t, self.clock.now)
        self.ready = max(self.ready, self.t)
        self.paused, self.version = False, version
        self._join()
        self._schedule()


class _Maker(GroupMaker):
    """GroupMaker with simulated requests and rewards; its filter (informative, drop_uninformative,
    count_filter) is the real one."""

    def __init__(self, clock: _Clock, servers: list[_Server], spec: SimSpec, rng: random.Random):
        super().__init__(client=None, rewards=None, tokenizer=None, tokenize=None, sampling={}, n=spec.n, seed=0)
        self.clock, self.servers, self.spec, self.rng = clock, servers, spec, rng
        self.sent = 0  # samples requested so far

    def new_group(self, gid: str, row: dict) -> Group:
        return Group(group_id=gid, prompt_id=str(row["id"]), prompt_ids=range(self.spec.prompt_len), answer="")

    def submit(self, group: Group) -> _Future:
        fut = _Future(self.clock)
        self.sent += self.n
        server = min(self.servers, key=lambda s: s.inflight)
        lengths = [self.spec.response.sample(self.rng) for _ in range(self.n)]
        server.submit(_Request(self.n, fut), self.spec.prompt_len, lengths)
        return fut

    def fill(self, group: Group, results) -> Group:
        cut = self.spec.response.max
        group.samples = [Sample(sample_id=sid, group_id=group.group_id, prompt_ids=group.prompt_ids,
                                output_ids=r.output_ids, logprobs=[], versions=list(r.token_versions),
                                finish_reason="length" if len(r.output_ids) >= cut else "stop")
                         for sid, r in zip(sample_ids_for(group.group_id, self.n), results)]
        self.gen_tokens += sum(len(r.output_ids) for r in results)
        return group

    def score(self, groups: list[Group]) -> None:
        for g in groups:
            for s in g.samples:
                s.reward = 1.0 if self.rng.random() < self.spec.accuracy else 0.0


class _Prompts:
    def __init__(self):
        self.i = 0

    def next(self) -> dict:
        self.i += 1
        return {"id": self.i, "prompt": "", "answer": ""}


def simulate(spec: SimSpec, costs: Costs, steps: int, seed: int = 0, skip: Optional[int] = None,
             controller_factory: Optional[Callable[..., StalenessController]] = None) -> SimResult:
    """`steps` training steps of `spec` at `costs`; the summary leaves out the first `skip` (default: the
    steps before the pipeline can be full). `controller_factory`: the bounded mode's controller class
    (default StalenessController, what make_generator builds)."""
    if spec.mode not in ("on_policy", "fixed_lag", "bounded"):
        raise ValueError(f"mode = {spec.mode!r} is not one of on_policy, fixed_lag, bounded (staleness.mode)")
    rng = random.Random(seed)
    clock = _Clock(costs.speed)
    trainer = _Busy()
    client = _Busy()  # the rollout client's host work outside the engine (Costs.client_per_sample_s)
    max_running = max(1, min(costs.max_running, spec.max_concurrency))
    servers = [_Server(clock, costs, max_running) for _ in range(spec.num_servers)]
    maker = _Maker(clock, servers, spec, rng)
    ledger = SampleLedger()
    G, U = spec.groups_per_step, spec.updates_per_step
    if spec.mode == "bounded":
        ctl = (controller_factory or StalenessController)(spec.max_staleness, groups_per_step=G,
                                                          updates_per_step=U, sync_interval=spec.sync_interval)
        gen = AsyncGenerator(maker, _Prompts(), ledger, ctl, G, max_gen_batches=spec.max_gen_batches)

        seen = [-1]

        def settle():  # what the generation thread does between the loop's calls, once a request is answered
            if clock.completions == seen[0]:
                return
            seen[0] = clock.completions
            while gen.finish_one(0):
                pass
            gen.pump()
        clock.after_event = settle
        gen.pump()
    else:
        lag = FixedLagQueue(spec.lag_steps, U) if spec.mode == "fixed_lag" else None

        def recompute(groups):  # the trainer's pass over the batch, between generation and queueing
            tokens = sum(len(s.prompt_ids) + len(s.output_ids) for g in groups for s in g.samples)
            w0 = clock.wall
            trainer.work(clock, tokens * costs.logprob_per_token_s)
            passes[0] += tokens
            passes[1] += clock.wall - w0
        gen = SyncGenerator(maker, _Prompts(), ledger, G, lag, recompute if spec.recompute_behaviour else None,
                            max_gen_batches=spec.max_gen_batches)
    version, rows = 0, []
    passes = [0, 0.0]  # this step's log-prob recompute (sync modes): tokens, wall seconds
    for step in range(steps):
        t0 = clock.wall
        passes[:] = [0, 0.0]
        if spec.mode == "bounded":
            first, waited = clock.completions, False
            while (groups := gen.take_batch()) is None:
                waited = True
                answered = clock.completions  # a batch can form only once another request is answered
                while clock.completions == answered:
                    if not clock.run_next():
                        raise RuntimeError("the simulated pipeline stalled: no batch can form and nothing runs "
                                           "(a bug in plan/sim.py or in the controller it drives)")
            on_path = (clock.completions - first) * spec.n if waited else 0  # answered while the loop waited
        else:
            sent = maker.sent
            groups = gen.next_groups(version)
            on_path = maker.sent - sent  # the step waits for every sample it generates
        if costs.client_per_sample_s and on_path:
            client.work(clock, on_path * costs.client_per_sample_s)
        t1 = clock.wall
        samples = [s for g in groups for s in g.samples if s.output_ids]
        stale = [version - s.min_version for s in samples]
        ledger.consume([s.sample_id for s in samples], version, [s.versions for s in samples])
        tokens = sum(len(s.prompt_ids) + len(s.output_ids) for s in samples)
        trainer.work(clock, costs.train_s(tokens, U, spec.logprob_pass))
        t2 = clock.wall
        version += U
        gen.on_step(version, updates=U)
        if spec.mode == "bounded":
            gen.pump()  # the new version may let the controller admit more (the real thread wakes on it)
        if gen.needs_sync():
            gen.pause()
            for s in servers:
                s.pause()
            trainer.work(clock, costs.sync_s())
            gen.on_sync(version)
            for s in servers:
                s.resume(version)
            gen.resume()
            if spec.mode == "bounded":
                gen.pump()
        t3 = clock.wall
        trainer.work(clock, costs.loop_fixed_s)  # the loop's bookkeeping, metrics and logging
        ledger.end_step(pending=gen.pending())
        rows.append({"t_end": clock.wall, "step_s": clock.wall - t0, "wait_s": t1 - t0, "train_s": t2 - t1,
                     "sync_s": t3 - t2, "tokens": tokens, "samples": len(samples),
                     "recompute_tokens": passes[0], "recompute_s": passes[1],
                     "server_busy_s": sum(clock.busy_wall(s, s.busy) for s in servers),
                     "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
                     "staleness_max": max(stale) if stale else 0})
    if skip is None:
        fill = math.ceil(spec.max_staleness / U) + 1 if spec.mode == "bounded" else 1
        skip = min(fill, steps // 2)
    return SimResult(rows, [clock.busy_wall(s, s.busy) for s in servers], clock.wall, skip)
