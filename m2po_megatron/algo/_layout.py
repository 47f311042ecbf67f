"""Input checks and the one token layout used inside algo/: a 1-D list of the *valid* tokens.

Callers may pass either layout:
  - padded: tensors of shape [B, T] plus a [B, T] mask; row b is sequence b;
  - flat:   1-D tensors of shape [N] plus an [N] mask and `seq_ids` [N] (integers; tokens of one sequence
            share an id; ids need not be contiguous or sorted). `seq_ids_from_cu_seqlens` converts
            packed-sequence offsets to ids.
Both are reduced to one flat valid mask in row-major order (the order used everywhere for tie-breaking) with
dense sequence ids; invalid positions stay in place and are masked with `where`, so the per-call math has
no data-dependent shapes and no host syncs (a flat caller that knows its sequences passes dense ids and
num_seq_ids; otherwise torch.unique makes them dense, one sync).
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


def nonfinite_counts(mask: Tensor, *tensors: Tensor) -> Tensor:
    """[len(tensors)] int64 on the device: valid positions holding NaN or inf, per tensor. No host sync; read
    it together with other device values (raise_nonfinite) or through check_finite."""
    return torch.stack([(~torch.isfinite(t) & mask).sum() for t in tensors])


def raise_nonfinite(where: str, names, counts) -> None:
    """Raise naming the first tensor whose host count (from nonfinite_counts) is non-zero, and the fix."""
    for name, n_bad in zip(names, counts):
        if n_bad:
            raise ValueError(
                f"{where}: {name} contains NaN or inf at {int(n_bad)} valid token(s); "
                f"check the forward pass that produced {name} or mask those tokens out"
            )


def check_finite(where: str, mask: Tensor, **tensors: Tensor) -> None:
    """Raise naming the tensor if any *valid* position holds NaN or inf (one host sync for all tensors)."""
    if tensors:
        raise_nonfinite(where, list(tensors), nonfinite_counts(mask, *tensors.values()).tolist())


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
    """The valid tokens of one call as a flat mask over the caller's positions (row-major order), and their
    sequence membership as dense ids. Reductions multiply or `where` by `valid` instead of gathering the valid
    positions, so no shape depends on the data and nothing here reads the device."""

    valid: Tensor  # [N] bool: valid positions of the caller's tensors, flattened
    seq: Tensor | None  # [N] long in 0..num_ids-1 (any id on invalid positions); None: sequences unknown
    num_ids: int  # size of the id space (-1 when sequences are unknown)
    shape: tuple[int, ...]

    def take(self, t: Tensor) -> Tensor:
        """A tensor in the caller's layout, flattened like `valid` (differentiable; invalid entries stay)."""
        return t.reshape(-1)

    @property
    def known_seqs(self) -> bool:
        return self.seq is not None

    def seq_sum(self, x: Tensor) -> Tensor:
        """[num_ids] per-sequence sums of x [N] (x must be zero on invalid positions)."""
        return torch.zeros(self.num_ids, dtype=x.dtype, device=x.device).index_add(0, self.seq, x)

    def seq_counts(self) -> Tensor:
        """[num_ids] valid tokens per sequence id (float64)."""
        return self.seq_sum(self.valid.to(torch.float64))

    def num_seqs(self) -> Tensor:
        """Sequences with at least one valid token (0-d long on the device)."""
        return (self.seq_counts() > 0).sum()


def valid_tokens(mask: Tensor, seq_ids: Tensor | None, where: str, num_seq_ids: int | None = None) -> ValidTokens:
    """Resolve the layout (padded [B, T] or flat [N] + seq_ids) to the flat valid mask and dense sequence ids.

    num_seq_ids: flat inputs whose seq_ids are already dense, 0..num_seq_ids-1 (e.g. built on the host from
    known sequence lengths). Without it, arbitrary ids are made dense with torch.unique, which reads the
    device (one host sync)."""
    if mask.dim() == 2:
        if seq_ids is not None:
            raise ValueError(f"{where}: seq_ids is only for flat 1-D inputs; padded [B, T] rows are sequences")
        b, t = mask.shape
        seq = torch.arange(b, device=mask.device).unsqueeze(1).expand(b, t).reshape(-1)
        return ValidTokens(valid=mask.reshape(-1), seq=seq, num_ids=b, shape=tuple(mask.shape))
    if mask.dim() != 1:
        raise ValueError(f"{where}: expected padded [B, T] or flat [N] tensors, got mask of shape {tuple(mask.shape)}")
    if seq_ids is None:
        return ValidTokens(valid=mask, seq=None, num_ids=-1, shape=tuple(mask.shape))
    if tuple(seq_ids.shape) != tuple(mask.shape):
        raise ValueError(f"{where}: seq_ids has shape {tuple(seq_ids.shape)}, mask {tuple(mask.shape)}")
    if seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool:
        raise TypeError(f"{where}: seq_ids must be an integer tensor, got {seq_ids.dtype}")
    if num_seq_ids is not None:
        if num_seq_ids < 0:
            raise ValueError(f"{where}: num_seq_ids={num_seq_ids} must be >= 0 (the number of dense sequence ids)")
        return ValidTokens(valid=mask, seq=seq_ids.long(), num_ids=int(num_seq_ids), shape=tuple(mask.shape))
    uniq, seq = torch.unique(seq_ids, sorted=True, return_inverse=True)
    return ValidTokens(valid=mask, seq=seq, num_ids=int(uniq.numel()), shape=tuple(mask.shape))
