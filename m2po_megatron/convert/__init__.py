"""Checkpoint conversion (HF safetensors <-> Megatron dist checkpoints) and weight export for rollout sync.

All of it uses the one weight table in m2po_megatron.models.weights. Heavy imports are inside functions."""
from m2po_megatron.convert.export import gather_hf_state_dict, hf_buckets, iter_hf_tensors, iter_hf_weight_buckets

__all__ = ["gather_hf_state_dict", "hf_buckets", "iter_hf_tensors", "iter_hf_weight_buckets"]
