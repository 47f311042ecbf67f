"""Transformer Engine on this GPU: its layers (te.pytorch.LayerNormMLP and Linear, the ones megatron-core's TE
spec builds) on a tiny model, one training step in bf16 and the same step under fp8_autocast with a
DelayedScaling recipe, compared. Lazy: transformer_engine is imported only on a GPU (it does not install on
CPU). Written against TE's public API; it has not run in this project (no GPU was lent to it)."""
from __future__ import annotations

import importlib.util

from m2po_megatron.preflight.checks import CheckFailed, CheckSkipped

HIDDEN, FFN, TOKENS = 256, 1024, 512
MAX_FP8_REL_ERR = 0.15  # FP8 (e4m3 forward) against bf16: a few percent on a random tiny MLP; far past it is wrong


def run(cfg, ctx: dict) -> dict:
    if not ctx["gpu"]:
        raise CheckSkipped("no GPU: Transformer Engine and FP8 need one (its CPU tests cannot install it)")
    if importlib.util.find_spec("transformer_engine") is None:
        raise CheckFailed("transformer_engine is not importable",
                          "run in the project's image (docs/container.md), or set model.attention_backend=sdpa and "
                          "model.fp8=null to train without TE")
    import torch
    import transformer_engine
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    major, minor = torch.cuda.get_device_capability()
    numbers: dict = {"te_version": getattr(transformer_engine, "__version__", "?"),
                     "gpu": torch.cuda.get_device_name(), "capability": f"{major}.{minor}"}

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(te.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.bfloat16),
                                   te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16)).cuda()

    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step(fp8: bool):
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        with te.fp8_autocast(enabled=fp8, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID) if fp8 else None):
            y = m(x)
        loss = y.float().pow(2).mean()
        loss.backward()
        grad = torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])
        opt.step()
        torch.cuda.synchronize()
        return y.float(), float(loss), grad

    y16, loss16, g16 = step(False)
    numbers["bf16_loss"] = loss16
    if not (torch.isfinite(y16).all() and torch.isfinite(g16).all()):
        raise CheckFailed("TE's bf16 step gave non-finite values", "a broken TE build for this CUDA: use the image's "
                          "TE (docs/container.md)", numbers)
    if (major, minor) < (8, 9):
        numbers["fp8"] = "not on this GPU (FP8 needs compute capability 8.9+)"
        if cfg.model.fp8:
            raise CheckFailed(f"the recipe sets model.fp8={cfg.model.fp8} but this GPU ({major}.{minor}) has no FP8 "
                              "Tensor Cores", "set model.fp8=null on this GPU (H100/H200 have FP8)", numbers)
        return numbers
    y8, loss8, g8 = step(True)
    rel = float((y8 - y16).norm() / y16.norm())
    grel = float((g8 - g16).norm() / g16.norm())
    numbers.update(fp8_loss=loss8, fp8_output_rel_err=round(rel, 4), fp8_grad_rel_err=round(grel, 4))
    if not (torch.isfinite(y8).all() and torch.isfinite(g8).all()) or rel > MAX_FP8_REL_ERR:
        raise CheckFailed(f"the FP8 step differs from bf16 by {rel:.1%} (output; gradients {grel:.1%}), more than "
                          f"{MAX_FP8_REL_ERR:.0%}", "a TE/cuBLAS mismatch: use the image's TE; train without FP8 "
                          "(model.fp8=null) until it passes", numbers)
    return numbers
