"""Datasheet figures of the GPUs `m2po plan` knows, and the efficiencies it assumes of them.

Sources (dense Tensor Core peaks, without sparsity; HBM bandwidth; NVLink per GPU and per direction; one
InfiniBand NIC per GPU, as in DGX/HGX nodes):
- H100 SXM5 80 GB: NVIDIA H100 Tensor Core GPU datasheet: BF16 989 TFLOPS and FP8 1,979 TFLOPS (the datasheet
  prints 1,979 and 3,958 "with sparsity"; dense is half), 3.35 TB/s, NVLink 900 GB/s. The 900 GB/s is the total
  of both directions (NVIDIA's NVLink page: 18 fourth-generation links of 50 GB/s bidirectional each), so one
  transfer gets 450 GB/s. DGX H100: 8 x ConnectX-7 400 Gb/s, 50 GB/s per GPU and direction.
- H200 SXM 141 GB: NVIDIA H200 Tensor Core GPU datasheet: BF16 989, FP8 1,979 TFLOPS dense, 4.8 TB/s, NVLink
  900 GB/s (450 per direction, as on H100); HGX H200 with a ConnectX-7 400 Gb/s per GPU.
- A100 SXM4 80 GB: NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS, 2.039 TB/s, NVLink 600 GB/s (12
  third-generation links; 300 GB/s per direction); no FP8 Tensor Cores (Ampere has none). DGX A100:
  8 x ConnectX-6 200 Gb/s (25 GB/s per GPU).
- Host link (a colocated layout's memory swap): PCIe Gen5 x16 on H100 and H200 SXM (the datasheets' 128 GB/s is
  both directions: 64 per direction), PCIe Gen4 x16 on A100 (64 GB/s both directions: 32).

The efficiencies are assumptions, not measurements: MFU 0.35 for
the trainer (Megatron-LM reports 40-47 % for dense GPT training at scale; RL batches of ragged sequences run
below that), 70 % of HBM bandwidth for decode and the optimizer, half the peak for prefill and for decode's
compute, half the link for the weight broadcast (it also gathers tensor-parallel shards and converts names) and
for the trainer's data-parallel gradient reduce, fixed costs of 2 ms per decode step (scheduling, sampling),
1 s per train step (the Ray call, packing) and 2 s per weight sync (pause, group set-up, resume), and at most
1024 sequences running on one server. A rollout server with TP > 1 pays two all-reduces per layer per decode
step, 15 us each: the latency of a small NCCL all-reduce within an NVLink node (nccl-tests' all_reduce_perf at
a few KB reports 10-20 us on H100 nodes).
`m2po plan --calibrate RUN_DIR --gpu GPU` replaces these with what a run measured (plan/calibrate.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["EFFICIENCY", "GPUS", "Gpu"]


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float  # dense
    hbm_tb_s: float
    memory_gb: float
    nvlink_gb_s: float  # per direction: what one transfer between two GPUs of a node gets
    ib_gb_s_per_gpu: float  # one NIC per GPU, per direction: what one sender gets across nodes
    fp8_tflops: Optional[float] = None  # dense; None: no FP8 Tensor Cores
    pcie_gb_s: float = 64.0  # to the host, per direction


GPUS = {
    "h100": Gpu("H100 SXM5 80GB", bf16_tflops=989.0, hbm_tb_s=3.35, memory_gb=80.0, nvlink_gb_s=450.0,
                ib_gb_s_per_gpu=50.0, fp8_tflops=1979.0),
    "h200": Gpu("H200 SXM 141GB", bf16_tflops=989.0, hbm_tb_s=4.8, memory_gb=141.0, nvlink_gb_s=450.0,
                ib_gb_s_per_gpu=50.0, fp8_tflops=1979.0),
    "a100": Gpu("A100 SXM4 80GB", bf16_tflops=312.0, hbm_tb_s=2.039, memory_gb=80.0, nvlink_gb_s=300.0,
                ib_gb_s_per_gpu=25.0, fp8_tflops=None, pcie_gb_s=32.0),
}

EFFICIENCY = {
    "mfu": 0.35,
    "hbm": 0.7,
    "decode_compute": 0.5,
    "prefill": 0.5,
    "link": 0.5,
    "decode_fixed_s": 0.002,
    "train_fixed_s": 1.0,
    "sync_fixed_s": 2.0,
    "max_running_cap": 1024,
    "tp_allreduce_s": 15e-6,
}
