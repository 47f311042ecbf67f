"""Core attention of the "sdpa" backend: one FlexAttention call per packed row, for megatron's local layers.

A packed row (several sequences one after another, trailing padding its own sequence) reaches the layers as
a `PackedRow` (built once per micro-batch by actor.packing.model_inputs). Megatron reads it as an ordinary
[s, b=1] sequence (qkv_format "sbhd"), so q/k/v keep their [s, 1, heads, dim] layout and RoPE runs as one
elementwise op from per-token positions (models.rope). PackedSDPAttention then runs one of two kernels:

- "flex": `torch.nn.attention.flex_attention` over the whole row with a document-causal block mask (token i
  sees token j iff both are in the same sequence and j <= i), grouped-query attention without repeating
  k/v (enable_gqa). The block mask is built on the device from the row's document ids, without host syncs,
  on the first layer that needs it, and cached on the PackedRow: one build per micro-batch, shared by all
  layers (and by recompute). On CUDA the kernel is `torch.compile(flex_attention, dynamic=True)`, compiled
  once per process: row lengths vary from micro-batch to micro-batch, and a dynamic-shape graph serves
  them all (padding rows to 128-token buckets would still leave ~230 shapes at 30,000-token rows, and
  costs a copy of q/k/v per layer). Dynamo adds at most a no-grad graph (log-prob passes) and one for rows
  of a single tile (it specialises sizes of 1). It keeps q, k, v, its output (laid out like q, so linear_proj reads
  it as a view) and a log-sum-exp per query for backward; no S x S tensor.
- "loop": the fallback, one fused `F.scaled_dot_product_attention(is_causal=True)` per sequence, used where
  flex cannot run: a CPU (torch 2.14's flex has no CPU backward, and its CPU reference path materialises
  the S x S scores: about 60x slower than this loop on the CPU benchmark's rows), a CUDA machine without
  Triton, a torch without flex_attention, or attention dropout > 0 (flex has no dropout). Sequence bounds
  come from the PackedRow's host copy (read once per micro-batch, never per layer); the row is cut with
  one `split`, so backward assembles one row-sized gradient, not one per sequence.

The kernel is chosen per call (`PackedSDPAttention.kernel`: None = the rule above; "flex" / "loop" force
one, as the tests do to run the flex function on CPU through torch's reference implementation of the same
operator). Without packed_seq_params the input is an ordinary [s, b, heads, dim] batch: causal, or masked
by `attention_mask` (True = masked) when one is given.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from m2po_megatron.infra.device import has_cuda

BLOCK = 128  # flex's sparse block size (its default): one entry of the block mask per 128 x 128 tile
KERNELS = ("flex", "loop")


@dataclass(eq=False)
class PackedRow(PackedSeqParams):
    """One packed row as megatron's packed_seq_params: megatron sees qkv_format "sbhd" (one [s, 1]
    sequence: elementwise RoPE, no THD loop); the attention modules read the sequence structure from here.

    bounds: host sequence boundaries [0, ..., s] (trailing padding its own sequence); document_ids: [s]
    int32 on the model's device (the sequence of each token); thd: the THD PackedSeqParams for Transformer
    Engine's kernels (te backend only, cu_seqlens on the device)."""

    qkv_format: str = "sbhd"
    bounds: tuple = ()
    document_ids: Optional[torch.Tensor] = None
    thd: Optional[PackedSeqParams] = None
    _block_mask: object = field(default=None, repr=False)

    def block_mask(self):
        """The document-causal BlockMask of this row, built on first use and shared by every layer."""
        if self._block_mask is None:
            self._block_mask = document_causal_block_mask(self.document_ids)
        return self._block_mask


def packed_row(bounds: Sequence[int], device, thd: Optional[PackedSeqParams] = None) -> PackedRow:
    """A PackedRow from host sequence boundaries (bounds[0] == 0, bounds[-1] == row length). Reads no
    tensor back to the host; one host-to-device copy (the document ids)."""
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) < 2 or bounds[0] != 0 or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds={bounds[:4]}...: need 0 = b0 <= b1 <= ... <= row length")
    lens = [c - b for b, c in zip(bounds, bounds[1:])]
    doc = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens),
                                  output_size=bounds[-1])
    if has_cuda() and torch.device(device).type == "cuda":
        doc = doc.pin_memory()  # a pageable source would make the non-blocking copy synchronous
    return PackedRow(max_seqlen_q=max(lens), max_seqlen_kv=max(lens), bounds=bounds,
                     document_ids=doc.to(device, non_blocking=True), thd=thd)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block table [..., nq, nk] bool -> (count per row, column indices with the True ones first)."""
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx


def document_causal_block_mask(document_ids: torch.Tensor, block: int = BLOCK):
    """flex_attention BlockMask for one row whose tokens carry `document_ids` (non-decreasing; each
    document a contiguous run): token i sees token j iff same document and j <= i.

    Built from per-tile document ranges on the document ids' device, in O((s/block)^2) with fixed shapes
    (no host sync), instead of create_block_mask's evaluation of the mask on all s x s pairs."""
    from torch.nn.attention.flex_attention import BlockMask

    doc = document_ids
    s = doc.numel()
    n = -(-s // block)
    starts = torch.arange(n, device=doc.device) * block
    lo = doc[starts]  # first (smallest) document of each tile
    hi = doc[torch.clamp(starts + block, max=s) - 1]  # last (largest)
    qi = torch.arange(n, device=doc.device).view(n, 1)
    kj = qi.view(1, n)
    # a tile pair has some visible entry iff it is on or below the diagonal and the document ranges meet;
    # every entry is visible iff it is strictly below the diagonal and both tiles hold the same one document
    # (a last, partial query tile stays partial, as create_block_mask counts its missing rows as masked)
    some = (kj <= qi) & (lo.view(1, n) <= hi.view(n, 1)) & (lo.view(n, 1) <= hi.view(1, n))
    full = (kj < qi) & (lo.view(1, n) == hi.view(n, 1)) & (starts + block <= s).view(n, 1)
    num, idx = _ordered((some & ~full)[None, None])
    full_num, full_idx = _ordered(full[None, None])
    return BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=_document_causal(doc), seq_lengths=(s, s))


def _document_causal(doc: torch.Tensor):
    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (kv <= q)
    return mask_mod


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """flex_attention compiled once per process, with dynamic shapes (see the module docstring). Past dynamo's
    recompile limit a compiled function falls back to eager, and eager flex materialises the S x S scores
    (17-34 GB per layer at 16k-token rows): the process fails at the limit instead, with the guard that
    failed (the shapes) in the error (torch._dynamo.config.fail_on_recompile_limit_hit)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    if not torch._dynamo.config.suppress_errors:  # the two flags exclude each other
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=True)


def compiled_flex_call(q, k, v, block_mask, scale: float):
    """The compiled kernel (CUDA's path in flex_row_attention; any device with a compiler in tests). Past the
    recompile limit: a RuntimeError with the shapes that asked for one more graph."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    try:
        return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.size(1) != k.size(1))
    except FailOnRecompileLimitHit as e:
        raise RuntimeError(
            f"flex attention needed another compile past torch._dynamo.config.recompile_limit "
            f"({torch._dynamo.config.recompile_limit}) at q {tuple(q.shape)}, k/v {tuple(k.shape)}, "
            f"{q.dtype}: failing instead of running eager flex (it materialises the scores); "
            f"rows of one {BLOCK}-token tile or a new dtype each compile once more") from e


def _identity(score, b, h, q, kv):
    return score


def flex_row_attention(q, k, v, block_mask, scale: float):
    """FlexAttention over [1, heads, s, dim] q and [1, groups, s, dim] k/v with `block_mask`; returns
    [1, heads, s, dim] (laid out like q). CUDA: the compiled kernel. Elsewhere: torch's reference
    implementation of the same operator (the flex_attention higher-order op, run eagerly), which has a
    backward on CPU where the public function refuses one; tests use it to check the math."""
    if q.is_cuda:
        return compiled_flex_call(q, k, v, block_mask, scale)
    from torch._higher_order_ops.flex_attention import flex_attention as flex_op
    from torch.nn.attention.flex_attention import _apply_kernel_options

    options = _apply_kernel_options(q, k, v, False, None, None)
    options["OUTPUT_LOGSUMEXP"] = torch.is_grad_enabled()
    out, _, _ = flex_op(q, k, v, _identity, block_mask.as_tuple(), scale, options)
    return out


@functools.lru_cache(maxsize=None)
def _flex_compiles_on_cuda() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


class PackedSDPAttention(MegatronModule):
    """Megatron core-attention module (same constructor and forward signature as DotProductAttention)."""

    kernel: Optional[str] = None  # None: flex where it can run, else loop (module docstring); or force one

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

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _kernel(self, query) -> str:
        if self.kernel is not None:
            if self.kernel not in KERNELS:
                raise ValueError(f"PackedSDPAttention.kernel={self.kernel!r}: use one of {KERNELS} or None")
            if self.kernel == "flex" and self._dropout_p() > 0:
                raise ValueError("the flex kernel has no attention dropout: set attention_dropout=0 or use 'loop'")
            return self.kernel
        usable = query.is_cuda and self._dropout_p() == 0 and _flex_compiles_on_cuda()
        return "flex" if usable else "loop"

    def _sdpa(self, q, k, v, mask=None):
        p = self._dropout_p()
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
        s, b = query.shape[:2]
        if packed_seq_params is None:  # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = self._sdpa(q, k, v, None if attention_mask is None else ~attention_mask)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if not isinstance(packed_seq_params, PackedRow):
            raise ValueError("attention_backend='sdpa' takes packed rows as models.attention.PackedRow "
                             "(actor.packing.model_inputs builds it), not THD PackedSeqParams")
        row = packed_seq_params
        if b != 1 or row.bounds[-1] != s:
            raise ValueError(f"a packed row of {row.bounds[-1]} tokens does not match q/k/v of shape "
                             f"{tuple(query.shape)} (expected [{row.bounds[-1]}, 1, heads, dim])")
        # [s, 1, n, d] -> [1, n, s, d]: views, the kernels read them in place
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self._kernel(query) == "flex":
            out = flex_row_attention(q, k, v, row.block_mask(), self.scale)
        else:
            lens = [e - a for a, e in zip(row.bounds[:-1], row.bounds[1:]) if e > a]
            parts = zip(*(t.split(lens, dim=2) for t in (q, k, v)))
            out = torch.cat([self._sdpa(*p) for p in parts], dim=2)
        return out.permute(2, 0, 1, 3).reshape(s, 1, -1)  # a view when out is laid out like q (flex)


@functools.lru_cache(maxsize=None)
def te_packed_core_attention():
    """TEDotProductAttention that takes a PackedRow: megatron hands it [s, 1, heads, dim] q/k/v (RoPE already
    applied per token); Transformer Engine gets them as THD with the row's own PackedSeqParams, as before.
    A factory because the class needs Transformer Engine importable (GPU machines only)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class PackedTEDotProductAttention(TEDotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            if not isinstance(packed_seq_params, PackedRow):
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params, **kwargs)
            if packed_seq_params.thd is None:
                raise ValueError("a PackedRow for the te backend needs its THD PackedSeqParams (thd=...)")
            q, k, v = (t.squeeze(1) for t in (query, key, value))
            out = super().forward(q, k, v, attention_mask, attn_mask_type, attention_bias,
                                  packed_seq_params.thd, **kwargs)
            return out.reshape(out.size(0), 1, -1)

    return PackedTEDotProductAttention


__all__ = ["PackedRow", "packed_row", "document_causal_block_mask", "flex_row_attention", "PackedSDPAttention",
           "te_packed_core_attention", "KERNELS", "BLOCK"]
