"""`m2po rehearse`: one training step of a recipe at full size on fake tensors, before any GPU is rented.

The recipe's MegatronActor (the same builder, layer spec, DDP wrapper, distributed optimizer, packing, loss with
M2PO's global mask, and optimizer step as `m2po train`) is built at the recipe's full size under torch's
FakeTensorMode, in a fake process group of the recipe's world size, once per distinct role: each pipeline
stage (first, middle, last; all its virtual chunks) at tensor and data parallel rank 0, each in a process of
its own. One optimizer mini-batch of sequences drawn like the paper's rollouts goes through the pipeline
schedule. The allocator model (infra.fake_world.RehearsalMode: every storage a block rounded to 512 bytes, live
until collected) gives each stage's peak and what is alive at it; every collective is logged with its group.

What a CPU cannot trace, and how the report covers it (never skipped silently; `NOT_TRACED`):
- Transformer Engine layers and FP8 (not installable without CUDA): the rehearsal builds megatron's local layers
  with the sdpa backend, sequence parallel as the recipe says; the recipe's own TE/FP8 memory is
  models/memory.py's formula.
- FlexAttention (a compiled higher-order op on CUDA): the CPU's per-sequence fused SDPA runs; the formula
  counts flex.
- torch.compile'd kernels (megatron's fused SwiGLU) run eagerly; CUDA's fused RMSNorm is the CPU's composite
  one (which keeps fp32 copies; the traced settings' estimate counts those, cuda_kernels=False).
- torch's AdamW runs its single-tensor kernel on CPU tensors; on a GPU its foreach kernel makes one fp32
  temporary per parameter (the formula's optimizer_step).
- The CUDA context, NCCL buffers and allocator fragmentation (the formula's fixed overhead).
- Mixture of experts: which experts a token picks (data; fake tensors have none). The dispatcher routes by a
  balanced map (infra.fake_world.balanced_moe_routing): every expert computes on tokens x k / E tokens, the
  balanced expectation; a real router's imbalance adds to the busiest expert's share. TE's grouped GEMM
  experts (GPU) are traced as megatron's SequentialMLP.
"""
from __future__ import annotations

NOT_TRACED = (
    "Transformer Engine layers and FP8 (no TE without CUDA): traced with megatron's local layers (sdpa backend; "
    "sequence parallel as the recipe says); the recipe's own numbers are models/memory.py's formula",
    "FlexAttention (compiled, CUDA): the CPU's per-sequence fused SDPA is traced; the formula counts flex",
    "torch.compile'd kernels (megatron's fused SwiGLU) run eagerly; RMSNorm is the CPU's composite kernel",
    "torch's foreach AdamW temporary (GPU): the CPU's single-tensor kernel is traced; the formula adds it",
    "CUDA context, NCCL buffers, allocator fragmentation: the formula's fixed overhead",
)
NOT_TRACED_MOE = (
    "MoE routing (data): every expert gets a balanced share of the tokens (tokens x k / E); a real router's "
    "imbalance adds to the busiest expert's activations",
    "TE's grouped-GEMM experts (GPU): traced as megatron's SequentialMLP (one MLP per local expert)",
)
