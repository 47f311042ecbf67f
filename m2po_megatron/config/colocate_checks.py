"""The checks of cluster.colocate (docs/colocate.md), apart from validation.py's general ones: which modes and
layouts can share the trainer's GPUs with the rollout engines."""
from __future__ import annotations

from omegaconf import DictConfig


def check_colocate(cfg: DictConfig, world: int, errors: list[str]) -> None:
    """cluster.colocate (docs/colocate.md): the engines together hold exactly the trainer's GPUs (CPU slots),
    one engine per rollout.tp_size x rollout.dp_size of them, in the synchronous modes only. `world`: the
    trainer's ranks (TP x PP x CP x DP)."""
    c, r, s = cfg.cluster, cfg.rollout, cfg.staleness
    if not c.colocate:
        return
    if s.mode == "bounded":
        errors.append("cluster.colocate = true with staleness.mode = bounded: the bounded mode overlaps generation "
                      "and training, which needs separate GPUs, while colocated both phases hold every GPU in "
                      "turn; use staleness.mode = fixed_lag or on_policy, or cluster.colocate = false")
    if r.urls:
        errors.append(f"cluster.colocate = true with rollout.urls = {list(r.urls)}: colocated engines are started "
                      f"by the run on the trainer's GPUs, not attached; set rollout.urls = [] or "
                      f"cluster.colocate = false")
    if c.rollout_nodes:
        errors.append(f"cluster.colocate = true with cluster.rollout_nodes = {c.rollout_nodes}: the engines share "
                      f"the trainer's nodes; set cluster.rollout_nodes = 0")
    per_engine = r.tp_size * r.dp_size
    if r.num_servers * per_engine != world:
        fit = (f"rollout.num_servers = {world // per_engine}" if world % per_engine == 0 else
               f"rollout.tp_size dividing {world} (e.g. rollout.tp_size = 1, rollout.num_servers = {world})")
        errors.append(f"cluster.colocate = true: the engines must cover exactly the trainer's {world} GPUs (CPU "
                      f"slots; tensor x pipeline x context x data parallel), but rollout.num_servers x "
                      f"rollout.tp_size x rollout.dp_size = {r.num_servers} x {r.tp_size} x {r.dp_size} = "
                      f"{r.num_servers * per_engine}; use {fit}")
    elif per_engine > 1 and c.gpus_per_node and (c.trainer_gpus_per_node or c.gpus_per_node) % per_engine:
        errors.append(f"cluster.colocate = true: an engine's {per_engine} GPUs (rollout.tp_size x dp_size) must "
                      f"sit on one node, but a node holds {c.trainer_gpus_per_node or c.gpus_per_node} trainer "
                      f"GPUs; use a rollout.tp_size that divides it")
