"""Core attention through PyTorch's fused scaled_dot_product_attention, for the "sdpa" backend.

It replaces megatron-core's DotProductAttention in the local layer spec (models.builder.layer_spec). A
packed row (several sequences, THD format: `PackedSeqParams(qkv_format="thd", cu_seqlens_q=...)`) runs one
causal SDPA call per sequence, so no sequence attends to another and no S x S score tensor exists: the
fused kernel (flash attention on CUDA and on CPU) keeps only q, k, v, the output and a log-sum-exp per
query for backward. Grouped-query attention goes to the kernel as is (enable_gqa), without repeating k/v.

cu_seqlens may stay on the host: only Python-side splits read it (here and in megatron's THD RoPE), so a
host tensor costs no device synchronisation per layer. Without packed_seq_params the input is an ordinary
[s, b, heads, dim] batch: causal, or masked by `attention_mask` (True = masked) when one is given.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


class PackedSDPAttention(MegatronModule):
    """Megatron core-attention module (same constructor and forward signature as DotProductAttention)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("attention_backend='sdpa' does not split sequences over context-parallel ranks; "
                             "set context_parallel_size=1")
        if getattr(config, "window_size", None) is not None or getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("attention_backend='sdpa' supports full causal attention with the vanilla softmax only")
        tp_group = pg_collection.tp if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_group()
        self.tp_group = tp_group
        tp = tp_group.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        if config.apply_query_key_layer_scaling:
            self.scale /= self.layer_number
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q, k, v, mask=None):
        p = self.dropout if self.training else 0.0
        kw = dict(dropout_p=p, scale=self.scale, enable_gqa=self.num_heads != self.num_groups)
        if mask is None:
            kw["is_causal"] = True
        else:
            kw["attn_mask"] = mask
        if p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, **kw)
        return F.scaled_dot_product_attention(q, k, v, **kw)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("attention_backend='sdpa' takes no attention bias")
        if packed_seq_params is None:  # [s, b, n, d] -> [b, n, s, d]
            s, b = query.shape[:2]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = self._sdpa(q, k, v, None if attention_mask is None else ~attention_mask)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: use 'thd'")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if bounds[0] != 0 or bounds[-1] != query.size(0):
            raise ValueError(f"cu_seqlens {bounds[:3]}...{bounds[-1]} do not cover the {query.size(0)} packed tokens")
        outs = []
        for s0, s1 in zip(bounds[:-1], bounds[1:]):
            if s1 == s0:
                continue
            # [L, n, d] -> [1, n, L, d]: a view; the kernel reads it in place
            q, k, v = (t[s0:s1].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            outs.append(self._sdpa(q, k, v)[0].transpose(0, 1))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(out.size(0), -1)
