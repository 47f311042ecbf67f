"""Measures what megatron-core's decoder layers save for backward (run in a spawned rank; no pytest here)."""
from __future__ import annotations

import torch

SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6,
             rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")


def hf_config(model_type: str) -> dict:
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    return dict(SHAPE, model_type=model_type, architectures=[arch])


def saved_bytes_per_token(cases, row_tokens: int = 512, num_seqs: int = 4) -> list[dict]:
    """For each (model_type, attention_backend, params_dtype, recompute): bytes per token per dtype that the
    first decoder layer's forward saves for backward (unique storages, parameters excluded)."""
    from m2po_megatron.actor.batch import TrainBatch
    from m2po_megatron.actor.packing import build_microbatch, model_inputs
    from m2po_megatron.actor.parallel import init_distributed
    from m2po_megatron.models.builder import build_gpt_model, transformer_config_from_hf

    init_distributed()
    out = []
    for model_type, backend, dtype, recompute in cases:
        cfg = hf_config(model_type)
        extra = {"recompute_granularity": recompute} if recompute else {}
        model = build_gpt_model(cfg, transformer_config_from_hf(cfg, params_dtype=dtype, **extra),
                                attention_backend=backend)
        model.train()
        if backend == "sdpa":  # the kernel a GPU runs (the CPU's default is the per-sequence fallback)
            from m2po_megatron.models.attention import PackedSDPAttention

            for m in model.modules():
                if isinstance(m, PackedSDPAttention):
                    m.kernel = "flex"
        g = torch.Generator().manual_seed(0)
        n = row_tokens // num_seqs
        batch = TrainBatch([torch.randint(0, SHAPE["vocab_size"], (n,), generator=g) for _ in range(num_seqs)],
                           [1] * num_seqs)
        mb = build_microbatch(batch, list(range(num_seqs)))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        where = ["outside"]
        seen: dict[int, tuple[str, int, str]] = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params and st.data_ptr() not in seen:
                seen[st.data_ptr()] = (where[0], st.nbytes(), str(t.dtype).removeprefix("torch."))
            return t

        layer = model.decoder.layers[0]
        layer.register_forward_pre_hook(lambda *_: where.__setitem__(0, "layer0"))
        layer.register_forward_hook(lambda *_: where.__setitem__(0, "outside"))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(**model_inputs(mb, "cpu", backend))
        per: dict[str, float] = {}
        for w, nbytes, dt in seen.values():
            if w == "layer0":
                per[dt] = per.get(dt, 0.0) + nbytes / row_tokens
        out.append(per)
        del logits
    return out
