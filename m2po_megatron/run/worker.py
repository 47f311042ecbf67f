"""One trainer rank as a Ray actor: a MegatronActor plus its side of the weight sync.

Ray starts the process; RankGroup sets the torchrun-style environment; `setup` then builds the actor. The
driver sends every rank the same batch (one object in Ray's store) and reads rank 0's result, which the
actor has already reduced over data-parallel ranks. Colocated (docs/colocate.md), the rank also offloads and
reloads its state (actor/offload.py: everything that computes runs inside the offloader's region) and updates
its engine from tensors (rollout/tensor_sync.py) instead of over a weight-sync group."""
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
        self.tensor_sync = None  # colocated: this rank's updates of its engine (None: not an engine's sender)
        self.senders_group = None  # colocated with several engines: rank 0 and the other senders
        self.export_kwargs: dict = {}
        from m2po_megatron.actor.offload import Offloader

        self.offload = Offloader(enabled=False)

    def setup(self, actor_kwargs: dict, log_path: Optional[str] = None, trace_dir: Optional[str] = None,
              trace_limit: int = trace.DEFAULT_LIMIT, colocate: bool = False) -> dict:
        """trace_dir: this rank's spans go to trace_dir/rank<RANK>.jsonl (the run timeline; None: none).
        colocate: the rank's state is allocated in an offloadable region (on a GPU; actor/offload.py)."""
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("M2PO_TRAINER_THREADS", "1"))))
        from m2po_megatron.actor.actor import MegatronActor
        from m2po_megatron.actor.offload import Offloader

        rank = int(os.environ.get("RANK", "0"))
        if trace_dir is not None:
            trace.open_trace(os.path.join(trace_dir, f"rank{rank}.jsonl"), f"trainer rank {rank}", trace_limit)
        self.offload = Offloader(enabled=colocate and torch.cuda.is_available())
        with self.offload.region():
            self.actor = MegatronActor(**actor_kwargs)
        self.hf_config = actor_kwargs.get("hf_path") or actor_kwargs.get("hf_config")
        return self.node()

    # -- training --------------------------------------------------------------------------------
    def compute_log_probs(self, batch):
        with trace.span("logprob_pass", "train", seqs=len(batch), tokens=sum(batch.lengths)):
            # R3: the behaviour policy routed as the engine did (the batch carries its routing)
            with self.offload.region():
                out = self.actor.compute_log_probs(batch, with_entropy=False, replay=batch.routed_experts is not None)
        trace.flush()
        return out[0] if isinstance(out, tuple) else out

    def reference_log_probs(self, batch):
        """The reference model's log-probs of the batch's response tokens (the KL in the reward)."""
        with trace.span("ref_pass", "train", seqs=len(batch), tokens=sum(batch.lengths)):
            with self.offload.region():
                out = self.actor.reference_log_probs(batch)
        trace.flush()
        return out

    def train_step(self, batch, num_minibatches: int) -> dict:
        with trace.span("train_step", "train", seqs=len(batch), tokens=sum(batch.lengths), updates=num_minibatches):
            with self.offload.region():  # Adam's state, made at the first step, belongs to the region too
                out = self.actor.train_step(batch, num_minibatches=num_minibatches)
        for name, t0, t1 in self.actor.last_spans:  # the step's phases, update by update
            trace.complete(name, "train", t0, t1, tid="phases")
        trace.flush()  # the driver ends ranks with ray.kill: nothing waits in a buffer
        return out

    def save(self, path: str) -> None:
        with trace.span("checkpoint", "checkpoint"), self.offload.on_device():  # offloaded: reloaded meanwhile
            self.actor.save(path)
        trace.flush()

    def load(self, path: str) -> None:
        with self.offload.on_device():
            self.actor.load(path)

    # -- colocation ----------------------------------------------------------------------------------
    def offload_state(self) -> dict:
        """Colocated: give the GPU to the engines (seconds, bytes; about 0 on CPU)."""
        with trace.span("offload", "colocate"):
            out = self.offload.offload()
        trace.flush()
        return out

    def reload_state(self) -> dict:
        with trace.span("reload", "colocate"):
            out = self.offload.reload()
        trace.flush()
        return out

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

    def init_tensor_sync(self, urls: list[str], api_key: Optional[str], bucket_mb: int, ranks_per_engine: int,
                         engine_tp: int, timeout_s: float) -> bool:
        """Colocated: rank r is engine r // ranks_per_engine's sender when r % ranks_per_engine == 0 (the
        engine runs on that rank's GPU and the next ones). Every rank calls this (the senders' group is made
        by all ranks together). Returns whether this rank sends."""
        import torch.distributed as dist

        from m2po_megatron.convert.export import exports_weights
        from m2po_megatron.rollout.tensor_sync import TensorWeightSync

        self.export_kwargs = {"bucket_mb": bucket_mb}
        self.exports = exports_weights(self.hf_config)
        rank = int(os.environ.get("RANK", "0"))
        if len(urls) > 1 and self.senders_group is None:
            self.senders_group = dist.new_group(ranks=[i * ranks_per_engine for i in range(len(urls))])
        sender = rank % ranks_per_engine == 0
        self.tensor_sync = (TensorWeightSync(urls[rank // ranks_per_engine], api_key, engine_tp, timeout_s)
                            if sender else None)
        return sender

    def sync_weights(self, version: int) -> dict:
        try:
            with trace.span("sync_weights", "sync", version=version):
                if self.tensor_sync is not None or self.senders_group is not None:
                    return self._sync_from_tensors(version)
                return self._sync_weights(version)
        finally:
            trace.flush()

    def _sync_from_tensors(self, version: int) -> dict:
        """Colocated update (rollout/tensor_sync.py): rank 0 streams every bucket to engine 0 and forwards host
        copies to the other senders; the others take part in the export first, then receive."""
        from m2po_megatron.rollout.tensor_sync import broadcast_copies, receive_and_send, send_all

        rank = int(os.environ.get("RANK", "0"))
        with self.offload.region():
            if rank == 0:
                copies: list = []
                try:
                    stats, copies = send_all(self.tensor_sync, self._bucket_stream(), str(version),
                                             keep_copies=self.senders_group is not None)
                finally:  # an error still ends the other senders' wait (an empty stream)
                    if self.senders_group is not None:
                        broadcast_copies(copies, self.senders_group, 0, device())
                return stats
            self._export_part()
            if self.tensor_sync is not None:
                receive_and_send(self.tensor_sync, self.senders_group, 0, device(), str(version))
            return {}

    def _bucket_stream(self):
        """Global rank 0: the first stage's buckets, then each later stage's (relayed)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        from m2po_megatron.convert.export import iter_hf_weight_buckets

        buckets = iter_hf_weight_buckets(self.actor.model_chunks(), self.hf_config, **self.export_kwargs)
        stages = dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group())
        return itertools.chain(buckets, *(_recv_buckets(src) for src in stages[1:]))

    def _export_part(self) -> None:
        """A rank other than 0: its share of the export (TP gathers; a later stage's source relays its
        buckets to rank 0)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        from m2po_megatron.convert.export import is_source_rank, iter_hf_weight_buckets

        if not self.exports:
            return
        buckets = iter_hf_weight_buckets(self.actor.model_chunks(), self.hf_config, **self.export_kwargs)
        stages = dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group())
        if is_source_rank() and mpu.get_pipeline_model_parallel_rank() > 0:
            _send_buckets(buckets, dst=stages[0])
        else:
            for _ in buckets:
                pass

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
