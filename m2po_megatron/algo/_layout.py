"""Input checks and the one token layout used inside algo/: a 1-D list of the *valid* tokens.

Callers may pass either layout:
  - padded: tensors of shape [B, T] plus a [B, T] mask; row b is sequence b;
  - flat:   1-D tensors of shape [N] plus an [N] mask and `seq_ids` [N] (integers; tokens of one sequence
            share an id; ids need not be contiguous or sorted). `seq_ids_from_cu_seqlens` converts
            packed-sequence offsets to ids.
Both are reduced to the valid tokens in row-major order (the order used everywhere for tie-breaking).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """fp32, or fp64 when any input is fp64 (bf16/fp16 are upcast: ratios of half-precision log-probs are
    too coarse for a tau of 0.04)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def as_bool_mask(mask: Tensor, name: str = "mask") -> Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ValueError(f"{name} must be boolean or contain only 0/1; got other values")
        return mask != 0
    raise TypeError(f"{name} must be a bool or 0/1 tensor, got dtype {mask.dtype}")


def check_same_shape(ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and tuple(t.shape) != tuple(ref.shape):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
                f"pass per-token tensors of the same layout (padded [B, T] or flat [N])"
            )


def check_finite(where: str, mask: Tensor, **tensors: Tensor) -> None:
    """Raise naming the tensor if any *valid* position holds NaN or inf (one host sync per tensor)."""
    for name, t in tensors.items():
        bad = ~torch.isfinite(t) & mask
        n_bad = int(bad.sum())
        if n_bad:
            first = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{where}: {name} contains NaN or inf at {n_bad} valid token(s) (first at index {first}); "
                f"check the forward pass that produced {name} or mask those tokens out"
            )


def seq_ids_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """Packed-sequence offsets [0, l0, l0+l1, ...] -> per-token sequence ids [N] (0, 0, ..., 1, ...)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor [num_seqs + 1] starting at 0")
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lens < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens)


@dataclass
class ValidTokens:
    """Index of the valid tokens of one call, in row-major order, and their sequence membership."""

    index: Tensor  # [n] long: flat positions of valid tokens in the caller's tensors
    seq: Tensor  # [n] long: 0..num_seqs-1, sequences that have at least one valid token
    num_seqs: int
    shape: tuple[int, ...]

    def take(self, t: Tensor) -> Tensor:
        """Valid entries of a tensor in the caller's layout (differentiable)."""
        return t.reshape(-1)[self.index]


def valid_tokens(mask: Tensor, seq_ids: Tensor | None, where: str) -> ValidTokens:
    """Resolve the layout (padded [B, T] or flat [N] + seq_ids) to the list of valid tokens."""
    if mask.dim() == 2:
        if seq_ids is not None:
            raise ValueError(f"{where}: seq_ids is only for flat 1-D inputs; padded [B, T] rows are sequences")
        index = mask.reshape(-1).nonzero().squeeze(-1)
        row = torch.div(index, mask.shape[1], rounding_mode="floor")
    elif mask.dim() == 1:
        index = mask.nonzero().squeeze(-1)
        if seq_ids is None:
            row = None
        else:
            if tuple(seq_ids.shape) != tuple(mask.shape):
                raise ValueError(f"{where}: seq_ids has shape {tuple(seq_ids.shape)}, mask {tuple(mask.shape)}")
            if seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool:
                raise TypeError(f"{where}: seq_ids must be an integer tensor, got {seq_ids.dtype}")
            row = seq_ids[index]
    else:
        raise ValueError(f"{where}: expected padded [B, T] or flat [N] tensors, got mask of shape {tuple(mask.shape)}")
    if row is None:
        seq = torch.full_like(index, -1)
        num_seqs = -1  # unknown: sequence-level ops will ask for seq_ids
    else:
        uniq, seq = torch.unique(row, sorted=True, return_inverse=True)
        num_seqs = int(uniq.numel())
    return ValidTokens(index=index, seq=seq, num_seqs=num_seqs, shape=tuple(mask.shape))
