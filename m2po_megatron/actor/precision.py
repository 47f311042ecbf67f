"""Precision settings: fp32 on CPU; bf16 (fp32 main grads and params in the optimizer) on GPU; optional
FP8 through Transformer Engine. Checked before any model is built, with errors that name the fix."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
# Minimum CUDA compute capability per recipe (Ada/Hopper for FP8, Blackwell for MX block scaling).
_MIN_CC = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


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
    if fp8 is None:
        if fp8_recipe is not None:
            raise ValueError("fp8_recipe is set but fp8 is None: set fp8='e4m3' or 'hybrid', or drop fp8_recipe")
        return Precision(precision)
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8={fp8!r}: use one of {FP8_FORMATS} or None")
    recipe = fp8_recipe or "delayed"
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe={recipe!r}: use one of {FP8_RECIPES}")
    if not cuda:
        raise ValueError("fp8 training needs a CUDA GPU with Transformer Engine; this machine has no GPU "
                         "(drop fp8, or run on an FP8-capable GPU)")
    if not te_available:
        raise ValueError("fp8 needs Transformer Engine (pip install transformer-engine[pytorch]); it is not "
                         "importable here")
    if precision != "bf16":
        raise ValueError("fp8 runs on top of bf16: set precision='bf16'")
    need = _MIN_CC[recipe]
    if compute_capability is not None and tuple(compute_capability) < need:
        raise ValueError(f"fp8_recipe={recipe!r} needs a GPU with compute capability >= {need[0]}.{need[1]}; "
                         f"this one is {compute_capability[0]}.{compute_capability[1]}")
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
