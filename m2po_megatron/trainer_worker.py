"""One trainer rank as a Ray actor: a MegatronActor plus its side of the weight sync.

Ray starts the process; RankGroup sets the torchrun-style environment; `setup` then builds the actor. The
driver sends every rank the same batch (one object in Ray's store) and reads rank 0's result, which the
actor has already reduced over data-parallel ranks."""
from __future__ import annotations

import os
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
        self.hf_config = actor_kwargs.get("hf_model_dir") or actor_kwargs.get("hf_config")
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
                         update_mode: str = "pause", ranks_per_server: int = 1,
                         group_name: str = "weight_update_group") -> bool:
        """Global rank 0 is the source: it forms a group with every engine rank (in a fixed order) and
        broadcasts. The other tensor-parallel ranks of data-parallel replica 0 only take part in the
        gathers of the export iterator; other replicas hold the same weights and do nothing."""
        from megatron.core import parallel_state as mpu

        self.export_kwargs = {"bucket_mb": bucket_mb}
        self.exports = mpu.get_data_parallel_rank() == 0
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("weight sync with pipeline_model_parallel_size > 1 is not supported yet "
                                      "(one source rank per stage); use tensor parallelism for the trainer")
        if int(os.environ.get("RANK", "0")) != 0:
            return False
        from m2po_megatron.cluster import node_ip
        from m2po_megatron.rollout.weight_sync import DistributedWeightSync

        if self.sync is not None:  # re-forming the group (a server restarted): drop the old one first
            self.sync.close()
        self.sync = DistributedWeightSync(urls, master_address=node_ip(), master_port=group_port,
                                          ranks_per_server=ranks_per_server, mode=update_mode, api_key=api_key,
                                          group_name=group_name)
        self.sync.init_group()
        return True

    def sync_weights(self, version: int) -> dict:
        from m2po_megatron.convert.export import iter_hf_weight_buckets

        if not self.exports:
            return {}
        buckets = iter_hf_weight_buckets(self.actor.model_chunks(), self.hf_config, **self.export_kwargs)
        if self.sync is None:
            for _ in buckets:  # take part in the tensor-parallel gathers; rank 0 sends
                pass
            return {}
        return self.sync.sync(buckets, weight_version=str(version))

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        if self.actor is not None:
            self.actor.close()
