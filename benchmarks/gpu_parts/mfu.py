"""Model FLOPs and MFU of the parts: the planner's count (m2po_megatron.plan.flops, imported, not restated)
over the step's seconds over the device's dense BF16 peak (plan.hardware.GPUS, the datasheets').

A part reports its batch's model FLOPs (`model_flops`, `model_flops_per_token`: real tokens, each sequence
attending within itself; padding and recompute not counted); gpu_check adds the achieved TFLOP/s and the MFU
once it knows the device (`annotate`). `mfu_with_logprob_pass`: the same step with its forward-only log-prob
pass (the M2PO mask over the mini-batch, which both the actor and the HF peer run) counted as the planner
prices it, a third of the training FLOPs more."""
from __future__ import annotations

from typing import Iterable, Optional

from m2po_megatron.plan.flops import FORWARD_ONLY_SHARE, train_flops
from m2po_megatron.plan.hardware import GPUS

# torch.cuda.get_device_name -> plan.hardware.GPUS key. Only the SXM boards the planner knows: an H100 PCIe
# (756 TFLOPS dense BF16) or an H100/H200 NVL (835) has a lower peak, so it gets no MFU unless --peak-tflops
# names the peak.
_NAMES = (("H200", "h200"), ("H100 80GB HBM3", "h100"), ("H100 SXM", "h100"), ("A100-SXM", "a100"))
_NOT_SXM = ("PCIE", "NVL")


def device_peak(name: Optional[str]) -> Optional[tuple[str, float]]:
    """(plan.hardware key, dense BF16 peak in TFLOP/s) of the CUDA device called `name`; None if unknown."""
    if not name or any(s in name.upper() for s in _NOT_SXM):
        return None
    for part, key in _NAMES:
        if part.upper() in name.upper():
            return key, GPUS[key].bf16_tflops
    return None


def model_flops(hf_config: dict, seq_lens: Iterable[int]) -> dict:
    """The batch's training FLOPs by the planner's count, in all and per token."""
    from m2po_megatron.models.memory import model_shape, param_count

    lens = list(seq_lens)
    flops = train_flops(model_shape(hf_config), param_count(hf_config), lens)
    return {"model_flops": flops, "model_flops_per_token": round(flops / max(sum(lens), 1), 1)}


def annotate(part: dict, peak_tflops: Optional[float]) -> dict:
    """`part` with achieved_tflops, mfu and (when the part says its step ran a `logprob_pass`)
    mfu_with_logprob_pass added where it has model_flops and step_s (mfu None without a peak: no GPU, or a
    device plan.hardware does not list). Returns `part`."""
    if "model_flops" not in part or not part.get("step_s"):
        return part
    achieved = part["model_flops"] / part["step_s"] / 1e12
    part["achieved_tflops"] = float(f"{achieved:.4g}")  # 4 digits: a toy model on CPU makes 0.001
    part["peak_tflops"] = peak_tflops
    part["mfu"] = round(achieved / peak_tflops, 4) if peak_tflops else None
    if part["mfu"] is not None and part.get("logprob_pass"):
        part["mfu_with_logprob_pass"] = round(part["mfu"] * (1 + FORWARD_ONLY_SHARE), 4)
    return part
