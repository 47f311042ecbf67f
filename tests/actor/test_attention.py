"""The sdpa attention backend: FlexAttention over the packed row (document-causal block mask) and the
per-sequence SDPA fallback, with RoPE from per-token positions, against HF transformers, megatron's dense
local path, each other and a float64 reference, in forward and gradients (CPU, fp32). On CPU the flex kernel
runs torch's reference implementation of the flex_attention operator (the compiled one is CUDA's; gpu test
below). Tolerances, fp32 rounding through the model: 3e-6 relative to the largest logit (the largest measured
difference is 1.5e-6 of it, the loop's against HF on Llama-3.2), 1e-5 relative on gradients; 1e-5 absolute on
one attention module against float64."""
import shutil

import pytest
import torch

import attention_workers as aw
import actor_workers as w
from m2po_megatron.actor.launch import run_multiprocess


def _dense_tables(num, idx, n):
    """Block-sparse tables [1, 1, n] / [1, 1, n, n] -> dense [n, n] bool."""
    dense = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        dense[i, idx[0, 0, i, :num[0, 0, i]].long()] = True
    return dense


@pytest.mark.parametrize("lens, block", [
    ([9, 140, 1, 33, 6, 5], 128),  # ragged, trailing padding, a partial last tile
    ([128, 128], 128),  # documents on tile bounds
    ([300], 128),  # one document: causal only
    ([3] * 40 + [17], 16),  # many documents per tile
    ([50, 0, 70, 1, 1, 90], 32),  # a zero-length document
])
def test_block_mask_equals_torch_create_block_mask(lens, block):
    """The block tables built from per-tile document ranges equal the ones torch's create_block_mask derives
    by evaluating the mask on every pair: which tiles are partial and which are full."""
    from torch.nn.attention.flex_attention import create_block_mask

    from m2po_megatron.models.attention import document_causal_block_mask

    doc = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))
    s = doc.numel()
    ours = document_causal_block_mask(doc, block)
    theirs = create_block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q), None, None, s, s,
                               device="cpu", BLOCK_SIZE=block)
    n = -(-s // block)
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        a = _dense_tables(getattr(ours, num), getattr(ours, idx), n)
        b = _dense_tables(getattr(theirs, num), getattr(theirs, idx), n)
        assert torch.equal(a, b), (num, a.int(), b.int())
    assert ours.seq_lengths == (s, s)
    # the token-level mask it carries
    qi, ki = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    want = (doc.view(-1, 1) == doc.view(1, -1)) & (ki <= qi)
    assert torch.equal(ours.mask_mod(0, 0, qi, ki), want)


def test_per_token_rotary_equals_megatrons_table_at_those_positions():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from m2po_megatron.models.rope import per_token_rotary

    emb = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 700]])
    table = emb.get_freqs_non_repeated(701)
    got = per_token_rotary(emb.inv_freq, pos)
    assert got.shape == (10, 1, 1, 32)
    want = torch.cat([table[pos[0]], table[pos[0]]], -1)
    assert torch.equal(got[:, 0, 0], want)  # the same fp32 products, bit for bit
    inter = per_token_rotary(emb.inv_freq, pos, interleaved=True)
    assert torch.equal(inter[:, 0, 0, 0::2], table[pos[0]]) and torch.equal(inter[:, 0, 0, 1::2], table[pos[0]])


@pytest.mark.timeout(600)
def test_sdpa_kernels_match_hf_each_other_and_the_dense_path():
    names = ["qwen2_untied", *w.BUNDLED]  # Qwen2 untied/tied, Qwen3 (GQA 4/2, q/k norms), Llama 3.2 (RoPE scaling)
    out = run_multiprocess(aw.model_parity_worker, 1, args=(names,), timeout=580)[0]
    for name, r in out.items():
        assert r["grad_scale"] > 1e-2 and r["num_checked"] >= 4, (name, r)
        tol_logits = 3e-6 * max(1.0, r["logit_scale"])  # logits up to ~6: about 2e-5
        tol_grad = 1e-5 * max(1.0, r["grad_scale"])
        for pair in ("flex_vs_hf", "loop_vs_hf", "flex_vs_loop", "flex_vs_local"):
            assert r[pair]["logits"] <= tol_logits, (name, pair, r)
            assert r[pair]["grads"] <= tol_grad, (name, pair, r)
        # RoPE follows the position ids given to forward
        assert r["shift_matters"] > 1e-2 and r["shifted_positions"] <= 1e-5, (name, r)


@pytest.mark.timeout(200)
def test_packed_attention_kernels_match_a_float64_reference():
    r = run_multiprocess(aw.module_worker, 1, timeout=180)[0]
    for kernel in ("flex", "loop"):
        assert r[kernel]["shape"] == (340, 1, 64), r
        assert r[kernel]["out"] <= 1e-5 and r[kernel]["grad"] <= 1e-5, (kernel, r)
    assert r["sbhd_masked_out"] <= 1e-5 and r["sbhd_causal_out"] <= 1e-6, r


@pytest.mark.timeout(400)
def test_block_mask_built_once_per_microbatch_and_no_host_reads_in_the_layers():
    """Two micro-batches through 2- and 4-layer models: the flex kernel builds one block mask per micro-batch
    whatever the depth (the layers share it; the loop kernel builds none), and neither kernel reads a tensor
    back to the host inside the model's forward or backward (no per-layer .tolist()/.item() of cu_seqlens:
    RoPE and the sequence bounds come from the PackedRow built before the forward)."""
    out = run_multiprocess(aw.once_per_microbatch_worker, 1, args=([2, 4], ["flex", "loop"]), timeout=380)[0]
    for (layers, kernel), r in out.items():
        assert r["builds"] == (2 if kernel == "flex" else 0), (layers, kernel, r)
        assert r["host_reads"] == {}, (layers, kernel, r)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.timeout(300)
def test_the_compiled_flex_compiles_once_for_rows_of_any_length():
    """The function CUDA runs (torch.compile(flex_attention, dynamic=True), models.attention._compiled_flex),
    here compiled for CPU (forward only: torch's CPU flex has no backward): rows of four lengths (2 to 7 tiles)
    give one graph, and its output equals the reference implementation the other CPU tests run. (A row of a
    single tile would add one graph: dynamo specialises sizes of 1.)"""
    import torch._dynamo

    from m2po_megatron.models.attention import _compiled_flex, flex_row_attention, packed_row

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(0)
    graphs = []
    for lens in ([300, 17, 200, 5], [400, 400, 47], [64] * 12 + [11], [129, 3]):
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        row = packed_row(bounds, "cpu")
        q, k, v = (torch.randn(bounds[-1], 1, n, 16, generator=g).permute(1, 2, 0, 3) for n in (4, 2, 2))
        with torch.no_grad():
            out = _compiled_flex()(q, k, v, block_mask=row.block_mask(), scale=0.25, enable_gqa=True)
            ref = flex_row_attention(q, k, v, row.block_mask(), 0.25)
        assert float((out - ref).abs().max()) <= 1e-5
        graphs.append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    assert graphs == [1, 1, 1, 1], graphs


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.timeout(300)
def test_the_compiled_flex_fails_at_the_recompile_limit_instead_of_running_eagerly():
    """Past dynamo's recompile limit a compiled function silently runs eagerly, and eager flex materialises the
    scores; _compiled_flex makes that an error. A limit of 1 here: a row of one tile needs a second graph."""
    import torch._dynamo

    from m2po_megatron.models.attention import _compiled_flex, compiled_flex_call, packed_row

    saved = (torch._dynamo.config.fail_on_recompile_limit_hit, torch._dynamo.config.recompile_limit)
    torch._dynamo.reset()
    _compiled_flex.cache_clear()
    try:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for i, lens in enumerate(([300, 17, 200], [100])):
                row = packed_row([0, *torch.tensor(lens).cumsum(0).tolist()], "cpu")
                q, k, v = (torch.randn(sum(lens), 1, n, 16, generator=g).permute(1, 2, 0, 3) for n in (4, 2, 2))
                if i == 0:
                    compiled_flex_call(q, k, v, row.block_mask(), 0.25)
                    assert torch._dynamo.config.fail_on_recompile_limit_hit is True
                    torch._dynamo.config.recompile_limit = 1
                    continue
                with pytest.raises(RuntimeError, match=r"recompile_limit \(1\) at q \(1, 4, 100, 16\)"):
                    compiled_flex_call(q, k, v, row.block_mask(), 0.25)
    finally:
        torch._dynamo.config.fail_on_recompile_limit_hit, torch._dynamo.config.recompile_limit = saved
        torch._dynamo.reset()
        _compiled_flex.cache_clear()


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_compiled_flex_on_cuda_matches_the_loop_without_recompiling_per_row_length():
    """CUDA: the compiled flex kernel against the per-sequence SDPA loop (fp32 forward and gradients) on rows
    of three lengths; the compile happens for the first row only (dynamic shapes)."""
    r = run_multiprocess(aw.cuda_flex_worker, 1, timeout=380)[0]
    assert max(r["rel_diff"]) <= 1e-4, r
    assert r["graphs"][0] >= 1 and r["graphs"][-1] == r["graphs"][0], r
