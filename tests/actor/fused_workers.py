"""Workers for tests/actor/test_fused_logprobs.py (imported by spawned ranks, so no pytest here).

One megatron-core GPTModel per case at the world size's tensor parallelism (same seed on every rank), one
packed row of three sequences; today's path (the model's [S, V/tp] logits -> actor.logprobs.token_log_probs)
against the fused one (GPTModel's output_processor hook -> actor.fused_logprobs)."""
from __future__ import annotations

import os
import zlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from actor_workers import INLINE_QWEN2_UNTIED

CFG = dict(INLINE_QWEN2_UNTIED, vocab_size=512)  # V/tp = 256 at TP2: no other tensor has a 256-wide dim


class LargestVocabTensor(TorchDispatchMode):
    """The largest numel of any tensor an op returns with a dimension of `vocab_local` elements."""

    def __init__(self, vocab_local: int):
        super().__init__()
        self.vocab_local, self.largest = vocab_local, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and self.vocab_local in t.shape:
                self.largest = max(self.largest, t.numel())
        return out


def _row(vocab: int):
    from m2po_megatron.actor.batch import TrainBatch
    from m2po_megatron.actor.packing import build_microbatch

    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, vocab, (n,), generator=g) for n in (40, 57, 31)]
    batch = TrainBatch(ids, [5, 9, 4])
    return build_microbatch(batch, [0, 1, 2])


def _model(tied: bool, dtype: str = "fp32"):
    from m2po_megatron.models.builder import build_gpt_model, transformer_config_from_hf

    cfg = dict(CFG, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, transformer_config_from_hf(cfg, params_dtype=dtype,
                                                            tensor_model_parallel_size=_tp()),
                            attention_backend="sdpa")
    with torch.no_grad():  # spread the weights so that log-probs and gradients are far from uniform
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(zlib.crc32(n.encode())))
    return model


def _tp() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # every rank of the world is one tensor-parallel rank


def _grads(model, hidden):
    params = dict(model.named_parameters())
    w = "embedding.word_embeddings.weight" if "output_layer.weight" not in params else "output_layer.weight"
    out = {"hidden": hidden.grad.clone(), "output_weight": params[w].grad.clone(),
           "fc2": params["decoder.layers.1.mlp.linear_fc2.weight"].grad.clone()}
    model.zero_grad()
    return out


def _capture_hidden(model):
    """The decoder's output (the output layer's input), kept with its gradient."""
    box = []

    def hook(_mod, _inp, out):
        out.retain_grad()
        box.append(out)
    return box, model.decoder.register_forward_hook(hook)


def parity_worker(chunk_bytes_list):
    """For tied and untied embeddings: today's path and the fused one at each chunk size: log-probs, entropy,
    the gradients w.r.t. the decoder's output, the output weight and a decoder weight, and the largest tensor
    with a V/tp dimension that either path allocated in forward + backward."""
    from m2po_megatron.actor.fused_logprobs import output_layer_log_probs
    from m2po_megatron.actor.logprobs import token_log_probs
    from m2po_megatron.actor.packing import model_inputs
    from m2po_megatron.actor.parallel import init_distributed
    from megatron.core import parallel_state as ps

    init_distributed(tensor_model_parallel_size=_tp())
    tp_group = ps.get_tensor_model_parallel_group()
    mb = _row(CFG["vocab_size"])
    pos = mb.logprob_positions
    tgt = mb.labels[0].index_select(0, pos)
    wts = torch.randn(pos.numel(), generator=torch.Generator().manual_seed(9))
    vl = CFG["vocab_size"] // _tp()
    out = {"seq_len": mb.seq_len, "vocab_local": vl, "rows": pos.numel()}
    for tied in (False, True):
        model = _model(tied)
        model.train()
        box, handle = _capture_hidden(model)
        watch = LargestVocabTensor(vl)
        with watch:
            logits = model(**model_inputs(mb, "cpu", "sdpa"))
            ref_lp, ref_ent = token_log_probs(logits[0], pos, tgt, tp_group)
            (ref_lp * wts).sum().backward()
        ref = {"lp": ref_lp.detach(), "ent": ref_ent, "largest": watch.largest, **_grads(model, box.pop())}
        fused = {}
        for cb in chunk_bytes_list:
            def processor(*, hidden_states, output_layer, output_weight, **_):
                return output_layer_log_probs(hidden_states, output_layer, output_weight, pos, tgt, tp_group,
                                              chunk_bytes=cb)
            watch = LargestVocabTensor(vl)
            with watch:
                lp, ent = model(**model_inputs(mb, "cpu", "sdpa"), output_processor=processor)
                (lp * wts).sum().backward()
            fused[cb] = {"lp": lp.detach(), "ent": ent, "largest": watch.largest, **_grads(model, box.pop())}
        handle.remove()
        out[tied] = {"ref": ref, "fused": fused}
    return out


def saved_worker():
    """Bytes by dtype that the fused log-probs keep for backward in a bf16 GPTModel (unique storages,
    parameters excluded, only while the output processor runs), and the number of response rows."""
    from m2po_megatron.actor.fused_logprobs import output_layer_log_probs
    from m2po_megatron.actor.packing import model_inputs
    from m2po_megatron.actor.parallel import init_distributed
    from megatron.core import parallel_state as ps

    init_distributed(tensor_model_parallel_size=_tp())
    tp_group = ps.get_tensor_model_parallel_group()
    mb = _row(CFG["vocab_size"])
    pos = mb.logprob_positions
    tgt = mb.labels[0].index_select(0, pos)
    model = _model(False, "bf16")
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, seen = [False], {}

    def pack(t):
        st = t.untyped_storage()
        if inside[0] and st.data_ptr() not in params and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (st.nbytes(), str(t.dtype).removeprefix("torch."))
        return t

    def processor(*, hidden_states, output_layer, output_weight, **_):
        inside[0] = True
        try:
            return output_layer_log_probs(hidden_states, output_layer, output_weight, pos, tgt, tp_group)
        finally:
            inside[0] = False

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = model(**model_inputs(mb, "cpu", "sdpa"), output_processor=processor)
    per: dict[str, float] = {}
    for nbytes, dt in seen.values():
        per[dt] = per.get(dt, 0.0) + nbytes
    lp.sum().backward()  # the saved graph runs
    return {"bytes": per, "rows": pos.numel(), "lp_dtype": str(lp.dtype)}


def sequence_parallel_worker():
    """megatron's ColumnParallelLinear output layer with sequence_parallel=True (this rank holds S/tp rows of
    the hidden states): today's path (the layer's all-gather and [S, V/tp] logits -> token_log_probs) and
    output_layer_log_probs on the same layer and rows: log-probs and the gradients w.r.t. this rank's rows
    and the layer's weight."""
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from m2po_megatron.actor.fused_logprobs import output_layer_log_probs
    from m2po_megatron.actor.logprobs import token_log_probs
    from m2po_megatron.actor.parallel import init_distributed

    tp = _tp()
    init_distributed(tensor_model_parallel_size=tp)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    s, h, v = 24, 16, 40
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True, params_dtype=torch.float32,
                              use_cpu_initialization=True)
    layer = ColumnParallelLinear(h, v, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                 gather_output=False, tp_group=group)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(v, h, generator=g)[rank * v // tp:(rank + 1) * v // tp])
    full = torch.randn(s, 1, h, generator=g)
    pos = torch.tensor([1, 4, 5, 9, 12, 13, 17, 20, 23])
    tgt = torch.randint(0, v, (pos.numel(),), generator=g)
    wts = torch.randn(pos.numel(), generator=g)
    out = {"sequence_parallel": layer.sequence_parallel}
    for name in ("ref", "fused"):
        x = full[rank * s // tp:(rank + 1) * s // tp].clone().requires_grad_()
        if name == "ref":
            logits, _ = layer(x)
            lp, _ = token_log_probs(logits[:, 0], pos, tgt, group)
        else:
            lp, _ = output_layer_log_probs(x, layer, None, pos, tgt, group, chunk_bytes=4 * (v // tp) * 2)
        (lp * wts).sum().backward()
        out[name] = {"lp": lp.detach(), "hidden": x.grad.clone(), "weight": layer.weight.grad.clone()}
        layer.weight.grad = None
    return out


def actor_alloc_worker(chunk_rows_: int = 8):
    """MegatronActor (TP1, fp32, vocabulary 512) on rows of about 300 tokens: the largest tensor with a
    vocabulary dimension that any op returns during compute_log_probs and during train_step (the M2PO mask's
    forward, forward + backward, the optimizer step), with the fused chunk set to `chunk_rows_` rows."""
    from m2po_megatron.actor import fused_logprobs
    from m2po_megatron.actor.actor import MegatronActor
    from actor_workers import make_batch, make_hf_model

    fused_logprobs.CHUNK_BYTES = 4 * CFG["vocab_size"] * chunk_rows_
    hf = make_hf_model(CFG)
    batch = make_batch(n=6, vocab=CFG["vocab_size"], min_len=90, max_len=150, ref_model=hf)
    actor = MegatronActor(hf_config=CFG, load_from=hf, micro_batch_tokens=320, lr=1e-5)
    rows = [m.seq_len for m in actor._plan(batch, list(range(len(batch))))]
    out = {"rows": rows, "vocab": CFG["vocab_size"], "hidden": CFG["hidden_size"]}
    for name, fn in (("log_probs", lambda: actor.compute_log_probs(batch)),
                     ("train_step", lambda: actor.train_step(batch))):
        watch = LargestVocabTensor(CFG["vocab_size"])
        with watch:
            fn()
        out[name] = watch.largest
    actor.close()
    return out
