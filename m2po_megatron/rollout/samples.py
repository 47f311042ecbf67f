"""Rollout samples and the step batch built from them: advantages, staleness gating and the ledger.

Pure Python + torch (no Ray, no HTTP, no Megatron), so every rule here is testable alone. A sample is
created once by generation, scored once, and then consumed by exactly one training step or dropped with a
counted reason (see staleness.SampleLedger)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

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

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else -1


@dataclass
class Group:
    """The n samples of one prompt (a GRPO group)."""

    group_id: str
    prompt_id: str
    prompt_ids: list[int]
    answer: str
    samples: list[Sample] = field(default_factory=list)

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self.samples]


def sample_ids_for(group_id: str, n: int) -> list[str]:
    return [f"{group_id}/{i}" for i in range(n)]


@dataclass
class StepBatch:
    batch: Optional[TrainBatch]
    samples: list[Sample]
    metrics: dict


def build_step_batch(groups: Sequence[Group], version: int, ledger, *, max_staleness: Optional[int] = None,
                     drop_too_stale: bool = True, norm_by_std: bool = True, eps: float = 1e-6) -> StepBatch:
    """Turn scored groups into the trainer's batch at trainer `version`.

    Drops (recorded in the ledger with a reason): aborted samples (`aborted`), samples with no output
    tokens (`filtered`), and, when `drop_too_stale`, samples whose oldest token is more than
    `max_staleness` updates behind (`too_stale`). Advantages are group-normalised over the samples that
    remain, so a dropped sample never shifts its siblings' baseline by a reward that is not trained on."""
    keep: list[Sample] = []
    stale_drops: list[str] = []
    for g in groups:
        aborted = [s.sample_id for s in g.samples if s.finish_reason == "abort"]
        empty = [s.sample_id for s in g.samples if s.finish_reason != "abort" and not s.output_ids]
        if aborted:
            ledger.drop(aborted, "aborted")
        if empty:
            ledger.drop(empty, "filtered")
        for s in g.samples:
            if s.finish_reason == "abort" or not s.output_ids:
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
        1 for g in groups for s in g.samples if s.finish_reason == "abort" or not s.output_ids)}
    if not keep:
        return StepBatch(None, [], metrics)

    rewards = torch.tensor([float(s.reward) for s in keep])
    gids = {gid: i for i, gid in enumerate(dict.fromkeys(s.group_id for s in keep))}
    group_index = torch.tensor([gids[s.group_id] for s in keep])
    adv = grpo_advantages(rewards, group_ids=group_index, norm_by_std=norm_by_std, eps=eps)

    ledger.consume([s.sample_id for s in keep], version, [list(s.versions) for s in keep])
    batch = TrainBatch(
        input_ids=[torch.tensor(s.prompt_ids + s.output_ids, dtype=torch.long) for s in keep],
        prompt_lens=[len(s.prompt_ids) for s in keep],
        behav_log_probs=[torch.tensor(s.logprobs, dtype=torch.float32) for s in keep],
        advantages=adv.float(),
    )
    lengths = [len(s.output_ids) for s in keep]
    metrics.update({
        "reward/mean": float(rewards.mean()),
        "reward/max": float(rewards.max()),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": max(lengths),
        "response_length/std": (sum((x - sum(lengths) / len(lengths)) ** 2 for x in lengths) / len(lengths)) ** 0.5,
        "response/truncated_frac": sum(s.finish_reason == "length" for s in keep) / len(keep),
        "advantage/abs_mean": float(adv.abs().mean()),
        "batch/sequences": len(keep),
        "batch/tokens": sum(lengths) + sum(len(s.prompt_ids) for s in keep),
    })
    return StepBatch(batch, keep, metrics)
