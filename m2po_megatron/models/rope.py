"""RoPE from per-token positions: one elementwise op over a packed row, on every attention backend.

Megatron's GPTModel builds its rotary table for positions 0..n-1 and, on THD packed rows, applies it one
sequence at a time (`rope_utils._apply_rotary_pos_emb_thd`: a Python loop with `.tolist()`/`.item()` on
cu_seqlens, four device syncs per layer when cu_seqlens lives on the GPU, and a full-size gradient copy
per sequence in backward). Here the rotary frequencies come from the position ids the model is given
(restarting at 0 for every packed sequence): freqs[t] = position_ids[t] * inv_freq, shape [s, b, 1, dim],
computed once per forward and shared by the layers. Megatron then applies them in its bshd/sbhd path
(`_apply_rotary_pos_emb_bshd`: cos/sin and two multiplies, no loop), because packed rows reach the layers as
`models.attention.PackedRow`, which megatron reads as an ordinary [s, 1] sequence (qkv_format "sbhd").

The values equal megatron's own table at those positions bit for bit (the same fp32 product).
"""
from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel


def per_token_rotary(inv_freq: torch.Tensor, position_ids: torch.Tensor, *, interleaved: bool = False,
                     interpolation_factor: float | None = None) -> torch.Tensor:
    """Rotary frequencies [s, b, 1, dim] for position_ids [b, s], laid out as megatron's RotaryEmbedding
    (`get_emb`): the half-dim frequencies twice (or interleaved)."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}: expected [batch, seq]")
    if inv_freq.device != position_ids.device:  # megatron builds its table on the model's device already
        inv_freq = inv_freq.to(position_ids.device, non_blocking=True)
    pos = position_ids.t().to(inv_freq.dtype)  # [s, b]
    if interpolation_factor is not None:
        pos = pos * (1 / interpolation_factor)  # megatron's own expression (`seq *= 1 / factor`), bit for bit
    freqs = pos.unsqueeze(-1) * inv_freq  # [s, b, dim/2]: the outer product megatron takes, per token
    if interleaved:
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.unsqueeze(2)


class PositionRoPEGPTModel(GPTModel):
    """megatron-core's GPTModel with RoPE taken from `position_ids` (see the module docstring).

    Overrides GPTModel._preprocess (megatron-core 0.19.2): the rotary table it builds is replaced by the
    per-token one whenever position ids are given outside inference; everything else is megatron's."""

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        out = super()._preprocess(input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
                                  inference_context=inference_context, packed_seq_params=packed_seq_params,
                                  padding_mask=padding_mask)
        if out[1] is None or position_ids is None or inference_context is not None:
            return out
        if self.position_embedding_type != "rope":
            raise ValueError(f"position_embedding_type={self.position_embedding_type!r}: per-token RoPE "
                             "supports 'rope' only")
        if self.config.context_parallel_size != 1:
            raise ValueError("per-token RoPE does not split rows over context-parallel ranks; set "
                             "context_parallel_size=1")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            raise ValueError("packed rows reach the model as models.attention.PackedRow (built by "
                             "actor.packing.model_inputs), not as THD PackedSeqParams: megatron's THD RoPE "
                             "would apply these per-token frequencies per sequence again")
        emb = self.rotary_pos_emb
        freqs = per_token_rotary(emb.inv_freq, position_ids, interleaved=emb.rotary_interleaved,
                                 interpolation_factor=emb.seq_len_interpolation_factor)
        return (out[0], freqs, *out[2:])


__all__ = ["per_token_rotary", "PositionRoPEGPTModel"]
