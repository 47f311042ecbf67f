"""Rollout samples and the step batch built from them: advantages, staleness gating and the ledger.

Pure Python + torch (no Ray, no HTTP, no Megatron), so every rule here is testable alone. A sample is
created once by generation, scored once, and then consumed by exactly one training step or dropped with a
counted reason (see staleness.SampleLedger)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from m2po_megatron.actor.batch import TrainBatch
from m2po_megatron.algo import grpo_advantages


@dataclass
class Sample:
    sample_id: str
    group_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # behaviour log-probs, one per output token
    versions: list[int]  # weight version that generated each output token
    finish_reason: str  # stop | length | abort
    answer: str = ""
    reward: Optional[float] = None
    text: str = ""
    # algo.routing_replay = r3 on a MoE model: the rollout engine's top-k expert ids of every fed position of
    # prompt + output (all but the last output token), numpy [len(prompt_ids) + len(output_ids) - 1,
    # num_layers, top_k], int16 (int32 past 32767 experts); None otherwise (rollout/routing.py).
    routed_experts: Optional[Any] = None
    routing_problem: Optional[str] = None  # why the engine's routing data was unusable (dropped: bad_routing)
    # A rollout function's sample (agents/runner.py): 1 on the policy's tokens, 0 on the environment's (their
    # log-prob 0.0 and version -1 are never read); None: every output token is the policy's.
    loss_mask: Optional[list[int]] = None
    rollout_problem: Optional[str] = None  # why the rollout function's result was unusable (dropped: bad_rollout)
    reward_problem: Optional[str] = None  # a reward term failed and reward.on_error = drop (dropped: reward_error)
    metadata: dict = field(default_factory=dict)  # the rollout function's, kept with the sample

    def policy(self, values: list) -> list:
        """The entries of `values` (one per output token) at the policy's tokens (the environment's dropped)."""
        return values if self.loss_mask is None else [v for v, m in zip(values, self.loss_mask) if m]

    @property
    def policy_versions(self) -> list[int]:
        """The weight version of each of the policy's tokens (the environment's have none)."""
        return self.policy(self.versions)

    @property
    def min_version(self) -> int:
        """The version of the oldest policy token: the sample's staleness is measured from it."""
        v = self.policy_versions
        return min(v) if v else -1

    @property
    def policy_logprobs(self) -> list[float]:
        return self.policy(self.logprobs)

    @property
    def policy_ids(self) -> list[int]:
        return self.policy(self.output_ids)


@dataclass
class Group:
    """The n samples of one prompt (a GRPO group)."""

    group_id: str
    prompt_id: str
    prompt_ids: list[int]
    answer: str
    samples: list[Sample] = field(default_factory=list)
    row: Optional[dict] = None  # the data row (a rollout function's ctx.row; regenerated after a restart)

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self.samples]


def _unusable(s: Sample) -> Optional[str]:
    """The ledger reason a sample is never trained on, whatever its staleness (None: usable)."""
    if s.finish_reason == "abort":
        return "aborted"
    if s.rollout_problem is not None:
        return "bad_rollout"
    if not s.output_ids:
        return "filtered"
    if s.routing_problem is not None:
        return "bad_routing"
    if s.reward_problem is not None:
        return "reward_error"
    return None


def routed_rows(s: Sample) -> Optional[torch.Tensor]:
    """TrainBatch.routed_experts of one sample: one row per input token (prompt + output), the engine's
    experts of every fed position and -1 (no record: the trainer's router chooses) for the last token, which
    the engine sampled but never fed; its output is no log-prob of the loss."""
    if s.routed_experts is None:
        return None
    r = torch.from_numpy(s.routed_experts)  # int16 (int32 past 32767 experts): 2 bytes x layers x k per token
    return torch.cat([r, torch.full((1, *r.shape[1:]), -1, dtype=r.dtype)])


def sample_ids_for(group_id: str, n: int) -> list[str]:
    return [f"{group_id}/{i}" for i in range(n)]


@dataclass
class StepBatch:
    batch: Optional[TrainBatch]
    samples: list[Sample]
    metrics: dict


def build_step_batch(groups: Sequence[Group], version: int, ledger, *, max_staleness: Optional[int] = None,
                     drop_too_stale: bool = True, norm_by_std: bool = True, eps: float = 1e-6,
                     overlong_filtering: bool = False) -> StepBatch:
    """Turn scored groups into the trainer's batch at trainer `version`.

    Drops (recorded in the ledger with a reason): aborted samples (`aborted`), a rollout function's unusable
    results (`bad_rollout`, agents/runner.py), samples with no output tokens (`filtered`), samples whose
    routing-replay data was unusable (`bad_routing`, see
    rollout/routing.py), and, when `drop_too_stale`, samples whose oldest token is more than
    `max_staleness` updates behind (`too_stale`). Advantages are group-normalised over the samples that
    remain, so a dropped sample never shifts its siblings' baseline by a reward that is not trained on.

    `overlong_filtering` (DAPO; NeMo-RL's overlong_filtering): a truncated sample (finish reason `length`) keeps
    its reward in its group's baseline but is masked from the loss: it is left out of the trainer's batch, which
    is what an all-zero loss mask would contribute, consumed in the ledger and counted (overlong/filtered)."""
    keep: list[Sample] = []
    stale_drops: list[str] = []
    future = 0
    for g in groups:
        for s in g.samples:  # versions a rollout function made up: the ledger would refuse them
            if _unusable(s) is None and s.policy_versions and max(s.policy_versions) > version:
                s.rollout_problem, future = "missing_versions", future + 1
        for reason in ("aborted", "bad_rollout", "filtered", "bad_routing", "reward_error"):
            ids = [s.sample_id for s in g.samples if _unusable(s) == reason]
            if ids:
                ledger.drop(ids, reason)
        for s in g.samples:
            if _unusable(s):
                continue
            if s.reward is None:
                raise ValueError(f"sample {s.sample_id} reached the batch without a reward")
            if max_staleness is not None and drop_too_stale and version - s.min_version > max_staleness:
                stale_drops.append(s.sample_id)
                continue
            keep.append(s)
    if stale_drops:
        ledger.drop(stale_drops, "too_stale")

    metrics: dict = {"samples/dropped_this_step": len(stale_drops) + sum(
        1 for g in groups for s in g.samples if _unusable(s))}
    if future:
        metrics["rollout_fn/dropped/future_versions"] = future
    if not keep:
        return StepBatch(None, [], metrics)

    rewards = torch.tensor([float(s.reward) for s in keep])
    gids = {gid: i for i, gid in enumerate(dict.fromkeys(s.group_id for s in keep))}
    group_index = torch.tensor([gids[s.group_id] for s in keep])
    adv = grpo_advantages(rewards, group_ids=group_index, norm_by_std=norm_by_std, eps=eps)

    ledger.consume([s.sample_id for s in keep], version, [list(s.policy_versions) for s in keep])
    if overlong_filtering:
        trained = [i for i, s in enumerate(keep) if s.finish_reason != "length"]
        metrics["overlong/filtered"] = len(keep) - len(trained)
        if not trained:
            metrics.update({"reward/mean": float(rewards.mean()), "reward/max": float(rewards.max())})
            return StepBatch(None, [], metrics)
        scored, keep, adv = rewards, [keep[i] for i in trained], adv[trained]
    else:
        scored = rewards
    routed = {"routed_experts": [routed_rows(s) for s in keep]} if any(
        s.routed_experts is not None for s in keep) else {}  # R3 only: a dense run's batch is unchanged
    masked = any(s.loss_mask is not None and not all(s.loss_mask) for s in keep)
    batch = TrainBatch(
        input_ids=[torch.tensor(s.prompt_ids + s.output_ids, dtype=torch.long) for s in keep],
        prompt_lens=[len(s.prompt_ids) for s in keep],
        behav_log_probs=[torch.tensor(s.logprobs, dtype=torch.float32) for s in keep],
        advantages=adv.float(),
        # environment tokens inside responses only: a batch of the policy's tokens alone is as before
        **({"loss_mask": [torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * len(s.output_ids),
                                       dtype=torch.bool) for s in keep]} if masked else {}),
        **routed,
    )
    lengths = [len(s.output_ids) for s in keep]
    policy = [len(s.policy_ids) for s in keep]
    metrics.update({
        "reward/mean": float(scored.mean()),  # every scored sample of the step, filtered ones too
        "reward/max": float(scored.max()),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": max(lengths),
        "response_length/std": (sum((x - sum(lengths) / len(lengths)) ** 2 for x in lengths) / len(lengths)) ** 0.5,
        "response/truncated_frac": sum(s.finish_reason == "length" for s in keep) / len(keep),
        "advantage/abs_mean": float(adv.abs().mean()),
        "batch/sequences": len(keep),
        "batch/tokens": sum(lengths) + sum(len(s.prompt_ids) for s in keep),
        **({"batch/policy_tokens": sum(policy), "response/env_token_frac": 1 - sum(policy) / max(sum(lengths), 1)}
           if masked else {}),
    })
    return StepBatch(batch, keep, metrics)
