"""Cost models of the asynchronous pipeline's parts, in seconds, each with its source.

N is the parameter count (models.memory.param_count) and N_mm the parameters of matmuls: N less the input
embedding when it is untied (a lookup, no FLOPs), N itself when tied (the output projection is a matmul on the
shared table). Kaplan et al., "Scaling Laws for Neural Language Models" (2020), count C = 6 N FLOPs per token
with N excluding embeddings; Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (2021), count the logit layer's FLOPs and not the lookup's: so does this.

- **Trainer** (per step): `train_fixed_s + train_per_update_s x U + tokens x train_per_token_s`, plus
  `tokens x logprob_per_token_s` when the trainer recomputes log-probs (behav_logprob_source=trainer, a
  three-policy correction, M2PO's global mask). Per token 6 x N_mm FLOPs for forward and backward plus the
  attention's 12 x layers x heads x head_dim x context / 2 (PaLM, Chowdhery et al. 2022, appendix B: 6 N +
  12 L H Q T; the attention matmuls are heads x head_dim wide, which is not the hidden size on Qwen3-4B:
  32 x 128 = 4096 against 2560; halved for the causal mask), over the trainer's GPUs x peak x MFU, times the
  pipeline bubble 1 + (PP - 1) / micro-batches (1F1B); a log-prob pass is a third of that. A reference model
  (algo.use_kl_loss) adds its own forward-only pass over the step's tokens, priced as the log-prob pass, and,
  when its weights sit on the host (algo.ref_param_offload), their copy to the GPU once per step: the heaviest
  stage's share (2 N / (TP x PP) bytes; MoE: its experts over EP) over the host link (Gpu.pcie_gb_s, per
  direction) at the link efficiency (a calibration's "host_link" where it has one). With FP8
  (model.fp8) the decoder layers' linear layers run at the FP8 peak: Transformer Engine's FP8 recipe casts the
  GEMMs of its Linear modules and keeps attention (DotProductAttention) in BF16, and megatron-core's GPTModel
  builds the output layer as tensor_parallel.ColumnParallelLinear, not a TE module, so it stays BF16 too.
  Per optimizer update: the optimizer reads and writes fp32 master weights, m, v and grads (32 bytes per
  parameter it owns: 1 / (TP x PP x DP) of them with the distributed optimizer, 1 / (TP x PP) without) at HBM
  bandwidth, then the data-parallel collectives, which this project does not overlap with compute
  (actor/optim.py: overlap_grad_reduce=False, overlap_param_gather=False): with megatron-core's distributed
  optimizer a reduce-scatter of the gradients in fp32 (actor/optim.py sets grad_reduce_in_fp32=True) and an
  all-gather of the updated bf16 parameters; without it an all-reduce of the gradients. A ring reduce-scatter
  or all-gather sends (dp - 1) / dp of the buffer per rank, an all-reduce twice that (nccl-tests'
  PERFORMANCE.md, bus bandwidth). The link is NVLink per direction when the trainer fits one node, else the
  rank's own InfiniBand NIC; at dp 1 there is nothing to reduce.
- **Rollout server** (per decode step of a continuous batch of B sequences holding K KV tokens), a roofline
  (Williams, Waterman and Patterson, "Roofline: an insightful visual performance model for multicore
  architectures", CACM 2009: a kernel takes the longer of its compute and its memory traffic, not their sum):
  `decode_fixed_s + max(B x decode_per_seq_s, decode_weights_s + K x decode_per_kv_s)`. The memory side reads
  the matmul weights once (2 N_mm bytes / TP; the input embedding only gathers B rows) and each KV token's
  2 (K and V) x layers x kv_heads_per_gpu x head_dim x 2 bytes, at HBM bandwidth x efficiency; kv_heads_per_gpu
  is kv_heads / TP, or 1 when TP > kv_heads (SGLang's QKVParallelLinear, as vLLM's, replicates the KV heads
  then: num_kv_head_replicas). The compute side is 2 x N_mm / TP FLOPs per sequence at peak x efficiency.
  `decode_fixed_s` is what overlaps neither: scheduling and sampling, and with TP > 1 two all-reduces per layer.
  Prefill is compute-bound: `prompt tokens x prefill_per_token_s` (2 x N_mm FLOPs per token). `max_running`
  sequences fit one server: per GPU, the KV pool is memory x mem_fraction_static - weights / TP (SGLang's
  server arguments docs: mem_fraction_static is "the fraction of the memory used for static allocation (model
  weights and KV cache memory pool)"), over the KV bytes per token per GPU and the mean context.
- **Weight sync**: `sync_fixed_s + bytes x sync_per_byte_s`, bytes = 2 N (every weight, bf16) over NVLink per
  direction when the servers share the trainer's node, else one InfiniBand NIC (the sender is trainer rank 0).

Mixture-of-experts models (Qwen3-MoE): FLOPs (training, decode, prefill) count the *active* matmul parameters
(attention, the router, the top-k experts, the output layer: `inactive_expert_params` less), memory, the
optimizer and the weight sync *all* of them. The trainer runs expert parallelism EP with expert tensor parallel 1
(`Layout.ep`); its token dispatch adds two all-to-alls per layer forward and two backward, each k copies of a
token's hidden state in bf16, (EP - 1) / EP of them leaving the rank, over NVLink when the EP group fits a node,
else InfiniBand, not overlapped; the tensor-parallel traffic is then only attention's (4 collectives per layer).
Expert gradients reduce over expert-data-parallel (TP x DP / EP ranks). A decode step of B sequences reads the
non-expert weights and the experts its tokens chose: per layer E x (1 - (1 - k/E)^B) experts expected
(`Costs.weights_s`), all of them once B is large.

A `Costs` is built from hardware figures (`from_hardware`, the roofline) or fitted on a run's timeline
(plan/calibrate.py: a least-squares fit of the sum form, `decode_roofline=False`, `decode_weights_s=0`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

# the FLOPs count lives in plan/flops.py (gpu_check's MFU uses it too); its names stay importable from here
from m2po_megatron.plan.flops import attention_flops, inactive_expert_params, matmul_params, train_flops_per_token
from m2po_megatron.plan.hardware import EFFICIENCY, GPUS, Gpu

__all__ = ["Costs", "GRAD_BYTES", "Layout", "REFERENCE_PLACES", "attention_flops", "efficiency_of", "expert_params",
           "from_hardware", "inactive_expert_params", "kv_bytes_per_gpu", "matmul_params", "reference_costs"]

GRAD_BYTES = 4  # actor/optim.py wraps megatron-core's DDP with grad_reduce_in_fp32=True: fp32 gradient buffers
PARAM_BYTES = 2  # bf16 weights: what the servers hold, the sync sends and the distributed optimizer gathers
_MANY = 1 << 40  # steps_within's answer when a decode step costs nothing (a fit without decode spans)


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
    # Decode: the time to read the weights once per step, and whether a step is the roofline
    # fixed + max(compute, memory) (from_hardware) or the sum of its terms (a calibration's linear fit).
    decode_weights_s: float = 0.0
    decode_roofline: bool = False
    # Mixture of experts: the time to read every routed expert's weights once, and k / E (top-k of E experts).
    # A decode step of B sequences reads the experts its tokens chose: expected E x (1 - (1 - k/E)^B) per
    # layer (each token picks k of E; taken as independent and uniform), so the read grows with B up to all.
    decode_expert_s: float = 0.0
    expert_frac: float = 0.0
    # A reference model (algo.use_kl_loss): its forward-only pass per token of the step, and the copy of its
    # weights from the host to the GPU once per step when offloaded (0, 0: no reference model)
    reference_per_token_s: float = 0.0
    reference_copy_s: float = 0.0
    # The rollout client's host time per generated sample outside the engine's spans (sending requests,
    # scoring, grouping): 0 unless a run's calibration measured it (plan/calibrate.py, client_fit); the
    # simulation adds it to the wait for generation (plan/sim.py).
    client_per_sample_s: float = 0.0

    def weights_s(self, batch: float) -> float:
        """The weights one decode step of `batch` sequences reads, in seconds: decode_weights_s, plus the
        experts its tokens touch (MoE)."""
        if not self.decode_expert_s:
            return self.decode_weights_s
        return self.decode_weights_s + self.decode_expert_s * (1 - (1 - self.expert_frac) ** max(batch, 1))

    def speed(self, busy: int) -> float:
        """Speed of each busy thread, relative to running alone, when `busy` threads are busy."""
        if not self.shared_cores or busy <= 1:
            return 1.0
        m = min(busy, self.shared_cores)
        return 1.0 / (1.0 + self.contention * (m - 1)) * min(1.0, self.shared_cores / busy)

    def train_s(self, tokens: float, updates: int, logprob_pass: bool) -> float:
        per_token = self.train_per_token_s + (self.logprob_per_token_s if logprob_pass else 0.0)
        per_token += self.reference_per_token_s
        return self.train_fixed_s + updates * self.train_per_update_s + tokens * per_token + self.reference_copy_s

    def decode_step_s(self, batch: float, kv: float) -> float:
        """One decode step of `batch` sequences holding `kv` KV tokens."""
        compute = batch * self.decode_per_seq_s
        memory = self.weights_s(batch) + kv * self.decode_per_kv_s
        return self.decode_fixed_s + (max(compute, memory) if self.decode_roofline else compute + memory)

    def _compute_steps(self, batch: int, kv0: float) -> float:
        """Roofline: how many leading steps the compute side bounds (the memory side grows by batch KV tokens
        a step and overtakes it); math.inf when it never does."""
        c = batch * self.decode_per_seq_s
        m0 = self.weights_s(batch) + kv0 * self.decode_per_kv_s
        if c < m0:
            return 0
        g = batch * self.decode_per_kv_s
        q = (c - m0) / g if g > 0 else math.inf
        return math.floor(q) + 1 if q < 2.0 ** 62 else math.inf

    def decode_s(self, steps: float, batch: int, kv0: float) -> float:
        """Time of `steps` decode steps of `batch` sequences starting at `kv0` KV tokens (each step adds
        `batch`): the sum of decode_step_s over the steps, in closed form. Roofline: compute-bound steps first
        (a constant cost), then memory-bound ones (an arithmetic series); a fractional `steps` interpolates."""
        f, g = self.decode_fixed_s, batch * self.decode_per_kv_s
        if not self.decode_roofline:
            per_step = f + self.weights_s(batch) + batch * self.decode_per_seq_s
            kv_sum = steps * kv0 + batch * steps * (steps - 1) / 2
            return steps * per_step + kv_sum * self.decode_per_kv_s
        j = min(steps, self._compute_steps(batch, kv0))
        m0 = self.weights_s(batch) + kv0 * self.decode_per_kv_s
        memory = (steps - j) * m0 + g * (steps * (steps - 1) - j * (j - 1)) / 2 if steps > j else 0.0
        return steps * f + j * batch * self.decode_per_seq_s + memory

    def steps_within(self, dt: float, batch: int, kv0: float) -> int:
        """How many whole decode steps fit in `dt` seconds (the inverse of decode_s): a closed-form guess,
        then corrected against decode_s itself so that an event scheduled at decode_s(k) finds its k steps
        done despite round-off."""
        if dt <= 0:
            return 0
        k = self._steps_guess(dt, batch, kv0)
        if k >= _MANY:
            return _MANY
        tol = dt * (1 + 1e-9)
        while k > 0 and self.decode_s(k, batch, kv0) > tol:
            k -= 1
        while self.decode_s(k + 1, batch, kv0) <= tol:
            k += 1
        return k

    def _steps_guess(self, dt: float, batch: int, kv0: float) -> int:
        f, v = self.decode_fixed_s, self.decode_per_kv_s
        if not self.decode_roofline:
            a = f + self.weights_s(batch) + batch * self.decode_per_seq_s + v * (kv0 - batch / 2)
            return _series_steps(dt, a, v * batch / 2)
        j, a1 = self._compute_steps(batch, kv0), f + batch * self.decode_per_seq_s
        if j > 0 and (j == math.inf or dt < j * a1):
            return int(dt / a1) if a1 > 0 else _MANY
        kv1 = kv0 + j * batch  # the memory-bound steps: the sum form's series from here, without compute
        a = f + self.weights_s(batch) + v * (kv1 - batch / 2)
        return j + _series_steps(dt - j * a1, a, v * batch / 2)

    def decode_lb(self, tokens: float, kv_sum: float, steps: float) -> float:
        """A lower bound on the decode time of any schedule on one server that generates `tokens` tokens in
        at least `steps` decode steps, `kv_sum` being the sum over its steps of the KV tokens held. Sum form:
        exactly the sum of its steps' costs. Roofline: a sum of maxima is at least the maximum of the sums. MoE:
        each step reads at least the experts of one sequence (weights_s(1)), whatever the batch."""
        f, w = self.decode_fixed_s, self.weights_s(1)
        compute, memory = tokens * self.decode_per_seq_s, steps * w + kv_sum * self.decode_per_kv_s
        return steps * f + (max(compute, memory) if self.decode_roofline else compute + memory)

    def sync_s(self) -> float:
        return self.sync_fixed_s + self.weight_bytes * self.sync_per_byte_s


def _series_steps(dt: float, a: float, c: float) -> int:
    """About the largest k with a k + c k^2 <= dt (the caller corrects it by one or two)."""
    if dt <= 0:
        return 0
    if c <= 0:
        return int(dt / a) if a > 0 else _MANY
    return int(2 * dt / (a + (a * a + 4 * c * dt) ** 0.5))  # the positive root, without cancellation


@dataclass(frozen=True)
class Layout:
    """A split of the cluster: trainer TP x PP x DP, and rollout servers of rollout_tp GPUs each. ep: the
    trainer's expert-parallel size (MoE models; expert tensor parallel 1)."""

    tp: int
    pp: int
    dp: int
    rollout_tp: int
    num_servers: int
    ep: int = 1

    @property
    def trainer_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_tp * self.num_servers


def expert_params(shape) -> int:
    """Every routed expert's parameters (0 for a dense model)."""
    experts = getattr(shape, "experts", 0)
    return shape.layers * experts * 3 * shape.hidden * shape.expert_ffn if experts else 0


def kv_bytes_per_gpu(shape, tp: int) -> float:
    """K and V of one token in bf16 on one GPU of a server of TP `tp` (KV heads replicated past kv_heads)."""
    return 2 * shape.layers * math.ceil(shape.kv_heads / tp) * shape.head_dim * 2


@dataclass(frozen=True)
class _Work:
    """What the hardware does, before any efficiency: seconds at peak, bytes, links."""

    peak: float  # BF16 FLOP/s
    hbm: float  # B/s
    train_tok_at_peak_s: float  # per token, on the trainer's GPUs together, bubble included, MFU 1
    tp_bytes_tok: float  # tensor-parallel activation traffic per token (forward and backward), per rank
    a2a_bytes_tok: float  # MoE token dispatch (all-to-all) per token (forward and backward), per rank
    a2a_link: float  # B/s per direction
    opt_bytes: float  # the optimizer's HBM traffic per GPU per update
    dp_bytes: float  # data-parallel collectives per rank per update
    dp_link: float  # B/s per direction
    read_bytes: float  # weights read per GPU per decode step (MoE: all but the routed experts)
    expert_bytes: float  # every routed expert's weights per GPU (MoE; a step reads those its tokens chose)
    kv_bytes: float  # per KV token per GPU
    flops_seq: float  # per GPU per decode step per sequence (and per prompt token in prefill)
    kv_pool: float  # bytes per GPU for the KV cache
    weight_bytes: float  # what a weight sync sends
    sync_link: float  # B/s per direction


def _work(shape, params: int, layout: Layout, g: Gpu, *, micro_batches: int, mean_context: float,
          mem_fraction_static: float, same_node_sync: bool, fp8: bool, gpus_per_node: int,
          use_distributed_optimizer: bool, grad_bytes: int) -> _Work:
    peak, hbm = g.bf16_tflops * 1e12, g.hbm_tb_s * 1e12
    n_mm = matmul_params(shape, params)
    n_act = n_mm - inactive_expert_params(shape)  # a token's matmuls run through its top-k experts only
    bf16_flops = train_flops_per_token(shape, params, mean_context)
    fp8_s = 0.0
    if fp8:
        if g.fp8_tflops is None:
            raise ValueError(f"model.fp8 is set, but the {g.name} has no FP8 Tensor Cores: unset model.fp8 "
                             "(train in BF16) or plan for a GPU with FP8 (h100, h200)")
        layers_mm = n_act - shape.vocab * shape.hidden  # the output layer stays BF16 (megatron-core's own linear)
        fp8_s = 6 * layers_mm / (g.fp8_tflops * 1e12)
        bf16_flops -= 6 * layers_mm
    bubble = 1 + (layout.pp - 1) / max(micro_batches, 1)
    train_tok = (bf16_flops / peak + fp8_s) * bubble / layout.trainer_gpus
    # tensor parallelism moves every token's activations: per layer an all-gather and a reduce-scatter (or an
    # all-reduce, the same bytes) around attention and around the MLP, forward and again backward, each
    # (TP - 1) / TP of hidden x 2 bytes per rank; a stage holds layers / PP, a replica sees 1 / DP of the tokens
    # (MoE with expert tensor parallel 1: around attention only; the experts take the sequence-parallel shard)
    tp = layout.tp
    moe = bool(getattr(shape, "experts", 0))
    tp_bytes = (shape.layers / layout.pp) * (4 if moe else 8) * (tp - 1) / tp * shape.hidden * PARAM_BYTES * bubble \
        / layout.dp
    # MoE token dispatch: per layer each token's k copies of its hidden state go to their experts and come
    # back (two all-to-alls forward, two again backward), (EP - 1) / EP of them to other ranks; a rank
    # dispatches its sequence-parallel share (1 / TP) of its replica's tokens. The expert-parallel group is
    # EP consecutive ranks (megatron-core's order): NVLink when they fit a node, else InfiniBand
    ep = layout.ep
    a2a_bytes = (shape.layers / layout.pp) * 4 * shape.topk * shape.hidden * PARAM_BYTES * (ep - 1) / ep * bubble \
        / (layout.dp * tp) if moe and ep > 1 else 0.0
    model_parallel = layout.tp * layout.pp
    dp = layout.dp
    owned = params / (layout.trainer_gpus if use_distributed_optimizer else model_parallel)
    shard = params / model_parallel  # one rank's parameters, the size of its gradient buffer
    if dp <= 1 and not moe:
        dp_bytes = 0.0
    elif moe:  # dense and expert parameters reduce over their own groups: DP, and expert-DP = TP x DP / EP
        experts = expert_params(shape)
        parts = (((params - experts) / model_parallel, dp), (experts / (layout.pp * ep), tp * dp // ep))
        per_byte = grad_bytes + PARAM_BYTES if use_distributed_optimizer else 2 * grad_bytes
        dp_bytes = sum((n - 1) / n * sh * per_byte for sh, n in parts if n > 1)
        if not use_distributed_optimizer:  # each rank owns its whole shard: the experts of its EP rank
            owned = (params - experts) / model_parallel + experts / (layout.pp * ep)
    elif use_distributed_optimizer:  # reduce-scatter the gradients, all-gather the updated parameters
        dp_bytes = (dp - 1) / dp * shard * (grad_bytes + PARAM_BYTES)
    else:  # all-reduce the gradients
        dp_bytes = 2 * (dp - 1) / dp * shard * grad_bytes
    one_node = layout.trainer_gpus <= gpus_per_node
    rtp = layout.rollout_tp
    weights = params * PARAM_BYTES
    kv = kv_bytes_per_gpu(shape, rtp)
    experts_read = expert_params(shape) * PARAM_BYTES / rtp  # the servers split each expert over their TP
    return _Work(
        peak=peak, hbm=hbm, train_tok_at_peak_s=train_tok, tp_bytes_tok=tp_bytes, a2a_bytes_tok=a2a_bytes,
        a2a_link=(g.nvlink_gb_s if ep <= gpus_per_node else g.ib_gb_s_per_gpu) * 1e9,
        opt_bytes=32 * owned, dp_bytes=dp_bytes,
        dp_link=(g.nvlink_gb_s if one_node else g.ib_gb_s_per_gpu) * 1e9,
        read_bytes=n_mm * PARAM_BYTES / rtp - experts_read, expert_bytes=experts_read, kv_bytes=kv,
        flops_seq=2 * n_act / rtp,
        kv_pool=max(g.memory_gb * 1e9 * mem_fraction_static - weights / rtp, 0.0), weight_bytes=weights,
        sync_link=(g.nvlink_gb_s if same_node_sync else g.ib_gb_s_per_gpu) * 1e9)


def _tp_comm(shape, rtp: int, allreduce_s: float) -> float:
    # tensor parallelism adds two all-reduces per layer to every decode step (attention and MLP outputs)
    return 2 * shape.layers * allreduce_s if rtp > 1 else 0.0


def from_hardware(shape, params: int, layout: Layout, gpu: Gpu | str, *, micro_batches: int,
                  mean_context: float, mem_fraction_static: float = 0.85, efficiency: Optional[dict] = None,
                  same_node_sync: bool = False, fp8: bool = False, gpus_per_node: int = 8,
                  use_distributed_optimizer: bool = True, grad_bytes: int = GRAD_BYTES,
                  reference: Optional[str] = None) -> Costs:
    """Costs from the model's shape (models.memory.ModelShape), its parameter count and the GPU's datasheet
    figures, with the efficiencies of plan.hardware.EFFICIENCY (or `efficiency`'s overrides); decode is the
    roofline. same_node_sync: the servers share the trainer's node (the sync runs over NVLink). fp8: the
    recipe trains in FP8 (model.fp8). gpus_per_node: the trainer's gradient reduce stays on NVLink when all its
    GPUs fit one node. grad_bytes: the dtype the gradients are reduced in (fp32 here, GRAD_BYTES). reference:
    None, or "offloaded" / "resident" for a reference model with its weights on the host between its passes
    or on the GPU (reference_costs)."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    eff = {**EFFICIENCY, **(efficiency or {})}
    w = _work(shape, params, layout, g, micro_batches=micro_batches, mean_context=mean_context,
              mem_fraction_static=mem_fraction_static, same_node_sync=same_node_sync, fp8=fp8,
              gpus_per_node=gpus_per_node, use_distributed_optimizer=use_distributed_optimizer,
              grad_bytes=grad_bytes)
    train_tok = w.train_tok_at_peak_s / eff["mfu"]
    tp_comm = w.tp_bytes_tok / (g.nvlink_gb_s * 1e9 * eff["link"])  # not overlapped (no tp_comm_overlap)
    if w.a2a_bytes_tok:  # MoE dispatch, not overlapped either (megatron's a2a overlap is off)
        tp_comm += w.a2a_bytes_tok / (w.a2a_link * eff["link"])
    hbm = w.hbm * eff["hbm"]
    rtp = layout.rollout_tp
    ref_token_s, ref_copy_s = reference_costs(shape, params, layout, g, reference, train_tok / 3 + tp_comm / 2, eff)
    return Costs(
        train_fixed_s=eff["train_fixed_s"],
        train_per_update_s=w.opt_bytes / hbm + w.dp_bytes / (w.dp_link * eff["link"]),
        train_per_token_s=train_tok + tp_comm,
        logprob_per_token_s=train_tok / 3 + tp_comm / 2,  # forward only: a third of the FLOPs, half the traffic
        decode_fixed_s=eff["decode_fixed_s"] + _tp_comm(shape, rtp, eff["tp_allreduce_s"]),
        decode_per_seq_s=w.flops_seq / (w.peak * eff["decode_compute"]),
        decode_per_kv_s=w.kv_bytes / hbm,
        prefill_per_token_s=w.flops_seq / (w.peak * eff["prefill"]),
        max_running=int(max(1, min(eff["max_running_cap"], w.kv_pool / w.kv_bytes / max(mean_context, 1.0)))),
        sync_fixed_s=eff["sync_fixed_s"],
        sync_per_byte_s=1 / (w.sync_link * eff["link"]),
        weight_bytes=w.weight_bytes,
        decode_weights_s=w.read_bytes / hbm,
        decode_roofline=True,
        decode_expert_s=w.expert_bytes / hbm,
        expert_frac=shape.topk / shape.experts if getattr(shape, "experts", 0) else 0.0,
        reference_per_token_s=ref_token_s, reference_copy_s=ref_copy_s,
        client_per_sample_s=eff.get("client_per_sample_s", 0.0),  # a host figure: only a calibration sets it
        source=f"{g.name} datasheet{', FP8' if fp8 else ''}, efficiencies {eff}",
    )


REFERENCE_PLACES = (None, "offloaded", "resident")


def reference_costs(shape, params: int, layout: Layout, g: Gpu, reference: Optional[str], logprob_per_token_s: float,
                    eff: dict) -> tuple[float, float]:
    """(the reference pass's seconds per token, its weights' host-to-GPU copy per step) for `reference` (None:
    no reference model, (0, 0)). The pass is a log-prob pass (`logprob_per_token_s`); the copy moves the
    heaviest stage's reference weights in bf16 on one rank, every rank at once over its own host link."""
    if reference not in REFERENCE_PLACES:
        raise ValueError(f"reference = {reference!r} must be one of {REFERENCE_PLACES}")
    if reference is None:
        return 0.0, 0.0
    if reference == "resident":
        return logprob_per_token_s, 0.0
    experts = expert_params(shape)
    rank_bytes = ((params - experts) / layout.tp + experts / layout.ep) / layout.pp * PARAM_BYTES
    return logprob_per_token_s, rank_bytes / (g.pcie_gb_s * 1e9 * eff.get("host_link", eff["link"]))


def efficiency_of(costs: Costs, shape, params: int, layout: Layout, gpu: Gpu | str, *, micro_batches: int,
                  mean_context: float, same_node_sync: bool = False, has_engine: bool = True, fp8: bool = False,
                  gpus_per_node: int = 8, use_distributed_optimizer: bool = True,
                  grad_bytes: int = GRAD_BYTES) -> dict:
    """The efficiencies under which `from_hardware` gives `costs` (fitted on a run of this layout and GPU):
    from_hardware inverted, term by term. The decode terms only when the run traced its engine's steps; a
    calibration's sum form holds the weight read in decode_fixed_s, a roofline in decode_weights_s."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    w = _work(shape, params, layout, g, micro_batches=micro_batches, mean_context=mean_context,
              mem_fraction_static=0.0, same_node_sync=same_node_sync, fp8=fp8, gpus_per_node=gpus_per_node,
              use_distributed_optimizer=use_distributed_optimizer, grad_bytes=grad_bytes)
    out = {"train_fixed_s": costs.train_fixed_s}
    if costs.client_per_sample_s > 0:
        out["client_per_sample_s"] = costs.client_per_sample_s
    if costs.sync_s() > EFFICIENCY["sync_fixed_s"]:
        out["link"] = w.weight_bytes / (w.sync_link * (costs.sync_s() - EFFICIENCY["sync_fixed_s"]))
    tp_comm = w.tp_bytes_tok / (g.nvlink_gb_s * 1e9 * out.get("link", EFFICIENCY["link"]))
    if w.a2a_bytes_tok:
        tp_comm += w.a2a_bytes_tok / (w.a2a_link * out.get("link", EFFICIENCY["link"]))
    if costs.train_per_token_s > tp_comm:
        out["mfu"] = w.train_tok_at_peak_s / (costs.train_per_token_s - tp_comm)
    if has_engine and costs.decode_per_kv_s > 0:
        hbm = w.kv_bytes / (w.hbm * costs.decode_per_kv_s)
        in_fixed = 0.0 if costs.decode_roofline or costs.decode_weights_s > 0 else w.read_bytes / (w.hbm * hbm)
        tp_comm = _tp_comm(shape, layout.rollout_tp, EFFICIENCY["tp_allreduce_s"])
        out.update(hbm=hbm, decode_fixed_s=max(costs.decode_fixed_s - in_fixed - tp_comm, 0.0))
        if costs.decode_per_seq_s > 0:
            out["decode_compute"] = w.flops_seq / (w.peak * costs.decode_per_seq_s)
        if costs.prefill_per_token_s > 0:
            out["prefill"] = w.flops_seq / (w.peak * costs.prefill_per_token_s)
    return out
