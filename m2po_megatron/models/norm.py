"""Norm weights in the params dtype for megatron's local layers (the sdpa and local backends).

megatron-core 0.19.2 builds the local spec's norms (and the final norm, without TE or Apex) as `WrappedTorchNorm`,
i.e. `torch.nn.RMSNorm(hidden)` with no dtype: fp32 weights in a bf16 model. torch then refuses its fused RMSNorm
kernel (input and weight dtypes differ) and its composite path keeps two fp32 [S, H] copies per norm for backward,
which the memory estimate (fused RMSNorm on CUDA) does not count. HF's bf16 Qwen/Llama keep their norm weights
in bf16, and megatron's optimizer keeps fp32 main params for every bf16 parameter, so bf16 norm weights lose
nothing. Megatron has no config knob for this, so the built norms are cast, on every device. TE's norms (TENorm)
already take config.params_dtype and are not torch.nn.RMSNorm, so they are left alone."""
from __future__ import annotations


def norms_to_params_dtype(model, params_dtype) -> int:
    """Cast every torch.nn.RMSNorm / LayerNorm weight (and bias) of `model` to params_dtype, in place (the
    Parameter objects stay, so attributes megatron set on them survive). Returns how many norms were cast.
    Through `.data`, not Module.to: under fake tensors (m2po rehearse) `to` swaps tensors, which a fake
    parameter refuses."""
    import torch

    n = 0
    for m in model.modules():
        if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            for p in m.parameters(recurse=False):
                p.data = p.data.to(dtype=params_dtype)
            n += 1
    return n
