"""The one HF <-> Megatron weight table, used by loading, conversion and weight export (pure torch).

Names are Megatron's local-spec parameter names relative to a GPTModel, with *global* layer indices
(`decoder.layers.{i}.` where i counts from 0 over the whole model). Transformer Engine spec names
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) are accepted too.

Tensor-parallel layouts (ng = KV heads, qpg = heads / ng, hd = head_dim, H = hidden):
  qkv      linear_qkv rows are per KV group [q (qpg*hd) | k (hd) | v (hd)]; ranks take whole groups (dim 0)
  fc1      linear_fc1 rank r holds cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
  column   split dim 0 (embedding and output layer: vocab rows)
  row      split dim 1 (linear_proj, linear_fc2)
  replicated  norms, q/k norms, the MoE router
Mixture of experts (Qwen3-MoE): expert e of layer i is `decoder.layers.{i}.mlp.experts.local_experts.{e}.` with
e the *global* expert index (megatron's SequentialMLP names; TEGroupedMLP's `mlp.experts.linear_fc1.weight{e}` is
accepted too). Expert rules are `fc1` / `row` over the expert-tensor-parallel ranks (Rule.expert); which
experts a rank holds is expert parallelism's business (models.loading.global_named_parameters).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import torch

from m2po_megatron.models.hf_config import HFModelSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# An expert's parameter, in SequentialMLP's (local_experts.{e}.linear_fc1.weight) or TEGroupedMLP's
# (linear_fc1.weight{e}) form.
EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")
# TE fuses the pre-attention / pre-MLP norms into the following linear; same tensor, other name.
TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one Megatron parameter maps to HF tensors. hf names use {i} for the layer index."""

    megatron: str
    hf: tuple[str, ...]
    kind: str  # 'qkv' | 'qkv_bias' | 'fc1' | 'column' | 'row' | 'replicated'
    expert: bool = False  # split over the expert-tensor-parallel ranks instead of the tensor-parallel ones


def layer_rules(spec: HFModelSpec) -> list[Rule]:
    p = "model.layers.{i}."
    rules = [
        Rule("input_layernorm.weight", (p + "input_layernorm.weight",), "replicated"),
        Rule("self_attention.linear_qkv.weight",
             (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"), "qkv"),
    ]
    if spec.qkv_bias:
        rules.append(Rule("self_attention.linear_qkv.bias",
                          (p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"),
                          "qkv_bias"))
    if spec.qk_norm:
        rules += [Rule("self_attention.q_layernorm.weight", (p + "self_attn.q_norm.weight",), "replicated"),
                  Rule("self_attention.k_layernorm.weight", (p + "self_attn.k_norm.weight",), "replicated")]
    rules += [
        Rule("self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",), "row"),
        Rule("pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",), "replicated"),
    ]
    if spec.is_moe:
        rules.append(Rule("mlp.router.weight", (p + "mlp.gate.weight",), "replicated"))
        for e in range(spec.num_experts):
            rules += expert_rules(e)
    else:
        rules += [Rule("mlp.linear_fc1.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1"),
                  Rule("mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), "row")]
    return rules


def expert_rules(e: int) -> list[Rule]:
    """The two rules of (global) expert e of a layer."""
    p = f"model.layers.{{i}}.mlp.experts.{e}."
    m = f"mlp.experts.local_experts.{e}."
    return [Rule(m + "linear_fc1.weight", (p + "gate_proj.weight", p + "up_proj.weight"), "fc1", expert=True),
            Rule(m + "linear_fc2.weight", (p + "down_proj.weight",), "row", expert=True)]


def global_rules(spec: HFModelSpec) -> list[Rule]:
    out = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column"),
           Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")]
    # Tied: the last pipeline stage still holds an output_layer copy of the embedding (PP > 1).
    out.append(Rule("output_layer.weight",
                    ("model.embed_tokens.weight",) if spec.tie_word_embeddings else ("lm_head.weight",), "column"))
    return out


def rule_for(spec: HFModelSpec, megatron_name: str) -> tuple[Rule, int | None]:
    """The rule for a Megatron name (global layer index) and that layer index (None outside layers)."""
    m = _LAYER.match(megatron_name)
    if m:
        idx, rest = int(m.group(1)), TE_ALIASES.get(m.group(2), m.group(2))
        x = EXPERT.match(rest) if spec.is_moe else None
        if x:
            e, fc = (int(x.group(1)), x.group(2)) if x.group(1) is not None else (int(x.group(4)), x.group(3))
            if e < spec.num_experts:
                return expert_rules(e)[0 if fc == "linear_fc1" else 1], idx
        for r in layer_rules(spec):
            if r.megatron == rest:
                return r, idx
    else:
        for r in global_rules(spec):
            if r.megatron == megatron_name:
                return r, None
    raise KeyError(f"no HF mapping for Megatron parameter {megatron_name!r} ({spec.architecture})")


def hf_names(rule: Rule, layer: int | None) -> list[str]:
    return [n.format(i=layer) for n in rule.hf]


def expected_hf_names(spec: HFModelSpec) -> list[str]:
    """Every tensor name an HF checkpoint of this model has, in a deterministic order (embedding, layers in
    order, final norm, lm_head when untied)."""
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        for r in layer_rules(spec):
            names += hf_names(r, i)
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def megatron_names(spec: HFModelSpec) -> list[str]:
    """Megatron parameter names (global layer indices, local spec) in HF order; output_layer only when untied."""
    out = ["embedding.word_embeddings.weight"]
    for i in range(spec.num_layers):
        out += [f"decoder.layers.{i}.{r.megatron}" for r in layer_rules(spec)]
    out.append("decoder.final_layernorm.weight")
    if not spec.tie_word_embeddings:
        out.append("output_layer.weight")
    return out


# ---- HF full tensors -> one rank's Megatron shard -------------------------------------------------------

def _qkv_full(spec: HFModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    ng, hd = spec.num_key_value_heads, spec.head_dim
    tail = q.shape[1:]  # (H,) for weights, () for biases
    return torch.cat([q.reshape(ng, spec.queries_per_group * hd, *tail), k.reshape(ng, hd, *tail),
                      v.reshape(ng, hd, *tail)], dim=1).reshape(-1, *tail)


def to_megatron_shard(spec: HFModelSpec, rule: Rule, hf: Sequence[torch.Tensor], tp_rank: int = 0,
                      tp_size: int = 1) -> torch.Tensor:
    """This TP rank's Megatron tensor from the full HF tensors named by `rule.hf` (in that order)."""
    kind = rule.kind
    if kind == "replicated":
        return hf[0]
    if kind in ("qkv", "qkv_bias"):
        return _qkv_full(spec, *hf).chunk(tp_size, dim=0)[tp_rank]
    if kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    if kind == "column":
        return hf[0].chunk(tp_size, dim=0)[tp_rank]
    if kind == "row":
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    raise ValueError(kind)


def expected_hf_shapes(spec: HFModelSpec) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor, for validating a checkpoint before converting it."""
    H, hd, V, F = spec.hidden_size, spec.head_dim, spec.vocab_size, spec.intermediate_size
    nq, nkv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    Fe = spec.moe_intermediate_size
    per = {"input_layernorm.weight": (H,), "self_attn.q_proj.weight": (nq, H), "self_attn.k_proj.weight": (nkv, H),
           "self_attn.v_proj.weight": (nkv, H), "self_attn.q_proj.bias": (nq,), "self_attn.k_proj.bias": (nkv,),
           "self_attn.v_proj.bias": (nkv,), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
           "self_attn.o_proj.weight": (H, nq), "post_attention_layernorm.weight": (H,),
           "mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F),
           "mlp.gate.weight": (spec.num_experts, H)}
    expert = {"gate_proj.weight": (Fe, H), "up_proj.weight": (Fe, H), "down_proj.weight": (H, Fe)}
    out = {}
    for n in expected_hf_names(spec):
        if n in ("model.embed_tokens.weight", "lm_head.weight"):
            out[n] = (V, H)
        elif n == "model.norm.weight":
            out[n] = (H,)
        else:
            rest = n.split(".", 3)[3]
            out[n] = expert[rest.split(".", 3)[3]] if rest.startswith("mlp.experts.") else per[rest]
    return out


# ---- Megatron TP shards -> full HF tensors --------------------------------------------------------------

def to_hf(spec: HFModelSpec, rule: Rule, shards: Sequence[torch.Tensor], layer: int | None = None
          ) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors from the Megatron shards of all TP ranks (in rank order; one shard when replicated)."""
    names = hf_names(rule, layer)
    kind = rule.kind
    if kind == "replicated":
        return [(names[0], shards[0])]
    if kind == "column":
        return [(names[0], torch.cat(list(shards), 0) if len(shards) > 1 else shards[0])]
    if kind == "row":
        return [(names[0], torch.cat(list(shards), 1) if len(shards) > 1 else shards[0])]
    if kind == "fc1":
        halves = [s.chunk(2, 0) for s in shards]
        return [(names[0], torch.cat([h[0] for h in halves], 0)), (names[1], torch.cat([h[1] for h in halves], 0))]
    if kind in ("qkv", "qkv_bias"):
        full = torch.cat(list(shards), 0) if len(shards) > 1 else shards[0]
        ng, hd, qpg = spec.num_key_value_heads, spec.head_dim, spec.queries_per_group
        tail = full.shape[1:]
        g = full.reshape(ng, (qpg + 2) * hd, *tail)
        q, k, v = torch.split(g, [qpg * hd, hd, hd], dim=1)
        return [(names[0], q.reshape(-1, *tail)), (names[1], k.reshape(-1, *tail)), (names[2], v.reshape(-1, *tail))]
    raise ValueError(kind)
