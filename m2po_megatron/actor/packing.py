"""Pure packing logic: mini-batch split, data-parallel sharding, and micro-batches by a token budget.

Sequences are packed several to a row (one row = one micro-batch). Each sequence keeps its own position
ids and sees only itself: through cu_seqlens (THD format, the "te" and "sdpa" attention backends) or a dense
block-diagonal causal mask (the "local" backend), so the only padding is rounding a row up to the multiple
that sequence parallelism and FP8 need (`row_multiple`), at the row's end. `model_inputs` is the one place
that puts a row on the model's device, and `to_device` the one way host tensors get there (non-blocking,
from pinned memory on CUDA). Nothing here touches torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from m2po_megatron.infra.device import has_cuda

from .batch import TrainBatch

# FP8 GEMMs in Transformer Engine: see row_multiple.
FP8_TOKEN_MULTIPLE = 16
MXFP8_TOKEN_MULTIPLE = 32


def row_multiple(tensor_model_parallel_size: int = 1, sequence_parallel: bool = False, fp8: bool = False,
                 fp8_recipe: str | None = None) -> int:
    """The multiple every packed row length must be (the rounding build_microbatch pads to).

    Sequence parallelism splits the row's tokens evenly over the TP ranks: a multiple of TP.

    FP8 (Transformer Engine): every FP8 GEMM input is checked by TE's `assert_dim_for_fp8_exec`
    (transformer_engine/pytorch/utils.py, called from Linear / LayerNormLinear / LayerNormMLP forward on the
    rank's local input before any sequence-parallel all-gather): the product of all dims but the last must be
    divisible by 8 and the last by 16. The leading product is the rank's token count (the row with SP off,
    the row / TP with SP on); the weight-gradient GEMM takes the transposed input, where the tokens are the
    last dim, so tokens are padded to 16, as megatron-core pads FP8 sequences
    (models/multimodal/context_parallel.get_padding: 16, and 32 for MXFP8, whose quantizer
    MXFP8Quantizer.is_quantizable wants both dims divisible by its 32-element scaling block). Hidden sizes
    already divide by 16 in every supported model. Rows only: THD fused attention without context
    parallelism needs no per-sequence padding (TE asks for per-sequence multiples of 2 * CP, and then
    cu_seqlens_q_padded, only under context parallelism, which the actor refuses), and the trailing padding
    is its own segment of cu_seqlens, so no sequence attends to it.
    """
    tp = max(1, int(tensor_model_parallel_size))
    per_rank = 1
    if fp8:
        per_rank = MXFP8_TOKEN_MULTIPLE if fp8_recipe == "mxfp8" else FP8_TOKEN_MULTIPLE
    return (tp if sequence_parallel else 1) * per_rank


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device` without blocking the host: a host tensor goes through pinned memory where CUDA is
    present (a pageable source makes the copy synchronous), then a non-blocking copy; a no-op when `t` is
    already there (every CPU run). A copy to the host blocks (a non-blocking one could be read too early)."""
    dev = torch.device(device)
    if t.device == dev:
        return t
    if dev.type == "cpu":
        return t.to(dev)  # to the host: blocking, so the values are there when the caller reads them
    if has_cuda() and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


def split_minibatches(n: int, num_minibatches: int) -> list[list[int]]:
    """Contiguous, order-preserving split of n sequences into num_minibatches (sizes differ by <= 1); with
    fewer sequences than mini-batches the last ones are empty (the actor skips those updates)."""
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches={num_minibatches} must be >= 1")
    base, extra = divmod(n, num_minibatches)
    out, start = [], 0
    for k in range(num_minibatches):
        size = base + (1 if k < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def shard_for_dp(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Deterministic token-balanced assignment of sequences to data-parallel ranks.

    Longest first, each to the least-loaded rank (ties: lower rank). Returns, per rank, indices in
    ascending order; with fewer sequences than ranks the last ranks get none (dp_share.rank_share gives
    them a filler). Every rank computes the same answer from the same lengths."""
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    loads = [0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp_size), key=lambda r: (loads[r], len(shards[r]), r))
        shards[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shards]


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing bin packing of sequence lengths into rows of at most max_tokens tokens.

    Returns bins of indices into `lengths` (each bin sorted ascending; bins ordered by first index)."""
    if max_tokens < 1:
        raise ValueError(f"micro_batch_tokens={max_tokens} must be >= 1")
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > max_tokens:
            raise ValueError(
                f"a sequence of {n} tokens exceeds micro_batch_tokens={max_tokens}: raise micro_batch_tokens "
                "to at least the longest prompt+response")
        for b, f in enumerate(free):
            if n <= f:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(max_tokens - n)
    bins = [sorted(b) for b in bins]
    bins.sort(key=lambda b: b[0])
    return bins


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass
class MicroBatch:
    """One packed row. `seq_index` are indices into the batch it was built from."""

    tokens: torch.Tensor  # [1, S] long
    position_ids: torch.Tensor  # [1, S] long, restarting at 0 for every sequence
    labels: torch.Tensor  # [1, S] long: next token of the same sequence (0 where none)
    seq_index: list[int]
    offsets: list[int]  # start of each sequence in the row
    lengths: list[int]
    prompt_lens: list[int]
    logprob_positions: torch.Tensor  # [R] row positions whose logits predict the response tokens
    num_padding: int

    @property
    def response_lens(self) -> list[int]:
        return [n - p for n, p in zip(self.lengths, self.prompt_lens)]

    def response_seq_ids(self) -> torch.Tensor:
        """[R] long host tensor: 0..k-1, the row's sequence of each response token (dense ids, as the loss
        takes them with num_seq_ids=k)."""
        rl = self.response_lens
        return torch.repeat_interleave(torch.arange(len(rl)), torch.tensor(rl), output_size=sum(rl))

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def padded_to(self, s: int) -> "MicroBatch":
        """The same micro-batch with its row padded to length s (pipeline stages need equal shapes)."""
        extra = s - self.seq_len
        if extra <= 0:
            return self
        pad = lambda t, fill: torch.cat([t, torch.full((1, extra), fill, dtype=t.dtype)], 1)  # noqa: E731
        pos = torch.cat([self.position_ids, torch.arange(extra).view(1, -1)], 1)
        return MicroBatch(pad(self.tokens, 0), pos, pad(self.labels, 0), self.seq_index, self.offsets,
                          self.lengths, self.prompt_lens, self.logprob_positions, self.num_padding + extra)

    def attention_mask(self) -> torch.Tensor:
        """[1, 1, S, S] bool, True = masked: causal inside each sequence, nothing across sequences."""
        s = self.seq_len
        seg = torch.full((s,), -1, dtype=torch.long)
        for k, (o, n) in enumerate(zip(self.offsets, self.lengths)):
            seg[o:o + n] = k
        same = seg.unsqueeze(0) == seg.unsqueeze(1)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        keep = same & causal
        keep |= torch.eye(s, dtype=torch.bool)  # padding rows attend to themselves (no NaN rows)
        return (~keep).view(1, 1, s, s)

    def cu_bounds(self) -> list[int]:
        """Cumulative sequence boundaries (host ints); trailing padding is its own segment."""
        bounds = [0]
        for n in self.lengths:
            bounds.append(bounds[-1] + n)
        if bounds[-1] < self.seq_len:
            bounds.append(self.seq_len)
        return bounds

    def cu_seqlens(self) -> torch.Tensor:
        """Cumulative sequence boundaries for THD attention (int32 host tensor); see cu_bounds."""
        return torch.tensor(self.cu_bounds(), dtype=torch.int32)


def build_microbatch(batch: TrainBatch, indices: Sequence[int], pad_multiple: int = 1) -> MicroBatch:
    ids = [batch.input_ids[i].long() for i in indices]
    lens = [int(t.numel()) for t in ids]
    plens = [int(batch.prompt_lens[i]) for i in indices]
    used = sum(lens)
    s = _round_up(used, max(1, pad_multiple))
    tokens = torch.zeros(1, s, dtype=torch.long)
    pos = torch.zeros(1, s, dtype=torch.long)
    labels = torch.zeros(1, s, dtype=torch.long)
    offsets, lp_pos = [], []
    o = 0
    for t, n, p in zip(ids, lens, plens):
        offsets.append(o)
        tokens[0, o:o + n] = t
        pos[0, o:o + n] = torch.arange(n)
        labels[0, o:o + n - 1] = t[1:]
        # logits at position j predict token j+1: response tokens p..n-1 come from positions p-1..n-2
        lp_pos.append(torch.arange(o + p - 1, o + n - 1))
        o += n
    if s > used:
        pos[0, used:] = torch.arange(s - used)
    return MicroBatch(tokens, pos, labels, list(indices), offsets, lens, plens, torch.cat(lp_pos), s - used)


def model_inputs(mb: MicroBatch, device, attention_backend: str) -> dict:
    """GPTModel.forward's keyword arguments for one packed row, on `device` (the model's device).

    "te" / "sdpa": the row as a `models.attention.PackedRow` (no mask): host sequence bounds, per-token
    document ids on the device, and for "te" TE's THD PackedSeqParams with cu_seqlens on the device; built
    here once per micro-batch, so no layer reads cu_seqlens on the host. "local": the dense [1, 1, S, S]
    mask (True = masked). Every backend takes RoPE from position_ids (models.rope)."""
    dev = torch.device(device)
    out = {"input_ids": to_device(mb.tokens, dev), "position_ids": to_device(mb.position_ids, dev)}
    if attention_backend == "local":
        out.update(attention_mask=to_device(mb.attention_mask(), dev), packed_seq_params=None)
        return out
    if attention_backend not in ("te", "sdpa"):
        raise ValueError(f"attention_backend={attention_backend!r}: use 'te', 'sdpa' or 'local'")
    # --- packed row for te / sdpa (issue 20: one attention kernel per row; models.attention) ---
    from megatron.core.packed_seq_params import PackedSeqParams

    from m2po_megatron.models.attention import packed_row

    bounds = mb.cu_bounds()  # host ints; trailing padding is a sequence of its own
    thd = None
    if attention_backend == "te":
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        cu = to_device(torch.tensor(bounds, dtype=torch.int32), dev)
        thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                              max_seqlen_kv=longest)
    out.update(attention_mask=None, packed_seq_params=packed_row(bounds, dev, thd=thd))
    # --- end packed row ---
    return out


def plan_microbatches(
    batch: TrainBatch, indices: Sequence[int], max_tokens: int, pad_multiple: int = 1
) -> list[MicroBatch]:
    """Pack the sequences `indices` of `batch` into micro-batches of at most max_tokens tokens
    (a row may exceed max_tokens only by the rounding to pad_multiple, see row_multiple)."""
    lens = [int(batch.input_ids[i].numel()) for i in indices]
    bins = pack_by_token_budget(lens, max_tokens)
    return [build_microbatch(batch, [indices[j] for j in b], pad_multiple) for b in bins]


def padding_waste(mbs: Sequence[MicroBatch]) -> float:
    """Fraction of row positions that hold no real token."""
    total = sum(m.seq_len for m in mbs)
    return 0.0 if total == 0 else sum(m.num_padding for m in mbs) / total


def padded_batching_waste(lengths: Sequence[int], max_tokens: int) -> float:
    """Waste of the usual alternative, for comparison: sort by length, fill [b, max_len] padded
    micro-batches up to the token budget (b * max_len <= max_tokens)."""
    order = sorted(lengths, reverse=True)
    total = used = 0
    i = 0
    while i < len(order):
        width = order[i]
        b = max(1, max_tokens // width)
        chunk = order[i:i + b]
        total += width * len(chunk)
        used += sum(chunk)
        i += b
    return 0.0 if total == 0 else 1.0 - used / total
