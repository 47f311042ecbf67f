"""One trainer rank as a Ray actor: a MegatronActor plus its side of the weight sync.

Ray starts the process; RankGroup sets the torchrun-style environment; `setup` then builds the actor. The
driver sends every rank the same batch (one object in Ray's store) and reads rank 0's result, which the
actor has already reduced over data-parallel ranks."""
from __future__ import annotations

import os
import time
from typing import Optional

from m2po_megatron.cluster import RankActorBase


class TrainerWorker(RankActorBase):
    def __init__(self):
        self.actor = None
        self.sync = None
        self.export_kwargs: dict = {}

    def setup(self, actor_kwargs: dict, log_path: Optional[str] = None) -> dict:
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("M2PO_TRAINER_THREADS", "1"))))
        from m2po_megatron.actor.actor import MegatronActor

        self.actor = MegatronActor(**actor_kwargs)
        return self.node()

    # -- training --------------------------------------------------------------------------------
    def compute_log_probs(self, batch):
        out = self.actor.compute_log_probs(batch, with_entropy=False)
        return out[0] if isinstance(out, tuple) else out

    def train_step(self, batch, num_minibatches: int) -> dict:
        return self.actor.train_step(batch, num_minibatches=num_minibatches)

    def save(self, path: str) -> None:
        self.actor.save(path)

    def load(self, path: str) -> None:
        self.actor.load(path)

    # -- weight sync --------------------------------------------------------------------------------
    def init_weight_sync(self, urls: list[str], api_key: Optional[str], bucket_mb: int, group_port: int,
                         update_mode: str = "pause") -> bool:
        """Rank 0 is the source: it forms a group with every engine rank (fixed order) and broadcasts.
        Other ranks only take part in the tensor-parallel gathers of the export iterator."""
        self.export_kwargs = {"bucket_mb": bucket_mb}
        if int(os.environ.get("RANK", "0")) != 0:
            return False
        from m2po_megatron.cluster import node_ip
        from m2po_megatron.rollout.weight_sync import WeightSync

        self.sync = WeightSync(urls, master_address=node_ip(), master_port=group_port, api_key=api_key,
                               mode=update_mode)
        self.sync.init_group()
        return True

    def sync_weights(self, version: int) -> dict:
        from m2po_megatron.convert.export import iter_hf_weight_buckets

        t0 = time.perf_counter()
        buckets = iter_hf_weight_buckets(self.actor.model_chunks, self.actor.hf_config, **self.export_kwargs)
        if self.sync is None:
            for _ in buckets:  # non-source ranks: take part in the gathers, send nothing
                pass
            return {}
        stats = self.sync.sync(buckets, weight_version=str(version))
        stats.setdefault("weight_sync/seconds", time.perf_counter() - t0)
        return stats

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        if self.actor is not None:
            self.actor.close()
