"""Where the trainer's groups come from: generation through the rollout client, rewards, and the staleness
policy that decides which groups may be generated and trained. The loop sees one interface, `Generator`:

- `SyncGenerator` (on_policy, fixed_lag): generates a step's groups with the current weights, then (for
  fixed_lag) passes them through the FIFO of the released code's simulation.
- `AsyncGenerator` (bounded): a background thread keeps the servers busy with groups admitted by the
  StalenessController; the trainer takes finished groups earliest-deadline first.
Every sample is registered in the SampleLedger when its group is admitted, so in-flight samples count as
pending and the identity generated = consumed + dropped + pending always holds. The prompts come from
data.prompts (PromptStream, Tokenize); one group's request, answer and score are rollout/groups.py's.
AsyncGenerator's steps (`pump`, `finish_one`, `take_batch`) are public so that plan/sim.py can drive the same
admission and batch selection on a simulated clock.
"""
from __future__ import annotations

import queue
import threading
import time
import warnings
from typing import Callable, ContextManager, Optional, Protocol, runtime_checkable

from m2po_megatron.data.prompts import PromptStream, Tokenize
from m2po_megatron.data.rows import TaskRow, task_state
from m2po_megatron.infra import trace
from m2po_megatron.rollout.groups import (  # noqa: F401  (re-exported: the generators' public names)
    GenStats, GroupMaker, LockedRewards, RoutingSpec, _answered, engine_mismatch, group_from_dict, group_to_dict,
    routing_spec)
from m2po_megatron.rollout.samples import Group, sample_ids_for


@runtime_checkable
class Generator(Protocol):
    """What the loop asks of a generator, in the order it asks. A mode with nothing to do for a verb
    (pausing a generator that only runs inside `next_groups`) does nothing."""

    def start(self) -> None:
        """Begin generating (the bounded mode's background thread); after set-up and the first evaluation."""

    def next_groups(self, version: int, timeout_s: float) -> list[Group]:
        """The next batch of groups the trainer at `version` may train on (TimeoutError, RuntimeError)."""

    def locked(self) -> ContextManager:
        """Held around ledger work and checkpoints: the generation thread writes the ledger too."""

    def pending(self) -> int:
        """Samples in flight or buffered (call inside `locked()`, so the count matches the ledger)."""

    def on_step(self, version: int, updates: int) -> None:
        """The trainer applied `updates` optimizer updates and is now at `version`."""

    def needs_sync(self) -> bool:
        """Whether the servers should get the trainer's weights after this step."""

    def pause(self) -> None:
        """Admit nothing new (while weights are pushed)."""

    def resume(self) -> None:
        """Admit again after `pause`."""

    def on_sync(self, version: int) -> None:
        """The servers now hold `version`."""

    def stats(self, since: float) -> "GenStats":
        """Reward-pool counters since the previous call and generated tokens per second since then (or
        since `since`, the start of the first step)."""

    def eval_rewards(self) -> "LockedRewards":
        """The run's reward pool for evaluation, shared with generation (one caller at a time)."""

    def state_dict(self) -> dict:
        ...

    def load_state_dict(self, s: dict) -> None:
        ...

    def close(self) -> None:
        ...


class SyncGenerator:
    """on_policy and fixed_lag: each call generates one step's groups with the servers' current weights.
    For fixed_lag the groups pass through the FixedLagQueue; warm-up iterations only generate."""

    def __init__(self, maker: GroupMaker, prompts: PromptStream, ledger, groups_per_step: int,
                 lag_queue=None, recompute_logprobs: Optional[Callable[[list[Group]], None]] = None,
                 timeout_s: float = 3600.0, max_gen_batches: Optional[int] = None):
        """max_gen_batches: train.filter_groups (None: off): drop zero-variance groups and generate the
        missing ones again, at most max_gen_batches generation rounds per batch."""
        self.maker, self.prompts, self.ledger = maker, prompts, ledger
        self.groups_per_step, self.queue, self.recompute = groups_per_step, lag_queue, recompute_logprobs
        self.max_gen_batches = max_gen_batches
        self.timeout_s = timeout_s
        self.lock = threading.Lock()  # single-threaded; the loop takes it as it does the async one's
        self.next_gid = 0
        self.warmup_iterations = 0

    def _generate_batch(self) -> list[Group]:
        """One step's groups: generated, scored, and with filter_groups on, the zero-variance ones dropped
        and replaced by new prompts, round by round, until the batch is full or the rounds are spent."""
        kept, rounds, need = [], 0, self.groups_per_step
        while True:
            groups = self._generate(need)
            rounds += 1
            if self.max_gen_batches is None:
                kept = groups
                break
            for g in groups:
                if self.maker.informative(g):
                    kept.append(g)
                else:
                    self.maker.drop_uninformative(g, self.ledger)
            need = self.groups_per_step - len(kept)
            if need <= 0 or 0 < self.max_gen_batches <= rounds:  # 0: no limit
                break
        if self.max_gen_batches is not None:
            self.maker.count_filter(kept_groups=len(kept), gen_batches=rounds)
        if self.recompute is not None and kept:  # the released code: behaviour log-probs from the trainer
            scored = _answered(s for g in kept for s in g.samples)
            engine = [list(s.policy_logprobs) for s in scored]  # the environment's tokens have no behaviour
            self.recompute(kept)
            self.maker.note_mismatch(engine_mismatch(engine, [s.policy_logprobs for s in scored]))
        return kept

    def _generate(self, count: int) -> list[Group]:
        with trace.span("generate_batch", "batch", tid="generator", groups=count):
            return self._generate_untraced(count)

    def _generate_untraced(self, count: int) -> list[Group]:
        groups = []
        for _ in range(count):
            gid = f"g{self.next_gid}"
            self.next_gid += 1
            groups.append(self.maker.new_group(gid, self.prompts.next()))
            self.ledger.add(sample_ids_for(gid, self.maker.n))
        futures = [self.maker.submit(g) for g in groups]
        deadline = time.monotonic() + self.timeout_s
        for g, f in zip(groups, futures):
            try:
                self.maker.fill(g, f.result(timeout=max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                raise TimeoutError(f"group {g.group_id}: no answer from the rollout servers within "
                                   f"{self.timeout_s:.0f} s") from None
        self.maker.score(groups)
        return groups

    def next_groups(self, version: int, timeout_s: Optional[float] = None) -> list[Group]:
        if timeout_s is not None:
            self.timeout_s = timeout_s
        while True:
            groups = self._generate_batch()
            if self.queue is None:
                return groups
            out = self.queue.step(groups, version)
            if out is not None:
                return out.payload
            self.warmup_iterations += 1

    def start(self) -> None:
        pass  # generates inside next_groups

    def locked(self) -> ContextManager:
        return self.lock

    def on_step(self, version: int, updates: int) -> None:
        pass

    def needs_sync(self) -> bool:
        return True  # synchronous modes generate with the latest weights

    def pause(self) -> None:
        pass  # nothing runs between next_groups calls

    def resume(self) -> None:
        pass

    def on_sync(self, version: int) -> None:
        pass

    def stats(self, since: float) -> GenStats:
        return self.maker.stats(since)

    def eval_rewards(self) -> LockedRewards:
        return self.maker.eval_rewards()

    def pending(self) -> int:
        if self.queue is None:
            return 0
        return sum(len(g.samples) for groups in self.queue.payloads() for g in groups)

    def state_dict(self) -> dict:
        s = {"next_gid": self.next_gid, "warmup_iterations": self.warmup_iterations}
        if self.queue is not None:
            s["queue"] = self.queue.state_dict(encode=lambda groups: [group_to_dict(g) for g in groups])
        return s

    def load_state_dict(self, s: dict) -> None:
        self.next_gid, self.warmup_iterations = s["next_gid"], s["warmup_iterations"]
        if self.queue is not None and "queue" in s:
            self.queue.load_state_dict(s["queue"], decode=lambda rows: [group_from_dict(r) for r in rows])

    def close(self) -> None:
        pass


class AsyncGenerator:
    """bounded: generation runs in a background thread while the trainer trains. Admission control
    (StalenessController) decides how many groups may be in flight; finished, scored groups wait in a
    buffer until `next_groups` takes a batch, earliest deadline first."""

    def __init__(self, maker: GroupMaker, prompts: PromptStream, ledger, controller, groups_per_step: int,
                 max_gen_batches: Optional[int] = None):
        """max_gen_batches: train.filter_groups (None: off). A zero-variance group is dropped as it
        finishes, which frees its admission slot, so the controller admits (and counts) its replacement;
        once max_gen_batches x groups_per_step groups finished since the last batch, a batch short of
        groups_per_step is taken (if the deadlines allow it)."""
        self.maker, self.prompts, self.ledger, self.ctl = maker, prompts, ledger, controller
        self.groups_per_step = groups_per_step
        self.max_gen_batches = max_gen_batches
        self.finished_since_batch = 0  # groups finished (kept or dropped) since the last batch was taken
        self.lock = threading.Condition()
        self.finished: dict[str, Group] = {}
        self.inflight: dict[str, Group] = {}
        self.discard: set[str] = set()
        self.regenerate: list[dict] = []  # prompts in flight at a checkpoint, regenerated first on resume
        self.next_gid = 0
        self.error: Optional[BaseException] = None
        self.paused = threading.Event()  # set while weights are pushed: admit nothing new
        self._done: "queue.Queue" = queue.Queue()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- background side ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="m2po-generation", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.pump()
                self.finish_one(timeout=0.05)
        except BaseException as e:  # surfaced to the trainer thread by next_groups
            with self.lock:
                self.error = e
                self.lock.notify_all()

    def pump(self) -> None:
        """Admit what the controller allows (nothing while paused) and send it; each answer lands in the
        done queue. The background thread's step, and what plan/sim.py calls on its simulated clock."""
        if not self.paused.is_set():
            for group in self._admit():
                fut = self.maker.submit(group)
                fut.add_done_callback(lambda f, g=group: self._done.put((g, f)))

    def finish_one(self, timeout: Optional[float]) -> bool:
        """Take one answered group off the done queue (waiting up to `timeout` s; 0: do not wait) and file it:
        buffered, or dropped with a counted reason. False when none came."""
        try:
            group, fut = self._done.get(timeout=timeout) if timeout else self._done.get_nowait()
        except queue.Empty:
            return False
        self._finish(group, fut.result())  # a failed request (retries exhausted) ends the run
        return True

    def _admit(self) -> list[Group]:
        with self.lock:
            out = []
            while self.ctl.capacity() > 0:
                row = self.regenerate.pop(0) if self.regenerate else self.prompts.next()
                gid = f"g{self.next_gid}"
                self.next_gid += 1
                self.ctl.try_admit([gid])
                group = self.maker.new_group(gid, row)  # keeps the row, to regenerate it after a restart
                self.inflight[gid] = group
                self.ledger.add(sample_ids_for(gid, self.maker.n))
                out.append(group)
            return out

    def _finish(self, group: Group, results) -> None:
        self.maker.fill(group, results)
        self.maker.score([group])
        with self.lock:
            gid = group.group_id
            self.inflight.pop(gid, None)
            if gid in self.discard:
                self.discard.discard(gid)
                self.ledger.drop(group.sample_ids, "too_stale")
                return
            versions = [s.min_version for s in group.samples if s.versions]
            oldest = min(versions) if versions else self.ctl.server_version
            if oldest < self.ctl.deadline(gid) - self.ctl.max_staleness:
                # Tokens older than the weights at admission: a server restarted with its base weights
                # and answered before the loop re-synced it. Not trainable within the bound: drop.
                self.ctl.on_dropped(gid)
                self.ledger.drop(group.sample_ids, "aborted")
                return
            if self.max_gen_batches is not None:
                self.finished_since_batch += 1
                if not self.maker.informative(group):
                    self.ctl.on_dropped(gid)
                    self.maker.drop_uninformative(group, self.ledger)
                    self.lock.notify_all()
                    return
                self.maker.count_filter(kept_groups=1)
            self.ctl.on_generated(gid, oldest)
            self.finished[gid] = group
            self.lock.notify_all()

    # -- trainer side --------------------------------------------------------------------------------
    def next_groups(self, version: int, timeout_s: float = 3600.0) -> list[Group]:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while True:
                groups = self.take_batch()
                if groups is not None:
                    return groups
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no batch of {self.groups_per_step} groups within {timeout_s:.0f} s; "
                                       f"are the rollout servers alive?")
                self.lock.wait(timeout=min(1.0, left))

    def take_batch(self) -> Optional[list[Group]]:
        """One look, without waiting: the batch the trainer may take now (earliest deadlines first), or None.
        Overdue groups are dropped on the way; a generation error is raised here."""
        with self.lock:
            if self.error is not None:
                raise RuntimeError(f"generation failed: {self.error!r}") from self.error
            for gid in self.ctl.overdue():  # only when a server stalled past the bound
                self.ctl.on_dropped(gid)
                if gid in self.finished:
                    self.ledger.drop(self.finished.pop(gid).sample_ids, "too_stale")
                else:  # still generating: dropped when it arrives
                    self.discard.add(gid)
            ids = self.ctl.select_batch()
            if ids is None and self._budget_spent():  # the short batch, or none: as fixed_lag, never unbounded
                ids = self.ctl.select_batch(n=len(self.finished)) if self.finished else []
            if ids is None:
                return None
            self.ctl.on_consumed(ids)
            self.finished_since_batch = 0
            return [self.finished.pop(g) for g in ids]

    def _budget_spent(self) -> bool:
        """filter_groups: this step's generation budget is used up (0: no budget) short of a batch (lock held)."""
        return (bool(self.max_gen_batches) and len(self.finished) < self.groups_per_step
                and self.finished_since_batch >= self.max_gen_batches * self.groups_per_step)

    def locked(self) -> ContextManager:
        return self.lock

    def on_step(self, version: int, updates: int) -> None:
        self.ctl.on_step(version, updates=updates)

    def needs_sync(self) -> bool:
        return self.ctl.needs_sync()

    def pause(self) -> None:
        self.paused.set()

    def resume(self) -> None:
        self.paused.clear()

    def on_sync(self, version: int) -> None:
        self.ctl.on_sync(version)

    def stats(self, since: float) -> GenStats:
        return self.maker.stats(since)

    def eval_rewards(self) -> LockedRewards:
        return self.maker.eval_rewards()

    def pending(self) -> int:
        """Samples in flight or buffered (call with `lock` held, so the count matches the ledger)."""
        return self.maker.n * len(self.inflight) + sum(len(g.samples) for g in self.finished.values())

    def state_dict(self) -> dict:
        with self.lock:
            return {"next_gid": self.next_gid, "controller": self.ctl.state_dict(),
                    "finished_since_batch": self.finished_since_batch,  # a resume filters as the run would
                    "finished": [group_to_dict(g) for g in self.finished.values()],
                    # the exact prompt tokens and the whole row: a resumed run regenerates the same prompts
                    "regenerate": [task_state(TaskRow(g.prompt_id, list(g.prompt_ids), "", g.row or {},
                                                      g.answer or None)) for g in self.inflight.values()]
                                  + self.regenerate,
                    "inflight_ids": [s for g in self.inflight.values()
                                     for s in sample_ids_for(g.group_id, self.maker.n)]}

    def load_state_dict(self, s: dict) -> None:
        """Buffered groups come back as they were; groups that were in flight are dropped as
        `interrupted` (counted) and their prompts regenerated first, under new ids."""
        self.ctl.load_state_dict(s["controller"])
        self.next_gid = s["next_gid"]
        self.finished_since_batch = int(s.get("finished_since_batch", 0))  # absent in older checkpoints
        for d in s["finished"]:
            g = group_from_dict(d)
            self.finished[g.group_id] = g
        if s["inflight_ids"]:
            self.ledger.drop(s["inflight_ids"], "interrupted")
        for gid in self.ctl.running():
            self.ctl.on_dropped(gid)
        self.regenerate = list(s["regenerate"])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def make_generator(cfg, client, rewards, tokenizer, prompts: PromptStream, ledger, trainers) -> Generator:
    """The generator of cfg.staleness.mode; `trainers` recompute behaviour log-probs when
    staleness.behav_logprob_source = trainer."""
    from m2po_megatron.agents.runner import runner_for, sampling_params
    from m2po_megatron.staleness import FixedLagQueue, StalenessController

    r, s, t = cfg.rollout, cfg.staleness, cfg.train
    budget = t.filter_groups.max_num_gen_batches if t.filter_groups.enable else None
    if budget == 0:
        warnings.warn("train.filter_groups.max_num_gen_batches = 0: no limit (verl's meaning); a step waits until "
                      f"it has {t.prompts_per_step} groups whose {t.filter_groups.metric} varies, however many "
                      "generation batches that takes", stacklevel=2)
    routing = routing_spec(cfg)
    maker = GroupMaker(client, rewards, tokenizer, Tokenize(tokenizer, cfg.data.max_prompt_len),
                       sampling_params(cfg), n=r.n_samples_per_prompt, seed=cfg.run.seed,
                       filter_metric=t.filter_groups.metric, routing=routing,
                       runner=runner_for(cfg, tokenizer, score=lambda *a: maker.score_one(*a),
                                         routed_experts=routing is not None))
    if s.mode == "bounded":
        ctl = StalenessController(s.max_staleness, groups_per_step=t.prompts_per_step,
                                  updates_per_step=t.updates_per_step, sync_interval=s.sync_interval)
        return AsyncGenerator(maker, prompts, ledger, ctl, t.prompts_per_step, max_gen_batches=budget)
    lag = FixedLagQueue(s.lag_steps, t.updates_per_step) if s.mode == "fixed_lag" else None
    recompute = trainers.recompute_behaviour_logprobs if s.behav_logprob_source == "trainer" else None
    return SyncGenerator(maker, prompts, ledger, t.prompts_per_step, lag, recompute, max_gen_batches=budget)
