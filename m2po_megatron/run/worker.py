"""One trainer rank as a Ray actor: a MegatronActor plus its side of the weight sync.

Ray starts the process; RankGroup sets the torchrun-style environment; `setup` then builds the actor. The
driver sends every rank the same batch (one object in Ray's store) and reads rank 0's result, which the
actor has already reduced over data-parallel ranks."""
from __future__ import annotations

import itertools
import os
from typing import Optional

from m2po_megatron.infra import trace
from m2po_megatron.infra.cluster import RankActorBase
from m2po_megatron.infra.device import device


class TrainerWorker(RankActorBase):
    def __init__(self):
        self.actor = None
        self.sync = None
        self.export_kwargs: dict = {}

    def setup(self, actor_kwargs: dict, log_path: Optional[str] = None, trace_dir: Optional[str] = None,
              trace_limit: int = trace.DEFAULT_LIMIT) -> dict:
        """trace_dir: this rank's spans go to trace_dir/rank<RANK>.jsonl (the run timeline; None: none)."""
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("M2PO_TRAINER_THREADS", "1"))))
        from m2po_megatron.actor.actor import MegatronActor

        rank = int(os.environ.get("RANK", "0"))
        if trace_dir is not None:
            trace.open_trace(os.path.join(trace_dir, f"rank{rank}.jsonl"), f"trainer rank {rank}", trace_limit)
        self.actor = MegatronActor(**actor_kwargs)
        self.hf_config = actor_kwargs.get("hf_path") or actor_kwargs.get("hf_config")
        return self.node()

    # -- training --------------------------------------------------------------------------------
    def compute_log_probs(self, batch):
        with trace.span("logprob_pass", "train", seqs=len(batch), tokens=sum(batch.lengths)):
            # R3: the behaviour policy routed as the engine did (the batch carries its routing)
            out = self.actor.compute_log_probs(batch, with_entropy=False, replay=batch.routed_experts is not None)
        trace.flush()
        return out[0] if isinstance(out, tuple) else out

    def train_step(self, batch, num_minibatches: int) -> dict:
        with trace.span("train_step", "train", seqs=len(batch), tokens=sum(batch.lengths), updates=num_minibatches):
            out = self.actor.train_step(batch, num_minibatches=num_minibatches)
        for name, t0, t1 in self.actor.last_spans:  # the step's phases, update by update
            trace.complete(name, "train", t0, t1, tid="phases")
        trace.flush()  # the driver ends ranks with ray.kill: nothing waits in a buffer
        return out

    def save(self, path: str) -> None:
        with trace.span("checkpoint", "checkpoint"):
            self.actor.save(path)
        trace.flush()

    def load(self, path: str) -> None:
        self.actor.load(path)

    # -- weight sync --------------------------------------------------------------------------------
    def init_weight_sync(self, urls: list[str], api_key: Optional[str], bucket_mb: int, group_port: int,
                         pause_mode: str = "retract", ranks_per_server: int = 1,
                         group_name: str = "weight_update_group") -> bool:
        """Global rank 0 is the only sender to the engines: it forms a group with every engine rank (in a
        fixed order) and broadcasts. The other tensor-parallel ranks of data-parallel replica 0 take part
        in the gathers of the export iterator; with pipeline parallelism each later stage's source rank
        relays its buckets to rank 0 (one bucket in flight at a time). Other replicas do nothing."""
        from m2po_megatron.convert.export import exports_weights

        self.export_kwargs = {"bucket_mb": bucket_mb}
        self.exports = exports_weights(self.hf_config)  # replica 0, and with MoE every expert-DP-0 rank
        if int(os.environ.get("RANK", "0")) != 0:
            return False
        from m2po_megatron.infra.cluster import node_ip
        from m2po_megatron.rollout.weight_sync import DistributedWeightSync

        if self.sync is not None:  # re-forming the group (a server restarted): drop the old one first
            try:
                self.sync.close()
            except RuntimeError as e:  # a restarted server never knew the old group; ours is gone anyway
                print(f"[m2po] closing the previous weight-sync group: {e}", flush=True)
        self.sync = DistributedWeightSync(urls, master_address=node_ip(), master_port=group_port,
                                          ranks_per_server=ranks_per_server, pause_mode=pause_mode, api_key=api_key,
                                          group_name=group_name)
        self.sync.init_group()
        return True

    def sync_weights(self, version: int) -> dict:
        try:
            with trace.span("sync_weights", "sync", version=version):
                return self._sync_weights(version)
        finally:
            trace.flush()

    def _sync_weights(self, version: int) -> dict:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        from m2po_megatron.convert.export import is_source_rank, iter_hf_weight_buckets

        if not self.exports:
            return {}
        buckets = iter_hf_weight_buckets(self.actor.model_chunks(), self.hf_config, **self.export_kwargs)
        stages = dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group())
        if self.sync is not None:  # global rank 0: first stage's buckets, then each later stage's
            stream = itertools.chain(buckets, *(_recv_buckets(src) for src in stages[1:]))
            try:
                return self.sync.sync(stream, weight_version=str(version))
            except BaseException:
                for _ in stream:  # let the peers finish their gathers and sends, then report
                    pass
                raise
        if is_source_rank() and mpu.get_pipeline_model_parallel_rank() > 0:
            _send_buckets(buckets, dst=stages[0])
        else:
            for _ in buckets:  # take part in the gathers (TP, and expert TP/EP); the stage's source rank sends
                pass
        return {}

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        if self.actor is not None:
            self.actor.close()
        trace.close_trace()


def _send_buckets(buckets, dst: int) -> None:
    """Pipeline stage -> global rank 0: per bucket a header (names, shapes, dtypes) then the tensors;
    an empty header ends the stream."""
    import torch.distributed as dist

    dev = device()
    for bucket in buckets:
        header = [[(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in bucket]]
        dist.send_object_list(header, dst=dst, device=dev)
        for _, t in bucket:
            dist.send(t.contiguous().to(dev), dst=dst)
    dist.send_object_list([[]], dst=dst, device=dev)


def _recv_buckets(src: int):
    import torch
    import torch.distributed as dist

    dev = device()
    while True:
        header = [None]
        dist.recv_object_list(header, src=src, device=dev)
        if not header[0]:
            return
        bucket = []
        for name, shape, dtype in header[0]:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
            dist.recv(t, src=src)
            bucket.append((name, t))
        yield bucket
