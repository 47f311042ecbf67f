"""Colocated layouts: every GPU generates, then every GPU trains, the synchronous hybrid engine of verl and
slime. `m2po plan` prices the best of them beside the disaggregated ones, so that a plan says when colocation
would be the better answer (often for on-policy runs, where a disaggregated trainer idles while the servers
generate and the servers idle while it trains).

The same cost model and simulation price it: the recipe's synchronous loop (on_policy or fixed_lag; a bounded
recipe is priced on-policy, since both phases hold every GPU) with a server on every `rollout_tp` GPUs and the
trainer on all of them, plus what colocation adds per step:
- **the memory swap between the phases**: before generating, the trainer's weights, gradients and optimizer
  states (models/memory.py's estimate per GPU) go to host memory, and come back before training: twice those
  bytes per step over the GPU's PCIe link (per direction) at the link efficiency. verl offloads the same
  states in its hybrid engine; slime releases them through torch_memory_saver, and SGLang frees its weights
  and KV cache (`release_memory_occupation`), which takes no transfer;
- **the weight sync in place**: the new weights reach the engine on the same GPUs (CUDA IPC, NVLink across a
  tensor-parallel group): the sync's NVLink path.
With the trainer's states offloaded, the engine gets the GPU as a disaggregated server would, less what the
offloaded trainer keeps (models/colocated_memory.py). Every phase must fit the GPU: the training phase (the
trainer's estimate plus what the released engine keeps), the generation phase (the KV pool SGLang would get
must hold one sequence of the longest context) and the weight_sync phase (the trainer without activations,
the engine's weights and the sync's buckets); a rollout TP whose generation or weight_sync phase does not fit
is skipped.

`m2po train` runs these layouts (cluster.colocate): a proposal carries the overrides that run it (the
trainer layout, cluster.colocate, the engines covering the trainer's GPUs: rollout.num_servers x
rollout.tp_size = the trainer's world, rollout_nodes 0) and passes the config's validation, as every
disaggregated row does. A calibration of a colocated run (plan/calibrate.py) replaces the swap's hardware
figures: its measured host-link efficiency ("host_link") and the engine's release and resume seconds per step
("swap_fixed_s")."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from m2po_megatron.plan.costs import Layout
from m2po_megatron.plan.hardware import EFFICIENCY, GPUS
from m2po_megatron.plan.bound import margin, upper_bound
from m2po_megatron.plan.runs import mean_of, simulate_all, workers
from m2po_megatron.plan.sim import LengthDist
from m2po_megatron.plan.space import (SIZES, Candidate, expert_overrides, expert_sizes, layout_costs,
                                      spec_from_config, trainer_memory)

__all__ = ["colocate_overrides", "colocated", "swap_s"]

# The engine's release and resume calls per step (SGLang's release_memory_occupation and two
# resume_memory_occupation): no datasheet figure prices them, so 0 until a colocated run's calibration
# measures them (plan/calibrate.py writes "swap_fixed_s").
SWAP_FIXED_S = 0.0


def swap_s(state_gib: float, gpu: str, efficiency: Optional[dict] = None) -> float:
    """Seconds per step to move `state_gib` GiB of trainer state to the host and back over PCIe, plus the
    engine's release and resume (`swap_fixed_s`). The link's efficiency is a calibration's "host_link" when it
    has one, else the sync's "link"."""
    eff = {**EFFICIENCY, **(efficiency or {})}
    link = eff.get("host_link", eff["link"])
    return 2 * state_gib * 2**30 / (GPUS[gpu].pcie_gb_s * 1e9 * link) + eff.get("swap_fixed_s", SWAP_FIXED_S)


def colocate_overrides(gpus: int, gpus_per_node: int, mem_gb: float) -> dict:
    """The cluster section of a colocated layout of `gpus`: the trainer on every GPU (whole nodes past one),
    the engines on the same ones (no rollout nodes), one engine replica per server (rollout.dp_size 1)."""
    per_node = gpus_per_node if gpus >= gpus_per_node else gpus
    return {"cluster.colocate": True, "cluster.trainer_nodes": max(1, gpus // per_node), "cluster.rollout_nodes": 0,
            "cluster.gpus_per_node": per_node, "cluster.trainer_gpus_per_node": 0, "cluster.gpu_memory_gb": mem_gb,
            "rollout.dp_size": 1}


def colocated(cfg: DictConfig, gpus: int, gpus_per_node: int, gpu: str, *, seeds: int, measured: int,
              response: Optional[LengthDist] = None, prompt_len: Optional[int] = None,
              efficiency: Optional[dict] = None, seed: int = 0, pool=None):
    """The best colocated layout of `gpus` as a space.Candidate (simulated over `seeds` seeds), or None when
    no trainer layout fits the GPU's memory. The trainer layout is the one whose step (training and swap) is
    the shortest, then the least memory; each rollout TP is simulated unless its upper bound rules it out."""
    from m2po_megatron.config import model_hf_config
    from m2po_megatron.models.colocated_memory import ENGINE_RELEASED_GB, colocated_from_config
    from m2po_megatron.models.memory import model_shape, param_count
    from m2po_megatron.plan.space import check

    mode = cfg.staleness.mode if cfg.staleness.mode in ("on_policy", "fixed_lag") else "on_policy"
    # colocation is synchronous: a bounded recipe runs on-policy (lag 0), as validation requires
    mode_ov = {"staleness.mode": mode, **({} if mode == cfg.staleness.mode else {"staleness.lag_steps": 0})}
    c = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in mode_ov.items()]))
    hf = model_hf_config(c)
    shape, params = model_shape(hf), param_count(hf)
    mem_gb = GPUS[gpu].memory_gb * 1e9 / 2**30
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    probe = spec_from_config(c, num_servers=1, response=response, prompt_len=prompt_len)
    step_tokens = probe.groups_per_step * probe.n * (probe.prompt_len + probe.response.mean)
    best_trainer = None
    for tp in SIZES:
        for pp in SIZES:
            if tp > gpus_per_node or heads % tp or layers % pp or gpus % (tp * pp):
                continue
            for ep in expert_sizes(hf, gpus // pp):
                lay = Layout(tp, pp, gpus // (tp * pp), 1, gpus, ep)
                est = trainer_memory(c, hf, lay)
                if est is None or est["total"] + ENGINE_RELEASED_GB > mem_gb:  # the training phase
                    continue
                costs = layout_costs(c, shape, params, lay, gpu, probe, gpus_per_node, efficiency,
                                     same_node_sync=True)
                swap = swap_s(est["weights"] + est["grads"] + est["optimizer"], gpu, efficiency)
                t = costs.train_s(step_tokens, probe.updates_per_step, probe.logprob_pass) + swap
                key = (round(t, 3), est["total"])
                if best_trainer is None or key < best_trainer[0]:
                    best_trainer = (key, lay, est, swap)
    if best_trainer is None:
        return None
    _, tlay, est, swap = best_trainer
    cands = []
    for rtp in SIZES:
        if rtp > gpus_per_node or heads % rtp or gpus % rtp:
            continue
        lay = Layout(tlay.tp, tlay.pp, tlay.dp, rtp, gpus // rtp, tlay.ep)
        ov = {**mode_ov, "parallel.tensor_model_parallel_size": lay.tp,
              "parallel.pipeline_model_parallel_size": lay.pp, "parallel.data_parallel_size": lay.dp,
              **({"parallel.sequence_parallel": False} if lay.tp == 1 else {}),
              "rollout.tp_size": rtp, "rollout.num_servers": lay.num_servers,
              **colocate_overrides(gpus, gpus_per_node, mem_gb), **expert_overrides(hf, lay.tp, lay.ep)}
        rc = OmegaConf.merge(c, OmegaConf.from_dotlist([f"{k}={v}" for k, v in ov.items()]))
        if colocated_from_config(rc, hf, est)["over"] or check(c, ov) is not None:
            continue  # its generation or weight_sync phase does not fit, or validation refuses it
        cand = Candidate(lay, ov, est["total"] + ENGINE_RELEASED_GB)  # the training phase's peak
        cand.spec = spec_from_config(c, num_servers=lay.num_servers, response=response, prompt_len=prompt_len)
        # the weights reach the engine in place: the sync's NVLink path
        base = layout_costs(c, shape, params, lay, gpu, cand.spec, gpus_per_node, efficiency, same_node_sync=True)
        cand.costs = replace(base, loop_fixed_s=base.loop_fixed_s + swap,
                             source=base.source + f"; colocated, {swap:.2f} s of memory swap per step")
        cand.predicted["swap_s"] = swap
        cands.append(cand)
    # by upper bound, a batch per core at a time; a rollout TP whose bound (with its margin) is below the best
    # simulated one cannot be the best, nor can any after it (plan/bound.py)
    bound = {id(x): upper_bound(x.spec, x.costs, measured) for x in cands}
    cands.sort(key=lambda x: -bound[id(x)])
    done: list = []
    while cands:
        best = max((x.predicted["tokens_per_s"] for x in done), default=0.0)
        if bound[id(cands[0])] * (1 + margin(cands[0].spec, measured, seeds)) < best:
            break
        batch, cands = cands[:workers()], cands[workers():]
        for cand, runs in zip(batch, simulate_all([(x.spec, x.costs) for x in batch], measured, seed, seeds,
                                                     pool=pool)):
            cand.predicted.update(mean_of(runs))
            cand.predicted["sync_s"] = cand.costs.sync_s()
            done.append(cand)
    return max(done, key=lambda x: x.predicted["tokens_per_s"]) if done else None

