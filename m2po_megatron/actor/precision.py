"""Precision settings: fp32 on CPU; bf16 (fp32 main grads and params in the optimizer) on GPU; optional
FP8 through Transformer Engine. Checked before any model is built, with errors that name the fix."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from m2po_megatron.models.builder import validate_fp8


@dataclass(frozen=True)
class Precision:
    params_dtype: str  # "fp32" | "bf16"
    fp8: Optional[str] = None
    fp8_recipe: Optional[str] = None

    def transformer_overrides(self) -> dict:
        import torch

        dt = torch.bfloat16 if self.params_dtype == "bf16" else torch.float32
        out = dict(params_dtype=dt, pipeline_dtype=dt, bf16=self.params_dtype == "bf16", fp16=False)
        if self.fp8:
            out.update(fp8=self.fp8, fp8_recipe=self.fp8_recipe)
        return out


def resolve_precision(precision: str, fp8: Optional[str], fp8_recipe: Optional[str], *, cuda: bool,
                      te_available: bool, compute_capability: Optional[tuple[int, int]] = None) -> Precision:
    """Validate the request against the machine. Pure: the caller probes CUDA / TE / capability."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r}: use 'bf16' (GPU) or 'fp32' (CPU, tests)")
    if not cuda and precision != "fp32":
        raise ValueError(f"precision={precision!r} needs a CUDA GPU; on CPU use precision='fp32'")
    recipe = validate_fp8(fp8, fp8_recipe, cuda=cuda, te=te_available, compute_capability=compute_capability)
    if fp8 is not None and precision != "bf16":
        raise ValueError("fp8 runs on top of bf16: set precision='bf16'")
    return Precision(precision, fp8, recipe)


def probe_machine() -> tuple[bool, bool, Optional[tuple[int, int]]]:
    """(cuda, transformer_engine importable, compute capability) for resolve_precision."""
    from m2po_megatron.infra.device import has_cuda

    cuda = has_cuda()
    te = False
    cc = None
    if cuda:
        import torch

        cc = tuple(torch.cuda.get_device_capability())
        try:
            import transformer_engine.pytorch  # noqa: F401  (lazy: GPU only)

            te = True
        except Exception:
            te = False
    return cuda, te, cc


def resolve_machine(attention_backend: str, params_dtype: str, fp8: Optional[str],
                    fp8_recipe: Optional[str]):
    """(attention backend, Precision) for this machine (CUDA, Transformer Engine, compute capability)."""
    from m2po_megatron.infra.device import rehearsing
    from m2po_megatron.models.builder import resolve_attention_backend

    cuda, te, cc = probe_machine()
    backend = resolve_attention_backend(attention_backend, cuda=cuda, te=te)
    precision = resolve_precision(params_dtype, fp8, fp8_recipe, cuda=cuda or rehearsing(),  # fake bf16
                                  te_available=te, compute_capability=cc)
    if precision.fp8 and backend != "te":
        raise ValueError(f"fp8 runs on Transformer Engine layers: set attention_backend='te' (or 'auto'), "
                         f"not {attention_backend!r}")
    return backend, precision
