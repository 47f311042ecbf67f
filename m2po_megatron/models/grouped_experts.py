"""A MoE layer's local experts as one grouped matrix multiply without Transformer Engine (`model.moe_grouped_gemm`;
docs/moe.md "Grouped experts without Transformer Engine").

megatron-core 0.19.2 groups experts only through TE (TEGroupedMLP); its local spec runs a SequentialMLP, one MLP
per local expert in a Python loop (about ten kernels and two tiny GEMMs per expert and pass). GroupedExperts keeps
each layer's local experts in two 3-D parameters and multiplies all experts' token segments at once:
- torch's grouped GEMM (`torch.nn.functional.grouped_mm`, one kernel per matrix and pass) for bf16 on a CUDA GPU
  of compute capability 8.0 or newer, the dtype and devices torch's kernel is built for;
- otherwise (CPU, fp32, fp16, older GPUs) one matmul per expert on views of the same parameters: the arithmetic
  of SequentialMLP, so fp32 results equal it.

Parameters (no bias: Qwen3-MoE's experts have none):
  linear_fc1.weight [local experts, 2 x F / ETP, H]  each expert's rows as SequentialMLP's linear_fc1 holds them
                                                      (this ETP rank's gate rows, then its up rows)
  linear_fc2.weight [local experts, H, F / ETP]
Naming: models.loading.global_named_parameters yields each expert's slice under TEGroupedMLP's per-expert name
(`mlp.experts.linear_fc1.weight{e}`, e global), which the HF weight table (models/weights.py) already maps, so
loading, the weight sync and conversion need no table of their own. The dist checkpoint holds the same tensors as
SequentialMLP's (keys, global shapes, offsets), so a checkpoint saved with either loads into the other.

Megatron imports are at module level: import this module only where megatron-core is installed (the builder does,
inside its functions)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule


def grouped_mm_usable(x: torch.Tensor) -> bool:
    """torch's grouped GEMM kernel runs for these activations (bf16 on a CUDA GPU with compute capability >= 8.0)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")):
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 8


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], offsets: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ weight[e].T for x [tokens, in] sorted by expert (counts[e]
    rows each, as megatron's dispatcher hands them over) and weight [experts, out, in]. offsets: counts' cumulative
    sum as int32 on x's device (given when the grouped kernel runs, computed once per layer)."""
    if offsets is not None:
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    parts = [seg @ weight[e].t() for e, seg in enumerate(torch.split(x, counts))]
    return torch.cat(parts, dim=0) if parts else x.new_empty(0, weight.shape[1])


class _Weight(torch.nn.Module):
    """Holds one 3-D parameter, so its name reads `linear_fc1.weight` like the other MLPs' linears. Its extra
    state stands for the per-expert `_extra_state` objects SequentialMLP's linears store (all None), so
    checkpoints of either layout hold the same objects and load into the other."""

    def __init__(self, weight: torch.nn.Parameter):
        super().__init__()
        self.weight = weight

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        pass


class GroupedExperts(MegatronModule):
    """Drop-in for megatron's SequentialMLP in the local MoE spec (same constructor and forward signature)."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, name: str | None = None):
        super().__init__(config=config)
        if not config.gated_linear_unit or config.activation_func is not F.silu or config.add_bias_linear:
            raise ValueError("GroupedExperts runs bias-free SwiGLU experts (Qwen3-MoE); this config has "
                             f"gated_linear_unit={config.gated_linear_unit}, activation_func="
                             f"{getattr(config.activation_func, '__name__', config.activation_func)}, "
                             f"add_bias_linear={config.add_bias_linear}: set model.moe_grouped_gemm = false")
        if config.fp8 or getattr(config, "fp4", None) or config.moe_apply_probs_on_input:
            raise ValueError("GroupedExperts has no FP8/FP4 or moe_apply_probs_on_input path: "
                             "set model.moe_grouped_gemm = false")
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        etp = self.tp_group.size()
        ffn = config.moe_ffn_hidden_size
        if ffn % etp:
            raise ValueError(f"moe_ffn_hidden_size {ffn} is not divisible by expert_tensor_parallel_size {etp}")
        self.ffn_per_rank = ffn // etp
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        shape1 = (num_local_experts, 2 * self.ffn_per_rank, config.hidden_size)
        shape2 = (num_local_experts, config.hidden_size, self.ffn_per_rank)
        w1 = torch.nn.Parameter(torch.empty(shape1, dtype=config.params_dtype, device=device))
        w2 = torch.nn.Parameter(torch.empty(shape2, dtype=config.params_dtype, device=device))
        # As megatron's expert linears mark theirs: split over ETP (rows of fc1, columns of fc2), and reduced over
        # the expert-data-parallel group (allreduce=False) when experts use their own groups.
        expert_groups = config.expert_model_parallel_size > 1 or (
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        for w, dim, stride in ((w1, 1, 2), (w2, 2, 1)):
            set_tensor_model_parallel_attributes(w, True, dim, stride)
            w.allreduce = not expert_groups
        self.linear_fc1, self.linear_fc2 = _Weight(w1), _Weight(w2)
        if config.perform_initialization and not w1.is_meta:
            self._initialize(w1, config.init_method)
            self._initialize(w2, config.output_layer_init_method)

    @torch.no_grad()
    def _initialize(self, weight: torch.Tensor, init_method) -> None:
        """Each expert's matrix with the layer's init method (random starts only: runs load real weights)."""
        ctx = (get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()) if weight.is_cuda
               else contextlib.nullcontext())
        with ctx:
            for e in range(weight.shape[0]):
                init_method(weight[e])

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """[tokens, H] sorted by local expert, tokens_per_expert [local experts] (on the host, as megatron's
        all-to-all dispatcher gives it), probs [tokens] -> ([tokens, H], None), as SequentialMLP."""
        x = permuted_local_hidden_states
        counts = [int(c) for c in tokens_per_expert.tolist()]
        offsets = None
        if grouped_mm_usable(x):
            offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(
                x.device, non_blocking=True)
        h = grouped_linear(x, self.linear_fc1.weight, counts, offsets)
        probs = permuted_probs.unsqueeze(-1)
        if self.config.bias_activation_fusion:
            h = weighted_bias_swiglu_impl(h, None, probs, self.config.activation_func_fp8_input_store)
        else:  # megatron's MLP without fusion: silu(gate) * up, scaled by the routing weight in the input's dtype
            gate, up = torch.chunk(h, 2, dim=-1)
            h = (F.silu(gate) * up * probs).to(h.dtype)
        return grouped_linear(h, self.linear_fc2.weight, counts, offsets), None

    def backward_dw(self):
        """Weight gradients are computed in the backward itself (no delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """SequentialMLP's tensors (`{prefix}experts.linear_fc1.weight` etc., one global [.., experts, rows, cols]
        tensor each) from this rank's slab of experts; fc1's gate and up halves are stored apart, as megatron's
        swiglu factory stores them, so the global tensor is [all gate rows; all up rows] at any ETP."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

        if (metadata or {}).get("singleton_local_shards"):
            raise ValueError("GroupedExperts stores SequentialMLP's layout only (singleton_local_shards is unset "
                             "in this project's checkpoints)")
        n = len(sharded_offsets)
        ep, ep_rank = self.ep_group.size(), self.ep_group.rank()
        etp, etp_rank = self.tp_group.size(), self.tp_group.rank()
        replica = (0, 0, self.dp_group.rank())
        experts = (n, ep_rank, ep)

        def tensor(key, data, *offsets):
            return ShardedTensor.from_rank_offsets(key, data, *sharded_offsets, experts, *offsets,
                                                   replica_id=replica, prepend_axis_num=n)

        def build_fc1(key, t, replica_id, flattened_range):
            gate, up = (h.contiguous() for h in torch.chunk(t, 2, dim=1))
            return [tensor(key, gate, (n + 1, etp_rank, 2 * etp)), tensor(key, up, (n + 1, etp_rank + etp, 2 * etp))]

        key1, key2 = f"{prefix}experts.linear_fc1.weight", f"{prefix}experts.linear_fc2.weight"
        out = {
            f"{prefix}linear_fc1.weight": ShardedTensorFactory(key1, self.linear_fc1.weight, build_fc1,
                                                               _cat_halves, replica),
            f"{prefix}linear_fc2.weight": tensor(key2, self.linear_fc2.weight, (n + 2, etp_rank, etp)),
        }
        # SequentialMLP's linears each store an `_extra_state` object (None) per global expert: the same here
        # (replica ids as megatron gives them: TP rank, expert-DP rank)
        first, total = ep_rank * self.num_local_experts, ep * self.num_local_experts
        obj_replica = (0, ps.get_tensor_model_parallel_rank(), self.dp_group.rank())
        for fc in ("linear_fc1", "linear_fc2"):
            out[f"{prefix}{fc}._extra_state"] = [
                make_sharded_object_for_checkpoint(None, f"{prefix}experts.{fc}._extra_state",
                                                   (*sharded_offsets, (n, first + j, total)), obj_replica)
                for j in range(self.num_local_experts)]
        return out


def _cat_halves(parts) -> torch.Tensor:
    return torch.cat(list(parts), dim=1)


def with_grouped_experts(layer):
    """A megatron local layer spec whose MoE layer builds GroupedExperts instead of SequentialMLP."""
    mlp = layer.submodules.mlp
    subs = mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else None
    if subs is None or not hasattr(subs, "experts"):
        raise ValueError("model.moe_grouped_gemm needs a MoE model (this layer spec has no experts): "
                         "set model.moe_grouped_gemm = false")
    moe = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": dataclasses.replace(
        subs, experts=GroupedExperts)})
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=moe))


__all__ = ["GroupedExperts", "grouped_linear", "grouped_mm_usable", "with_grouped_experts"]
