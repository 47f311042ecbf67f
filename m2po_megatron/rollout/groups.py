"""Making prompt groups: one group's request to the rollout client, its samples filled from the answers,
scored by the reward pool, and judged informative or not (train.filter_groups). Shared by every generator
(rollout/generators.py), and the counters they report per step."""
from __future__ import annotations

import functools
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from m2po_megatron.agents.runner import Episode
from m2po_megatron.agents.types import RolloutResult
from m2po_megatron.data.prompts import Tokenize
from m2po_megatron.data.rows import as_task
from m2po_megatron.infra import trace
from m2po_megatron.reward.types import RewardInput
from m2po_megatron.rollout import routing as rr
from m2po_megatron.rollout.samples import Group, Sample, sample_ids_for


@dataclass(frozen=True)
class RoutingSpec:
    """algo.routing_replay = r3 on a MoE model: what the engine's routed experts must look like."""
    num_layers: int
    topk: int
    num_experts: int


def routing_spec(cfg) -> Optional[RoutingSpec]:
    """The routed experts to request from the rollout engine: only for algo.routing_replay = r3 on a MoE
    model (r2 replays the trainer's own routing; a dense model has none)."""
    if getattr(cfg.algo, "routing_replay", "none") != "r3":
        return None
    from m2po_megatron.models.hf_config import read_hf_config

    spec = read_hf_config(cfg.model.hf_path or cfg.model.hf_config)  # the planner's recipes name hf_config only
    if not spec.is_moe:
        return None
    return RoutingSpec(spec.num_layers, spec.num_experts_per_tok, spec.num_experts)


@dataclass
class GenStats:
    rewards: dict  # reward/* since the previous call (counters, failures, the means of the terms' extras)
    tokens_per_s: float  # generated tokens per second of wall time since then (all servers together)
    extra: dict = field(default_factory=dict)  # filter_groups/* since then, the last engine_mismatch/*


class LockedRewards:
    """The run's reward, shared with the generation thread (one caller at a time). Evaluation scores through
    it without touching the training counters."""

    def __init__(self, rewards, lock):
        self.rewards, self.lock = rewards, lock

    def score(self, items):
        with self.lock:
            return self.rewards.score(items, record=False)


class GroupMaker:
    """Sends one prompt group to the rollout client and scores it. Shared by both generators. The client
    is a SyncRolloutClient (its own event loop thread); `submit` returns a concurrent Future."""

    def __init__(self, client, rewards, tokenizer, tokenize: Tokenize, sampling: dict, n: int, seed: int,
                 filter_metric: str = "acc", routing: Optional[RoutingSpec] = None, runner=None):
        """routing: request the engine's routed experts and attach them to each sample (R3); a sample whose
        data is unusable is marked (dropped as bad_routing by build_step_batch) and counted per problem.
        runner: the recipe's rollout function (agents/runner.py); None: the built-in single_turn."""
        self.client, self.rewards, self.tok, self.tokenize = client, rewards, tokenizer, tokenize
        self.routing = routing
        self.routing_counts: Counter = Counter()  # routing/dropped/<problem> since the last stats()
        self.routing_seen = False  # some answer carried routed experts (else a missing key is a set-up error)
        self.filter_metric = filter_metric  # train.filter_groups.metric: what must vary within a kept group
        self.sampling, self.n, self.seed = sampling, n, seed
        self.reward_lock = threading.Lock()  # the reward pool serves one caller at a time
        self.gen_tokens = 0
        self._tp_mark: Optional[tuple[float, int]] = None  # (time, gen_tokens) at the previous stats()
        self.filter_counts: Counter = Counter()  # train.filter_groups: kept / dropped groups, generation rounds
        self.mismatch: dict = {}  # engine_mismatch/* of the last recomputed batch (behav_logprob_source=trainer)
        if runner is None:
            from m2po_megatron.agents.runner import RolloutRunner
            from m2po_megatron.agents.single_turn import rollout

            runner = RolloutRunner(rollout, "single_turn", tokenizer=tokenizer, sampling=sampling, n=n,
                                   timeout_s=None, score=self.score_one, routed_experts=routing is not None)
        self.runner = runner
        # a missing routing map is a set-up error for the built-in rollout; a plug-in's is its own (counted)
        self.strict_routing = runner.name == "single_turn"

    def new_group(self, gid: str, task) -> Group:
        """task: a TaskRow (data/rows.py); a checkpoint's regenerated prompt may be its saved form (as_task)."""
        task = as_task(task, self.tokenize)
        return Group(group_id=gid, prompt_id=task.id, prompt_ids=task.prompt_ids, answer=task.label or "",
                     row=task.row)

    def group_seed(self, group: Group) -> int:
        # A per-group seed makes sampling reproducible (fixed_lag resume equality) and independent of
        # which other requests a server happens to batch with.
        return zlib.crc32(f"{self.seed}/{group.group_id}".encode()) & 0x7FFFFFFF

    def submit(self, group: Group):
        """The group's episodes: the rollout function awaited on the client's loop; a Future of n Episodes."""
        row = group.row if group.row is not None else {"id": group.prompt_id, "answer": group.answer}
        fut = self.client.run(functools.partial(self.runner.run_group, row=row, prompt_ids=list(group.prompt_ids),
                                                seed=self.group_seed(group), group_id=group.group_id))
        fut.add_done_callback(functools.partial(_trace_request, group.group_id, time.perf_counter()))
        return fut

    def fill(self, group: Group, results) -> Group:
        """The group's samples from its n Episodes (or the client's SampleResults, as single_turn returns them)."""
        eps = [as_episode(r) for r in results]
        group.samples = [sample_of(ep, sid, group) for sid, ep in zip(sample_ids_for(group.group_id, self.n), eps)]
        if self.routing is not None:
            for s, ep in zip(group.samples, eps):
                if ep.result is not None:
                    self._attach_routing(s, ep.result.routed_experts)
        self.gen_tokens += sum(len(s.output_ids) for s in group.samples)
        return group

    def _attach_routing(self, s: Sample, b64: Optional[str]) -> None:
        """Decode and check the engine's routed experts of one sample (aborted or empty samples are dropped
        for that reason anyway, and SGLang sends none for an abort)."""
        if s.finish_reason == "abort" or not s.output_ids:
            return
        r = self.routing
        arr, problem = rr.parse(b64, num_layers=r.num_layers, topk=r.topk, num_experts=r.num_experts,
                                num_tokens=rr.expected_rows(len(s.prompt_ids), len(s.output_ids)))
        if problem == "routing_missing" and not self.routing_seen and self.strict_routing:
            raise RuntimeError("algo.routing_replay=r3 but the rollout server answered without "
                               "meta_info.routed_experts: start SGLang with --enable-return-routed-experts (the "
                               "launcher adds it for a MoE model; servers given by rollout.urls need it too)")
        self.routing_seen = self.routing_seen or b64 is not None
        s.routed_experts, s.routing_problem = arr, problem
        if problem is not None:
            with self.reward_lock:  # stats() swaps the counters under it
                self.routing_counts[problem] += 1

    def score(self, groups: list[Group]) -> None:
        """The recipe's reward of each usable sample's text (its policy tokens; the environment's are not the
        policy's answer), unless the rollout function gave the reward. A sample whose reward failed under
        reward.on_error = drop keeps no reward and is dropped (reward_error) by build_step_batch."""
        todo = []
        for g in groups:
            usable = [s for s in g.samples if s.finish_reason != "abort" and s.rollout_problem is None]
            for s in usable:
                s.text = self.tok.decode(s.policy_ids, skip_special_tokens=True)
            usable = [s for s in usable if s.reward is None]
            if usable:
                row = group_row(g)
                prompt = self.tok.decode(g.prompt_ids) if self.rewards.needs_prompt else ""
                todo += [(s, RewardInput(s.text, s.policy_ids, row, prompt, s.finish_reason)) for s in usable]
        if not todo:
            return
        with self.reward_lock:
            scored = self.rewards.score([item for _, item in todo])
        for (s, _), r in zip(todo, scored):
            s.reward = r.score
            if r.score is None:
                s.reward_problem = r.failed

    def score_one(self, text: str, row: dict, token_ids: Optional[list] = None) -> float:
        """ctx.reward of a rollout function: the recipe's reward, counted with the rest (blocking). A failed
        term scores reward.error_score here (the function decides what to do with its episode)."""
        ids = list(token_ids) if token_ids is not None else self.tok(text, add_special_tokens=False)["input_ids"]
        with self.reward_lock:
            (r,) = self.rewards.score([RewardInput(text, ids, row)])
        return float(r.score) if r.score is not None else self.rewards.error_score

    def informative(self, group: Group) -> bool:
        return informative(group, self.filter_metric)

    def drop_uninformative(self, group: Group, ledger) -> None:
        ledger.drop(group.sample_ids, "zero_variance")
        self.count_filter(dropped_groups=1)

    def count_filter(self, **counts: int) -> None:
        with self.reward_lock:  # stats() swaps the counters under it, from the loop's thread
            self.filter_counts.update(counts)

    def stats(self, since: float) -> GenStats:
        rewards = self.rewards.stats() if self.rewards is not None else {}
        with self.reward_lock:
            counts, self.filter_counts = self.filter_counts, Counter()
            mismatch, self.mismatch = self.mismatch, {}
            bad_routing, self.routing_counts = self.routing_counts, Counter()
        now, tokens = time.perf_counter(), self.gen_tokens
        last_t, last_tokens = self._tp_mark or (since, 0)
        self._tp_mark = (now, tokens)
        seen = counts["kept_groups"] + counts["dropped_groups"]
        filt = {f"filter_groups/{k}": v for k, v in counts.items()}
        if seen:
            filt["filter_groups/dropped_frac"] = counts["dropped_groups"] / seen
        routing = {f"routing/dropped/{k}": v for k, v in bad_routing.items()}
        return GenStats(rewards, (tokens - last_tokens) / max(now - last_t, 1e-9),
                        {**filt, **mismatch, **routing, **self.runner.stats()})

    def note_mismatch(self, metrics: dict) -> None:
        with self.reward_lock:
            self.mismatch = dict(metrics)

    def eval_rewards(self) -> LockedRewards:
        return LockedRewards(self.rewards, self.reward_lock)


FILTER_METRICS = ("acc", "seq_reward")  # verl's algorithm.filter_groups.metric names


def informative(group: Group, metric: str = "acc") -> bool:
    """False when the metric is equal over the group's scored samples, as verl's filter_groups decides:
    "acc" (1 for a correct answer, reward 1.0, else 0) or "seq_reward" (the reward itself, format_score
    included). Groups with fewer than two scored samples are kept (build_step_batch decides on them)."""
    if metric not in FILTER_METRICS:
        raise ValueError(f"train.filter_groups.metric must be one of {FILTER_METRICS}, got {metric!r}")
    r = [s.reward for s in _answered(group.samples) if s.reward is not None]
    if metric == "acc":
        r = [1.0 if x >= 1.0 else 0.0 for x in r]
    return len(r) < 2 or max(r) != min(r)


def _trace_request(gid: str, t0: float, fut) -> None:
    """The run timeline's span of one group's request, on its server's row (a failed one on "failed")."""
    t1 = time.perf_counter()
    if fut.cancelled() or fut.exception() is not None:
        trace.complete("generate", "request", t0, t1, tid="failed", args={"group": gid})
        return
    eps = [as_episode(r) for r in fut.result()]
    tokens = sum(len(e.result.token_ids) for e in eps if e.result is not None)
    trace.complete("generate", "request", t0, t1, tid=(eps[0].server or "server") if eps else "server",
                   args={"group": gid, "n": len(eps), "tokens": tokens})


def group_row(g: Group) -> dict:
    """The group's data row (every field of it); a group restored from an older checkpoint kept only its id and
    answer."""
    return g.row if g.row is not None else {"id": g.prompt_id, "answer": g.answer}


def _answered(samples) -> list[Sample]:
    """Samples with output that was not aborted (nor unusable routing data or rollout results): the ones
    recomputed and trained on."""
    return [s for s in samples if s.output_ids and s.finish_reason != "abort" and s.routing_problem is None
            and s.rollout_problem is None]


def as_episode(o) -> Episode:
    """An Episode as is; a client SampleResult (one engine sample, all of it the policy's) as one."""
    if isinstance(o, Episode):
        return o
    return Episode(RolloutResult(token_ids=list(o.output_ids), loss_mask=[1] * len(o.output_ids),
                                 logprobs=list(o.output_logprobs), versions=[int(v) for v in o.token_versions],
                                 finish_reason=o.finish_reason, routed_experts=getattr(o, "routed_experts", None)),
                   server=getattr(o, "server", ""))


def sample_of(ep: Episode, sid: str, group: Group) -> Sample:
    if ep.result is None:  # dropped as bad_rollout by build_step_batch; why, in its metadata
        return Sample(sample_id=sid, group_id=group.group_id, prompt_ids=group.prompt_ids, output_ids=[], logprobs=[],
                      versions=[], finish_reason="stop", answer=group.answer, rollout_problem=ep.problem,
                      metadata={"problem": ep.detail})
    r = ep.result
    return Sample(sample_id=sid, group_id=group.group_id, prompt_ids=group.prompt_ids, output_ids=list(r.token_ids),
                  logprobs=list(r.logprobs), versions=list(r.versions), finish_reason=r.finish_reason,
                  answer=group.answer, reward=r.reward, loss_mask=None if all(r.loss_mask) else list(r.loss_mask),
                  metadata=dict(r.metadata))


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
    """JSON-safe (run checkpoints): routed experts as {dtype, shape, b64} (routing.to_state)."""
    return {"group_id": g.group_id, "prompt_id": g.prompt_id, "prompt_ids": g.prompt_ids, "answer": g.answer,
            "samples": [dict(s.__dict__, routed_experts=rr.to_state(s.routed_experts)) for s in g.samples]}


def group_from_dict(d: dict) -> Group:
    return Group(group_id=d["group_id"], prompt_id=d["prompt_id"], prompt_ids=list(d["prompt_ids"]),
                 answer=d["answer"], samples=[Sample(**dict(s, routed_experts=rr.from_state(s.get("routed_experts"))))
                                              for s in d["samples"]])
