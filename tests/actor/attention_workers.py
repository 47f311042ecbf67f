"""Workers for tests/actor/test_attention.py (spawned ranks; no pytest imports here)."""
from __future__ import annotations

import math

import torch

import actor_workers as w

# sequences of ragged lengths in one row: one longer than flex's 128-token tile, one of a single token
ROW_LENS = [9, 140, 1, 33, 6]
ROW_PAD = 5


def _set_kernel(model, kernel):
    from m2po_megatron.models.attention import PackedSDPAttention

    n = 0
    for m in model.modules():
        if isinstance(m, PackedSDPAttention):
            m.kernel = kernel
            n += 1
    return n


def _build(cfg, hf, backend, kernel=None):
    from m2po_megatron.models import build_gpt_model, load_hf_weights, transformer_config_from_hf

    model = build_gpt_model(cfg, transformer_config_from_hf(cfg), attention_backend=backend)
    load_hf_weights(model, hf)
    if kernel is not None:
        assert _set_kernel(model, kernel) == cfg["num_hidden_layers"]
    return model


def _weight_pairs(cfg) -> dict:
    """Megatron name -> HF name of the weights laid out alike in both at TP1."""
    pairs = {"embedding.word_embeddings.weight": "model.embed_tokens.weight"}
    if not cfg.get("tie_word_embeddings"):
        pairs["output_layer.weight"] = "lm_head.weight"
    for i in range(cfg["num_hidden_layers"]):
        pairs[f"decoder.layers.{i}.self_attention.linear_proj.weight"] = f"model.layers.{i}.self_attn.o_proj.weight"
        pairs[f"decoder.layers.{i}.mlp.linear_fc2.weight"] = f"model.layers.{i}.mlp.down_proj.weight"
    return pairs


def model_parity_worker(names):
    """Per config: the sdpa backend with each kernel (flex over the row, the per-sequence loop) and the dense
    local backend on one packed row (ROW_LENS + trailing padding, fp32) against HF transformers run on each
    sequence alone: logits, and gradients of a fixed random projection of the logits w.r.t. the weights laid
    out alike (embedding, output layer, every attention output and MLP down projection). Plus RoPE from
    position ids: one sequence at positions 3, 5, 7, ... against HF given the same position ids."""
    from m2po_megatron.actor.packing import model_inputs
    from m2po_megatron.actor.parallel import init_distributed

    init_distributed()
    out = {}
    for name in names:
        cfg = w.tiny_config(name)
        hf = w.make_hf_model(cfg)
        batch, mb = w._packed_row(cfg["vocab_size"], ROW_LENS, pad=ROW_PAD)
        wt = torch.randn(mb.seq_len, cfg["vocab_size"], generator=torch.Generator().manual_seed(5))
        real = torch.zeros(mb.seq_len, dtype=torch.bool)
        real[:sum(mb.lengths)] = True
        hf.zero_grad()
        ref_logits = torch.cat([hf(ids[None]).logits[0] for ids in batch.input_ids])
        (ref_logits * wt[real]).sum().backward()
        pairs = _weight_pairs(cfg)
        hf_params = dict(hf.named_parameters())
        ref = {"logits": ref_logits.detach(), "grads": {m: hf_params[h].grad.clone() for m, h in pairs.items()}}
        res = {}
        for key, backend, kernel in (("flex", "sdpa", "flex"), ("loop", "sdpa", "loop"), ("local", "local", None)):
            model = _build(cfg, hf, backend, kernel)
            logits = model(**model_inputs(mb, "cpu", backend))[0]
            (logits[real] * wt[real]).sum().backward()
            params = dict(model.named_parameters())
            res[key] = {"logits": logits[real].detach(), "grads": {m: params[m].grad.clone() for m in pairs}}

        def diff(a, b):
            return {"logits": float((a["logits"] - b["logits"]).abs().max()),
                    "grads": max(float((a["grads"][m] - b["grads"][m]).abs().max()) for m in pairs)}

        r = {f"{a}_vs_{b}": diff(res[a], ref if b == "hf" else res[b])
             for a, b in (("flex", "hf"), ("loop", "hf"), ("flex", "loop"), ("flex", "local"))}
        r["logit_scale"] = float(ref["logits"].abs().max())
        r["grad_scale"] = max(float(g.abs().max()) for g in ref["grads"].values())
        r["num_checked"] = len(pairs)
        # positions given to forward are the ones RoPE uses (not 0..n-1): every other position, from 3
        ids = batch.input_ids[1][None]
        pos = 3 + 2 * torch.arange(ids.size(1))[None]
        with torch.no_grad():
            hf_shift = hf(ids, position_ids=pos).logits[0]
            hf_plain = hf(ids).logits[0]
            model = _build(cfg, hf, "sdpa")
            mg_shift = model(input_ids=ids, position_ids=pos, attention_mask=None)[0]
        r["shifted_positions"] = float((mg_shift - hf_shift).abs().max())
        r["shift_matters"] = float((hf_plain - hf_shift).abs().max())
        out[name] = r
    return out


def _reference(q, k, v, bounds, groups_rep):
    """float64 per-sequence causal softmax attention on [s, n, d] tensors -> [s, n*d]."""
    outs = []
    for s0, s1 in zip(bounds[:-1], bounds[1:]):
        if s1 == s0:
            continue
        qi, ki, vi = q[s0:s1], k[s0:s1].repeat_interleave(groups_rep, 1), v[s0:s1].repeat_interleave(groups_rep, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) / math.sqrt(q.size(-1))
        causal = torch.ones(s1 - s0, s1 - s0, dtype=torch.bool).tril()
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vi))
    return torch.cat(outs).reshape(q.size(0), -1)


def module_worker():
    """PackedSDPAttention alone, each kernel, on a PackedRow ([s, 1, n, d]: GQA 4 query heads / 2 groups,
    sequences over several 128-token tiles, a zero-length one, trailing padding) against float64 attention
    per sequence: output and gradients w.r.t. q, k, v; and on an [s, b, n, d] batch with a padding mask."""
    from megatron.core.transformer.enums import AttnMaskType

    from m2po_megatron.actor.parallel import init_distributed
    from m2po_megatron.models.attention import PackedSDPAttention, packed_row
    from m2po_megatron.models.builder import transformer_config_from_hf

    init_distributed()
    cfg = dict(w.INLINE_QWEN2_UNTIED, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    attn = PackedSDPAttention(transformer_config_from_hf(cfg), 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(0)
    bounds = [0, 130, 130, 137, 300, 301, 340]  # a zero-length sequence; the last segment is padding
    t, d = bounds[-1], 16
    q0, k0, v0 = (torch.randn(t, 1, n, d, generator=g) for n in (4, 2, 2))
    wt = torch.randn(t, 1, 4 * d, generator=g)
    q64, k64, v64 = (x[:, 0].double().requires_grad_() for x in (q0, k0, v0))
    ref = _reference(q64, k64, v64, bounds, 2)
    (ref * wt[:, 0].double()).sum().backward()
    res = {}
    for kernel in ("flex", "loop"):
        attn.kernel = kernel
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = attn(q, k, v, None, packed_seq_params=packed_row(bounds, "cpu"))
        (out * wt).sum().backward()
        res[kernel] = {
            "shape": tuple(out.shape),
            "out": float((out[:, 0].double() - ref).abs().max()),
            "grad": max(float((a.grad[:, 0].double() - b.grad).abs().max()) for a, b in ((q, q64), (k, k64), (v, v64))),
        }
    attn.kernel = None
    # [s, b, n, d] with a mask (True = masked): batch of 2, the second padded after 4 tokens
    s, b = 7, 2
    qs, ks, vs = (torch.randn(s, b, n, d, generator=g) for n in (4, 2, 2))
    keep = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
    keep[1, :, :, 4:] = False
    keep[1, :, 4:, :] = torch.eye(s, dtype=torch.bool)[4:]  # padded queries see themselves only
    o = attn(qs, ks, vs, ~keep)
    ref = []
    for i in range(b):
        sc = torch.einsum("qhd,khd->hqk", qs[:, i].double(), ks[:, i].repeat_interleave(2, 1).double()) / math.sqrt(d)
        p = sc.masked_fill(~keep[i], float("-inf")).softmax(-1)
        ref.append(torch.einsum("hqk,khd->qhd", p, vs[:, i].repeat_interleave(2, 1).double()).reshape(s, -1))
    res["sbhd_masked_out"] = float((o.double() - torch.stack(ref, 1)).abs().max())
    causal = attn(qs, ks, vs, None)
    tril = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
    res["sbhd_causal_out"] = float((causal - attn(qs, ks, vs, ~tril)).abs().max())
    return res


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts tensor-to-host reads (.tolist(), .item(), int()/float()/bool() of a tensor) while active."""

    NAMES = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def once_per_microbatch_worker(num_layers_list, kernels):
    """For each layer count and kernel: forward + backward of the sdpa backend over two micro-batches (rows of
    different lengths), counting block-mask builds (models.attention.document_causal_block_mask) and
    tensor-to-host reads during the model's forward and backward (model_inputs excluded)."""
    from m2po_megatron.actor.packing import model_inputs
    from m2po_megatron.actor.parallel import init_distributed
    from m2po_megatron.models import attention

    init_distributed()
    builds = [0]
    real_build = attention.document_causal_block_mask

    def counting_build(*a, **kw):
        builds[0] += 1
        return real_build(*a, **kw)

    attention.document_causal_block_mask = counting_build  # a spy: counts, then runs the real builder
    out = {}
    try:
        for layers in num_layers_list:
            cfg = dict(w.tiny_config("qwen3"), num_hidden_layers=layers)
            hf = w.make_hf_model(cfg)
            rows = [w._packed_row(cfg["vocab_size"], lens, pad=pad, seed=s)[1]
                    for lens, pad, s in (([12, 150, 7], 3, 1), ([40, 9], 0, 2))]
            for kernel in kernels:
                model = _build(cfg, hf, "sdpa", kernel)
                builds[0] = 0
                reads = _HostReads()
                for mb in rows:
                    inputs = model_inputs(mb, "cpu", "sdpa")
                    with reads:
                        model(**inputs)[0].float().pow(2).mean().backward()
                out[(layers, kernel)] = {"builds": builds[0], "host_reads": dict(reads.calls)}
    finally:
        attention.document_causal_block_mask = real_build
    return out


def cuda_flex_worker():
    """The compiled flex kernel (CUDA) against the loop on three rows of different lengths: max relative
    difference of output and q/k/v gradients per row, and dynamo's unique-graph count after each row."""
    import torch._dynamo
    from megatron.core.transformer.enums import AttnMaskType

    from m2po_megatron.actor.parallel import init_distributed
    from m2po_megatron.models.attention import PackedSDPAttention, packed_row
    from m2po_megatron.models.builder import transformer_config_from_hf

    init_distributed()
    cfg = dict(w.INLINE_QWEN2_UNTIED, num_attention_heads=8, num_key_value_heads=2, hidden_size=512)
    attn = PackedSDPAttention(transformer_config_from_hf(cfg, params_dtype="fp32"), 1, AttnMaskType.causal,
                              "self").cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    torch._dynamo.utils.counters.clear()
    out = {"rel_diff": [], "graphs": []}
    for lens in ([300, 17, 900, 5], [1000, 1000, 47], [64] * 40 + [11]):
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        t = bounds[-1]
        x = [torch.randn(t, 1, n, 64, device="cuda", generator=g) for n in (8, 2, 2)]
        wt = torch.randn(t, 1, 8 * 64, device="cuda", generator=g)
        res = {}
        for kernel in ("flex", "loop"):
            attn.kernel = kernel
            q, k, v = (a.clone().requires_grad_() for a in x)
            o = attn(q, k, v, None, packed_seq_params=packed_row(bounds, "cuda"))
            (o * wt).sum().backward()
            res[kernel] = (o.detach(), q.grad, k.grad, v.grad)
        out["rel_diff"].append(max(float((a - b).abs().max()) / max(1.0, float(b.abs().max()))
                                   for a, b in zip(res["flex"], res["loop"])))
        out["graphs"].append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    return out
