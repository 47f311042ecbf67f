"""Where the trainer's groups come from: generation through the rollout client, rewards, and the staleness
policy that decides which groups may be generated and trained. The loop sees one interface, `Generator`:

- `SyncGenerator` (on_policy, fixed_lag): generates a step's groups with the current weights, then (for
  fixed_lag) passes them through the FIFO of the released code's simulation.
- `AsyncGenerator` (bounded): a background thread keeps the servers busy with groups admitted by the
  StalenessController; the trainer takes finished groups earliest-deadline first.
Every sample is registered in the SampleLedger when its group is admitted, so in-flight samples count as
pending and the identity generated = consumed + dropped + pending always holds. The prompts come from
data.prompts (PromptStream, Tokenize).
"""
from __future__ import annotations

import queue
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Protocol, runtime_checkable

from m2po_megatron.data.prompts import PromptStream, Tokenize
from m2po_megatron.rollout.samples import Group, Sample, sample_ids_for


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


@dataclass
class GenStats:
    rewards: dict  # reward-pool counters since the previous call (timeouts, errors, verdicts)
    tokens_per_s: float  # generated tokens per second of wall time since then (all servers together)
    extra: dict = field(default_factory=dict)  # filter_groups/* since then, the last engine_mismatch/*


class LockedRewards:
    """The run's reward pool, shared with the generation thread (one caller at a time)."""

    def __init__(self, pool, lock):
        self.pool, self.lock = pool, lock

    def score(self, responses, answers):
        with self.lock:
            return self.pool.score(responses, answers)


class GroupMaker:
    """Sends one prompt group to the rollout client and scores it. Shared by both generators. The client
    is a SyncRolloutClient (its own event loop thread); `submit` returns a concurrent Future."""

    def __init__(self, client, rewards, tokenizer, tokenize: Tokenize, sampling: dict, n: int, seed: int):
        self.client, self.rewards, self.tok, self.tokenize = client, rewards, tokenizer, tokenize
        self.sampling, self.n, self.seed = sampling, n, seed
        self.reward_lock = threading.Lock()  # the reward pool serves one caller at a time
        self.reward_stats: dict = {}
        self.gen_tokens = 0
        self._tp_mark: Optional[tuple[float, int]] = None  # (time, gen_tokens) at the previous stats()
        self.filter_counts: Counter = Counter()  # train.filter_groups: kept / dropped groups, generation rounds
        self.mismatch: dict = {}  # engine_mismatch/* of the last recomputed batch (behav_logprob_source=trainer)

    def new_group(self, gid: str, row: dict) -> Group:
        return Group(group_id=gid, prompt_id=str(row["id"]), prompt_ids=self.tokenize(row["prompt"]),
                     answer=str(row["answer"]))

    def submit(self, group: Group):
        # A per-group seed makes sampling reproducible (fixed_lag resume equality) and independent of
        # which other requests a server happens to batch with.
        seed = zlib.crc32(f"{self.seed}/{group.group_id}".encode()) & 0x7FFFFFFF
        return self.client.submit(group.prompt_ids, dict(self.sampling, sampling_seed=seed), n=self.n)

    def fill(self, group: Group, results) -> Group:
        group.samples = [
            Sample(sample_id=sid, group_id=group.group_id, prompt_ids=group.prompt_ids,
                   output_ids=list(o.output_ids), logprobs=list(o.output_logprobs),
                   versions=[int(v) for v in o.token_versions], finish_reason=o.finish_reason,
                   answer=group.answer)
            for sid, o in zip(sample_ids_for(group.group_id, self.n), results)
        ]
        self.gen_tokens += sum(len(s.output_ids) for s in group.samples)
        return group

    def score(self, groups: list[Group]) -> None:
        samples = [s for g in groups for s in g.samples if s.finish_reason != "abort"]
        for s in samples:
            s.text = self.tok.decode(s.output_ids, skip_special_tokens=True)
        with self.reward_lock:
            scores, stats = self.rewards.score([s.text for s in samples], [s.answer for s in samples])
            for k, v in stats.as_dict().items():
                self.reward_stats[k] = self.reward_stats.get(k, 0) + v
        for s, r in zip(samples, scores):
            s.reward = float(r)

    @staticmethod
    def informative(group: Group) -> bool:
        """False when the rewards of the group's scored samples are all equal (GRPO's advantages are then
        all 0); groups with fewer than two scored samples are kept (build_step_batch decides on them)."""
        r = [s.reward for s in _answered(group.samples) if s.reward is not None]
        return len(r) < 2 or max(r) != min(r)

    def drop_uninformative(self, group: Group, ledger) -> None:
        ledger.drop(group.sample_ids, "zero_variance")
        self.count_filter(dropped_groups=1)

    def count_filter(self, **counts: int) -> None:
        with self.reward_lock:  # stats() swaps the counters under it, from the loop's thread
            self.filter_counts.update(counts)

    def stats(self, since: float) -> GenStats:
        with self.reward_lock:
            rewards, self.reward_stats = self.reward_stats, {}
            counts, self.filter_counts = self.filter_counts, Counter()
            mismatch, self.mismatch = self.mismatch, {}
        now, tokens = time.perf_counter(), self.gen_tokens
        last_t, last_tokens = self._tp_mark or (since, 0)
        self._tp_mark = (now, tokens)
        seen = counts["kept_groups"] + counts["dropped_groups"]
        filt = {f"filter_groups/{k}": v for k, v in counts.items()}
        if seen:
            filt["filter_groups/dropped_frac"] = counts["dropped_groups"] / seen
        return GenStats(rewards, (tokens - last_tokens) / max(now - last_t, 1e-9), {**filt, **mismatch})

    def note_mismatch(self, metrics: dict) -> None:
        with self.reward_lock:
            self.mismatch = dict(metrics)

    def eval_rewards(self) -> LockedRewards:
        return LockedRewards(self.rewards, self.reward_lock)


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
            if need <= 0 or rounds >= self.max_gen_batches:
                break
        if self.max_gen_batches is not None:
            self.maker.count_filter(kept_groups=len(kept), gen_batches=rounds)
        if self.recompute is not None and kept:  # the released code: behaviour log-probs from the trainer
            scored = _answered(s for g in kept for s in g.samples)
            engine = [list(s.logprobs) for s in scored]
            self.recompute(kept)
            self.maker.note_mismatch(engine_mismatch(engine, [s.logprobs for s in scored]))
        return kept

    def _generate(self, count: int) -> list[Group]:
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
                if not self.paused.is_set():
                    for group in self._admit():
                        fut = self.maker.submit(group)
                        fut.add_done_callback(lambda f, g=group: self._done.put((g, f)))
                try:
                    group, fut = self._done.get(timeout=0.05)
                except queue.Empty:
                    continue
                self._finish(group, fut.result())  # a failed request (retries exhausted) ends the run
        except BaseException as e:  # surfaced to the trainer thread by next_groups
            with self.lock:
                self.error = e
                self.lock.notify_all()

    def _admit(self) -> list[Group]:
        with self.lock:
            out = []
            while self.ctl.capacity() > 0:
                row = self.regenerate.pop(0) if self.regenerate else self.prompts.next()
                gid = f"g{self.next_gid}"
                self.next_gid += 1
                self.ctl.try_admit([gid])
                group = self.maker.new_group(gid, row)
                group.row = row  # kept to regenerate it after a restart
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
                if self.error is not None:
                    raise RuntimeError(f"generation failed: {self.error!r}") from self.error
                for gid in self.ctl.overdue():  # only when a server stalled past the bound
                    self.ctl.on_dropped(gid)
                    if gid in self.finished:
                        self.ledger.drop(self.finished.pop(gid).sample_ids, "too_stale")
                    else:  # still generating: dropped when it arrives
                        self.discard.add(gid)
                ids = self.ctl.select_batch()
                if ids is None and self._budget_spent():
                    ids = self.ctl.select_batch(n=len(self.finished))
                if ids is not None:
                    self.ctl.on_consumed(ids)
                    self.finished_since_batch = 0
                    return [self.finished.pop(g) for g in ids]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no batch of {self.groups_per_step} groups within {timeout_s:.0f} s; "
                                       f"are the rollout servers alive?")
                self.lock.wait(timeout=min(1.0, left))

    def _budget_spent(self) -> bool:
        """filter_groups: this step's generation budget is used up and some groups wait (lock held)."""
        return (self.max_gen_batches is not None and 0 < len(self.finished) < self.groups_per_step
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
                    "finished": [group_to_dict(g) for g in self.finished.values()],
                    "regenerate": [g.row for g in self.inflight.values()] + self.regenerate,
                    "inflight_ids": [s for g in self.inflight.values()
                                     for s in sample_ids_for(g.group_id, self.maker.n)]}

    def load_state_dict(self, s: dict) -> None:
        """Buffered groups come back as they were; groups that were in flight are dropped as
        `interrupted` (counted) and their prompts regenerated first, under new ids."""
        self.ctl.load_state_dict(s["controller"])
        self.next_gid = s["next_gid"]
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


def _answered(samples) -> list[Sample]:
    """Samples with output that was not aborted: the ones scored, recomputed and trained on."""
    return [s for s in samples if s.output_ids and s.finish_reason != "abort"]


def engine_mismatch(engine: list[list[float]], trainer: list[list[float]]) -> dict:
    """engine_mismatch/*: KL(engine || trainer) k1 and k3 and the quantiles of trainer/engine over the tokens
    of samples whose behaviour log-probs the trainer recomputed at the generating weights (equal weights,
    so this is the engine's part of the mismatch alone; the staleness part is then rollout_corr/* of a
    three-policy step). Empty when the engine returned no log-probs to compare."""
    import torch

    from m2po_megatron.algo import rollout_correction as rc

    if not engine or [len(x) for x in engine] != [len(x) for x in trainer]:
        return {}
    e = torch.tensor([x for lp in engine for x in lp], dtype=torch.float32)
    t = torch.tensor([x for lp in trainer for x in lp], dtype=torch.float32)
    if not e.numel():
        return {}
    c = rc.rollout_correction(t, e, torch.ones_like(t, dtype=torch.bool), rc.CorrectionSpec())
    return {k.replace("rollout_corr/", "engine_mismatch/"): v for k, v in rc.read_stats([c.stats])[0].items()
            if k.split("/")[1].startswith(("kl_", "ratio_"))}


def group_to_dict(g: Group) -> dict:
    return {"group_id": g.group_id, "prompt_id": g.prompt_id, "prompt_ids": g.prompt_ids, "answer": g.answer,
            "samples": [s.__dict__ for s in g.samples]}


def group_from_dict(d: dict) -> Group:
    return Group(group_id=d["group_id"], prompt_id=d["prompt_id"], prompt_ids=list(d["prompt_ids"]),
                 answer=d["answer"], samples=[Sample(**s) for s in d["samples"]])



def rollout_sampling(cfg) -> dict:
    """SGLang sampling_params of every training request (the generator adds the per-group seed)."""
    r = cfg.rollout
    return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "max_new_tokens": r.max_new_tokens}


def make_generator(cfg, client, rewards, tokenizer, prompts: PromptStream, ledger, trainers) -> Generator:
    """The generator of cfg.staleness.mode; `trainers` recompute behaviour log-probs when
    staleness.behav_logprob_source = trainer."""
    from m2po_megatron.staleness import FixedLagQueue, StalenessController

    r, s, t = cfg.rollout, cfg.staleness, cfg.train
    budget = t.filter_groups.max_num_gen_batches if t.filter_groups.enable else None
    maker = GroupMaker(client, rewards, tokenizer, Tokenize(tokenizer, cfg.data.max_prompt_len),
                       rollout_sampling(cfg), n=r.n_samples_per_prompt, seed=cfg.run.seed)
    if s.mode == "bounded":
        ctl = StalenessController(s.max_staleness, groups_per_step=t.prompts_per_step,
                                  updates_per_step=t.updates_per_step, sync_interval=s.sync_interval)
        return AsyncGenerator(maker, prompts, ledger, ctl, t.prompts_per_step, max_gen_batches=budget)
    lag = FixedLagQueue(s.lag_steps, t.updates_per_step) if s.mode == "fixed_lag" else None
    recompute = trainers.recompute_behaviour_logprobs if s.behav_logprob_source == "trainer" else None
    return SyncGenerator(maker, prompts, ledger, t.prompts_per_step, lag, recompute, max_gen_batches=budget)
