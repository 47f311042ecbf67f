"""Cost models of the asynchronous pipeline's parts, in seconds, each with its source:

- **Trainer** (per step): `train_fixed_s + train_per_update_s x U + tokens x train_per_token_s`, plus
  `tokens x logprob_per_token_s` when the trainer recomputes log-probs (behav_logprob_source=trainer, a
  three-policy correction, M2PO's global mask). From datasheets: per token 6 x N FLOPs for forward and
  backward plus the attention's 12 x layers x hidden x context / 2 (causal), over the trainer's GPUs x peak x
  MFU, times the pipeline bubble 1 + (PP - 1) / micro-batches (1F1B); a log-prob pass is a third of that.
- **Rollout server** (per decode step of a continuous batch of B sequences holding K KV tokens):
  `decode_fixed_s + B x decode_per_seq_s + K x decode_per_kv_s`. From datasheets: decode is memory-bound,
  so the fixed part reads the weights (N x 2 bytes / TP) at HBM bandwidth x efficiency, each KV token reads
  its 2 x layers x kv_heads x head_dim x 2 bytes / TP, and each sequence adds its 2 x N / TP FLOPs at peak x
  efficiency (a sum, so a large batch turns compute-bound smoothly). Prefill is compute-bound:
  `prompt tokens x prefill_per_token_s` (2 x N FLOPs per token). `max_running` sequences fit one server
  (its KV budget: (memory x mem_fraction_static - weights) / KV bytes per token / mean context).
- **Weight sync**: `sync_fixed_s + bytes x sync_per_byte_s`, bytes = N x 2 (bf16) over NVLink when the
  servers share the trainer's node, else one InfiniBand NIC (the sender is trainer rank 0).

A `Costs` is built from hardware figures (`from_hardware`) or fitted on a run's timeline (plan/calibrate.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from m2po_megatron.plan.hardware import GPUS, EFFICIENCY, Gpu

__all__ = ["Costs", "Layout", "efficiency_of", "from_hardware"]


@dataclass(frozen=True)
class Costs:
    train_fixed_s: float
    train_per_update_s: float
    train_per_token_s: float
    logprob_per_token_s: float
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_kv_s: float
    prefill_per_token_s: float
    max_running: int  # sequences one server decodes at once
    sync_fixed_s: float
    sync_per_byte_s: float
    weight_bytes: float
    source: str = ""  # where the figures came from
    loop_fixed_s: float = 0.0  # the loop's own time per step outside waiting, training and syncing
    # A host whose cores the trainer and the servers share (a CPU machine; 0: each has its own GPUs). With n
    # threads busy, each runs at speed(n): contention slows two busy threads below one each (hyper-threads,
    # caches, memory bandwidth), and past the cores they time-share.
    shared_cores: int = 0
    contention: float = 0.0

    def speed(self, busy: int) -> float:
        """Speed of each busy thread, relative to running alone, when `busy` threads are busy."""
        if not self.shared_cores or busy <= 1:
            return 1.0
        m = min(busy, self.shared_cores)
        return 1.0 / (1.0 + self.contention * (m - 1)) * min(1.0, self.shared_cores / busy)

    def train_s(self, tokens: float, updates: int, logprob_pass: bool) -> float:
        per_token = self.train_per_token_s + (self.logprob_per_token_s if logprob_pass else 0.0)
        return self.train_fixed_s + updates * self.train_per_update_s + tokens * per_token

    def decode_s(self, steps: float, batch: int, kv0: float) -> float:
        """Time of `steps` decode steps of `batch` sequences starting at `kv0` KV tokens (each step adds
        `batch`): the arithmetic series of the per-step cost."""
        per_step = self.decode_fixed_s + batch * self.decode_per_seq_s
        kv_sum = steps * kv0 + batch * steps * (steps - 1) / 2
        return steps * per_step + kv_sum * self.decode_per_kv_s

    def steps_within(self, dt: float, batch: int, kv0: float) -> int:
        """How many whole decode steps fit in `dt` seconds (the inverse of decode_s)."""
        a = self.decode_fixed_s + batch * self.decode_per_seq_s + self.decode_per_kv_s * (kv0 - batch / 2)
        c = self.decode_per_kv_s * batch / 2
        if dt <= 0:
            return 0
        if c <= 0:
            return int(dt * (1 + 1e-9) / a) if a > 0 else 1 << 40
        k = int(2 * dt / (a + (a * a + 4 * c * dt) ** 0.5))  # the root of c k^2 + a k = dt, without cancellation
        tol = dt * (1 + 1e-9)  # an event scheduled at decode_s(k) must find its k steps done
        while k > 0 and self.decode_s(k, batch, kv0) > tol:
            k -= 1
        while self.decode_s(k + 1, batch, kv0) <= tol:
            k += 1
        return k

    def sync_s(self) -> float:
        return self.sync_fixed_s + self.weight_bytes * self.sync_per_byte_s


@dataclass(frozen=True)
class Layout:
    """A split of the cluster: trainer TP x PP x DP, and rollout servers of rollout_tp GPUs each."""

    tp: int
    pp: int
    dp: int
    rollout_tp: int
    num_servers: int

    @property
    def trainer_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_tp * self.num_servers


def from_hardware(shape, params: int, layout: Layout, gpu: Gpu | str, *, micro_batches: int,
                  mean_context: float, mem_fraction_static: float = 0.85, efficiency: Optional[dict] = None,
                  same_node_sync: bool = False) -> Costs:
    """Costs from the model's shape (models.memory.ModelShape), its parameter count and the GPU's datasheet
    figures, with the efficiencies of plan.hardware.EFFICIENCY (or `efficiency`'s overrides)."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    eff = {**EFFICIENCY, **(efficiency or {})}
    peak, bw = g.bf16_tflops * 1e12, g.hbm_tb_s * 1e12
    attn = 12 * shape.layers * shape.hidden * mean_context / 2  # causal attention FLOPs per token, fwd+bwd
    flops_tok = 6 * params + attn
    bubble = 1 + (layout.pp - 1) / max(micro_batches, 1)
    train_tok = flops_tok / (layout.trainer_gpus * peak * eff["mfu"]) * bubble
    kv_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2  # K and V, bf16, per token
    rtp = layout.rollout_tp
    weights = params * 2
    kv_budget = max(g.memory_gb * 1e9 * rtp * mem_fraction_static - weights, 0.0) / kv_bytes
    link = g.nvlink_gb_s if same_node_sync else g.ib_gb_s_per_node
    return Costs(
        train_fixed_s=eff["train_fixed_s"],
        # optimizer: read and write fp32 master weights, m, v and grads (16 bytes x 2 per param) per update
        train_per_update_s=32 * params / layout.trainer_gpus / (bw * eff["hbm"]),
        train_per_token_s=train_tok,
        logprob_per_token_s=train_tok / 3,
        # tensor parallelism adds two all-reduces per layer to every decode step (attention and MLP outputs)
        decode_fixed_s=eff["decode_fixed_s"] + weights / rtp / (bw * eff["hbm"])
        + (2 * shape.layers * eff["tp_allreduce_s"] if rtp > 1 else 0.0),
        decode_per_seq_s=2 * params / rtp / (peak * eff["decode_compute"]),
        decode_per_kv_s=kv_bytes / rtp / (bw * eff["hbm"]),
        prefill_per_token_s=2 * params / rtp / (peak * eff["prefill"]),
        max_running=int(max(1, min(eff["max_running_cap"], kv_budget / max(mean_context, 1.0)))),
        sync_fixed_s=eff["sync_fixed_s"],
        sync_per_byte_s=1 / (link * 1e9 * eff["link"]),
        weight_bytes=weights,
        source=f"{g.name} datasheet, efficiencies {eff}",
    )


def efficiency_of(costs: Costs, shape, params: int, layout: Layout, gpu: Gpu | str, *, micro_batches: int,
                  mean_context: float, same_node_sync: bool = False, has_engine: bool = True) -> dict:
    """The efficiencies under which `from_hardware` gives `costs` (fitted on a run of this layout and GPU):
    from_hardware inverted, term by term. The decode terms only when the run traced its engine's steps."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    peak, bw = g.bf16_tflops * 1e12, g.hbm_tb_s * 1e12
    flops_tok = 6 * params + 12 * shape.layers * shape.hidden * mean_context / 2
    bubble = 1 + (layout.pp - 1) / max(micro_batches, 1)
    rtp, weights = layout.rollout_tp, params * 2
    link = g.nvlink_gb_s if same_node_sync else g.ib_gb_s_per_node
    out = {"mfu": flops_tok * bubble / (layout.trainer_gpus * peak * costs.train_per_token_s),
           "train_fixed_s": costs.train_fixed_s}
    if costs.sync_s() > EFFICIENCY["sync_fixed_s"]:
        out["link"] = weights / (link * 1e9 * (costs.sync_s() - EFFICIENCY["sync_fixed_s"]))
    if has_engine and costs.decode_per_kv_s > 0:
        kv_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
        hbm = kv_bytes / rtp / (bw * costs.decode_per_kv_s)
        tp_comm = 2 * shape.layers * EFFICIENCY["tp_allreduce_s"] if rtp > 1 else 0.0
        out.update(hbm=hbm, decode_fixed_s=max(costs.decode_fixed_s - weights / rtp / (bw * hbm) - tp_comm, 0.0))
        if costs.decode_per_seq_s > 0:
            out["decode_compute"] = 2 * params / rtp / (peak * costs.decode_per_seq_s)
        if costs.prefill_per_token_s > 0:
            out["prefill"] = 2 * params / rtp / (peak * costs.prefill_per_token_s)
    return out
