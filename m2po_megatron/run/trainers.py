"""The trainer ranks from the driver: one Ray actor per Megatron rank, placed on the `trainer` nodes, and the
calls the loop makes on them, each with a deadline."""
from __future__ import annotations

import contextlib
from pathlib import Path

from omegaconf import DictConfig

from m2po_megatron.actor.options import actor_kwargs
from m2po_megatron.run.checkpoint import resume_hint
from m2po_megatron.run.rundir import record_placement


def start_trainers(cfg: DictConfig, world: int, rdir: Path, ckpts) -> "Ranks":
    """One Ray actor per Megatron rank on the `trainer` nodes; on GPUs, one placement group per node holding
    gpus_per_node consecutive ranks (whole tensor-parallel groups), each building a MegatronActor from the
    recipe (actor.options.actor_kwargs). With cluster.trainer_gpus_per_node, a group holds that many: the
    servers on those nodes get the node's other GPUs."""
    import ray

    from m2po_megatron.infra.cluster import PlacementTimeout, RankGroup
    from m2po_megatron.run.worker import TrainerWorker
    from m2po_megatron.infra.errors import RunError

    from m2po_megatron.infra.cluster import ROLLOUT_RESOURCE
    from m2po_megatron.run.servers import TRAINER_GPU_SHARE

    gpus = cfg.cluster.trainer_gpus_per_node or cfg.cluster.gpus_per_node  # trainer ranks per node
    colocate = cfg.cluster.colocate  # the engines share the ranks' bundles (run/servers.py colocated_engines)
    share = TRAINER_GPU_SHARE if colocate else 1
    try:
        group = RankGroup(TrainerWorker, world, gpus_per_rank=share if gpus else 0, ranks_per_node=gpus or None,
                          placement_timeout_s=cfg.cluster.timeout_s, timeout_s=cfg.cluster.timeout_s,
                          env={"OMP_NUM_THREADS": 1, "M2PO_TRAINER_THREADS": 1},
                          shared_with=ROLLOUT_RESOURCE if colocate else None)
    except PlacementTimeout as e:
        raise RunError(f"placing {world} trainer ranks: {e} (cluster.timeout_s)") from None
    except ray.exceptions.GetTimeoutError:
        raise RunError(f"placing {world} trainer ranks: not placed within cluster.timeout_s = "
                       f"{cfg.cluster.timeout_s:.0f} s; do enough Ray nodes offer the 'trainer' resource"
                       f"{' and GPUs' if gpus else ''}?") from None
    trainers = Ranks(group, ckpts, cfg.cluster.timeout_s)
    trace_dir = str(rdir / "trace") if cfg.logging.trace else None
    try:
        nodes = trainers.call("setup", actor_kwargs(cfg), None, trace_dir, cfg.logging.trace_limit, colocate,
                              what="building the Megatron ranks")
    except BaseException:
        trainers.kill()  # placed ranks are not left behind by a set-up that failed
        raise
    trainers.nodes = nodes
    record_placement(rdir, "trainer", [{"rank": n["rank"], "node": n["hostname"], "ip": n["ip"], "pid": n["pid"]}
                                       for n in nodes])
    return trainers


class Ranks:
    """The trainer ranks as the loop calls them: every call has a deadline (cluster.timeout_s unless given),
    and a rank that died or a deadline that passed becomes a RunError naming the call and the checkpoint
    to resume from. Errors raised inside a rank pass through (the caller knows what they mean)."""

    def __init__(self, group, ckpts, timeout_s: float):
        self.group, self.ckpts, self.timeout_s = group, ckpts, timeout_s
        self.nodes: list[dict] = []  # each rank's node, pid and Ray GPU ids (from setup)
        # Colocated (run/colocation.py): a block in which the trainer holds the GPU (the engines released it);
        # the behaviour log-probs of trainer recomputation run inside it. Disaggregated: nothing to do.
        self.on_device = contextlib.nullcontext

    def call(self, method: str, *args, timeout: float | None = None, what: str | None = None, **kwargs):
        import ray

        from m2po_megatron.infra.errors import RunError

        what = what or f"{method} on the trainer ranks"
        timeout = timeout or self.timeout_s
        try:
            return self.group.call(method, *args, timeout=timeout, **kwargs)
        except ray.exceptions.GetTimeoutError:
            raise RunError(f"{what}: no answer from the trainer ranks within {timeout:.0f} s; the run stops. "
                           f"{resume_hint(self.ckpts)}") from None
        except ray.exceptions.RayActorError as e:
            raise RunError(f"a trainer rank died during {what} ({e.__class__.__name__}); the run stops. "
                           f"{resume_hint(self.ckpts)}") from e

    def recompute_behaviour_logprobs(self, groups) -> None:
        """The released code's choice: behaviour log-probs from the trainer at the generating weights."""
        import ray
        import torch

        from m2po_megatron.actor.batch import TrainBatch

        samples = [s for g in groups for s in g.samples if s.output_ids and s.finish_reason != "abort"]
        if not samples:
            return
        from m2po_megatron.rollout.samples import routed_rows

        routed = [routed_rows(s) for s in samples]
        batch = TrainBatch(input_ids=[torch.tensor(s.prompt_ids + s.output_ids) for s in samples],
                           prompt_lens=[len(s.prompt_ids) for s in samples],
                           routed_experts=routed if any(r is not None for r in routed) else None)
        with self.on_device():
            logps = self.call("compute_log_probs", ray.put(batch), what="recomputing behaviour log-probs")[0]
        for s, lp in zip(samples, logps):  # an environment token's stays 0.0: it has no behaviour policy
            mask = s.loss_mask or [1] * len(s.output_ids)
            s.logprobs = [float(x) if m else 0.0 for x, m in zip(lp, mask)]

    def offload(self) -> dict:
        """Colocated: every rank's state to the host; the slowest rank's seconds and the bytes freed in all."""
        return _phase(self.call("offload_state", what="offloading the trainer's state (colocated)"))

    def reload(self) -> dict:
        return _phase(self.call("reload_state", what="reloading the trainer's state (colocated)"))

    def kill(self) -> None:
        self.group.kill()


def _phase(per_rank: list[dict]) -> dict:
    return {"seconds": max(r["seconds"] for r in per_rank), "bytes": sum(r["bytes"] for r in per_rank)}
