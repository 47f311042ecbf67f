"""What the CPU engine needs for Mixture-of-Experts models (Qwen3-MoE in transformers 5): the router's
choices of every forward, for SGLang's return_routed_experts (R3, rollout/routing.py), and HF's on-disk
per-expert weight names mapped onto the fused expert tensors transformers keeps in memory.

transformers 5 (models/qwen3_moe/modeling_qwen3_moe.py) fuses a layer's experts into
`mlp.experts.gate_up_proj` [E, 2*I, H] (cat(gate_proj, up_proj) per expert) and `mlp.experts.down_proj`
[E, H, I]; checkpoints, SGLang's loader and the trainer's weight sync name them per expert
(`mlp.experts.{e}.gate_proj.weight` [I, H], `.up_proj.weight` [I, H], `.down_proj.weight` [H, I]), which
transformers itself converts on load (conversion_mapping.py, "qwen2_moe": MergeModulelist(dim=0) then
Concatenate(dim=1) for gate/up, MergeModulelist(dim=0) for down). The router `mlp.gate.weight` [E, H] is
the same name on disk and in memory."""
from __future__ import annotations

import re
from typing import Optional

import torch

_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fused_expert_view(params: dict[str, torch.Tensor], name: str) -> Optional[torch.Tensor]:
    """The slice of a fused expert parameter that the per-expert on-disk tensor `name` fills (a view, so a
    copy_ into it writes the model), or None when `name` is not a per-expert name. KeyError/ValueError name
    the tensor when the model has no such expert."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    fused = f"{m['prefix']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"
    if fused not in params:
        raise KeyError(f"tensor {name!r}: the served model has no fused expert parameter {fused!r}")
    p, e = params[fused], int(m["e"])
    if p.dim() != 3 or e >= p.shape[0]:
        raise ValueError(f"tensor {name!r}: expert {e} is not in {fused!r} of shape {tuple(p.shape)}")
    if m["proj"] == "down_proj":
        return p[e]
    half = p.shape[1] // 2  # gate rows first, then up rows (transformers' Concatenate(dim=1) order)
    return p[e, :half] if m["proj"] == "gate_proj" else p[e, half:]


class RouterRecorder:
    """Forward hooks on every decoder layer's router (`mlp.gate`, which returns (logits, scores, indices)):
    after a forward over [B, T] tokens, `take(B, T)` is the chosen experts, int32 [B, T, layers, top_k]."""

    def __init__(self, model):
        layers = model.model.layers
        gates = [getattr(getattr(layer, "mlp", None), "gate", None) for layer in layers]
        dense = [i for i, g in enumerate(gates) if g is None or not hasattr(g, "top_k")]
        if dense:
            raise ValueError(f"--enable-return-routed-experts needs a MoE router in every layer; layers {dense} of "
                             f"this {type(model).__name__} have none (is it a MoE model?)")
        self.num_layers, self.topk = len(gates), int(gates[0].top_k)
        self.num_experts = int(gates[0].num_experts)
        self._seen: list[Optional[torch.Tensor]] = [None] * self.num_layers
        for i, g in enumerate(gates):
            g.register_forward_hook(lambda _m, _inp, out, i=i: self._record(i, out))

    def _record(self, layer: int, out) -> None:
        self._seen[layer] = out[2].detach()  # router_indices [B*T, top_k], rows in the input's row-major order

    def take(self, batch: int, length: int) -> torch.Tensor:
        """The last forward's choices as [batch, length, layers, top_k] int32; the record is then cleared."""
        if any(s is None for s in self._seen):
            raise RuntimeError("a router did not run in the last forward")
        out = torch.stack([s.reshape(batch, length, self.topk) for s in self._seen], dim=2).to(torch.int32)
        self._seen = [None] * self.num_layers
        return out

    def encode(self, routed: Optional[torch.Tensor]) -> str:
        """SGLang's meta_info.routed_experts of one sequence (rollout/routing.py); none fed yet: no rows."""
        from m2po_megatron.rollout.routing import encode

        return encode((routed if routed is not None else torch.zeros(0, self.num_layers, self.topk)).numpy())
