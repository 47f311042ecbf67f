"""Norm weights in the params dtype for megatron's local layers (the sdpa and local backends).

megatron-core 0.19.2 builds the local spec's norms (and the final norm, without TE or Apex) as `WrappedTorchNorm`,
i.e. `torch.nn.RMSNorm(hidden)` with no dtype: fp32 weights in a bf16 model. torch then refuses its fused RMSNorm
kernel (input and weight dtypes differ) and its composite path keeps two fp32 [S, H] copies per norm for backward,
which the memory estimate (fused RMSNorm on CUDA) does not count. HF's bf16 Qwen/Llama keep their norm weights
in bf16, and megatron's optimizer keeps fp32 main params for every bf16 parameter, so bf16 norm weights lose
nothing. Megatron has no config knob for this, so the built norms are cast, on every device. TE's norms (TENorm)
already take config.params_dtype and are not torch.nn.RMSNorm, so they are left alone.

`LocalNorm` lets the local layers run with sequence parallelism: megatron's `WrappedTorchNorm` refuses it, though a
norm needs nothing for it but what Apex's FusedLayerNorm (megatron's other non-TE norm) does, marking its weights
`sequence_parallel`, so that finalize_model_grads sums their grads over the TP group (each rank saw only its
share of the sequence)."""
from __future__ import annotations

import dataclasses


class LocalNorm:
    """The local layers' norm: torch's RMSNorm (or LayerNorm), as megatron's WrappedTorchNorm builds it, but
    with sequence parallelism allowed (module docstring). Same signature as WrappedTorchNorm."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        import torch

        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds or config.layernorm_zero_centered_gamma:
            raise ValueError(f"normalization = {config.normalization!r} (zero-centred gamma "
                             f"{config.layernorm_zero_centered_gamma}): the local layers build RMSNorm or "
                             "LayerNorm with a plain gamma")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def with_local_norms(spec):
    """A copy of a megatron layer spec in which every WrappedTorchNorm is LocalNorm (the spec's dataclasses
    and ModuleSpecs are replaced, never changed in place: megatron's specs are shared module constants)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return LocalNorm
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: with_local_norms(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    if isinstance(spec, (list, tuple)):
        return type(spec)(with_local_norms(x) for x in spec)
    return spec


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
