"""Workers for the multi-process actor tests (imported by spawned children, so no pytest imports here).

Each worker builds tiny random HF models (same seed on every rank), then Megatron actors at several layouts
in the same processes (the actor can be rebuilt after close()), and returns plain numbers/tensors."""
from __future__ import annotations

import json
import os

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)

INLINE_QWEN2_UNTIED = {  # always available: written here
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_dropout": 0.0, "use_sliding_window": False,
    **TINY,
}
# The HF configs the package bundles (the recipes' models), so every checkout tests every family.
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "m2po_megatron", "assets", "configs")
BUNDLED = {  # name -> (dir under CONFIGS, overrides)
    "qwen2_tied": ("Qwen__Qwen2.5-32B", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen__Qwen3-1.7B-Base", {"head_dim": 32}),
    "llama32": ("meta-llama__Llama-3.2-3B-Instruct", {"head_dim": 16, "rope_scaling": {
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 16,
        "rope_type": "llama3"}}),
}


def tiny_config(name: str) -> dict:
    if name == "qwen2_untied":
        d = dict(INLINE_QWEN2_UNTIED)
    else:
        sub, over = BUNDLED[name]
        with open(os.path.join(CONFIGS, sub, "config.json")) as f:
            d = json.load(f)
        d.update(TINY)
        d.update(over)
    d.pop("layer_types", None)
    d.pop("rope_parameters", None) if name != "llama32" else None
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        d[k] = None
    return d


def make_hf_model(cfg: dict, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # spread weights so that a wrong mapping shows in the log-probs
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def make_batch(n=6, vocab=256, seed=1, min_len=6, max_len=20, behav_noise=0.3, ref_model=None):
    from m2po_megatron.actor.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids, plens = [], []
    for _ in range(n):
        L = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids.append(torch.randint(0, vocab, (L,), generator=g))
        plens.append(int(torch.randint(2, 5, (1,), generator=g)))
    b = TrainBatch(ids, plens)
    if ref_model is not None:
        lp, _ = hf_log_probs(ref_model, b)
        b.behav_log_probs = [x + behav_noise * torch.randn(x.shape, generator=g) for x in lp]
        b.advantages = torch.randn(n, generator=g)
    return b


@torch.no_grad()
def hf_log_probs(model, batch):
    """Reference: each sequence alone through transformers, fp32."""
    lps, ents = [], []
    dev = next(model.parameters()).device
    for ids, p in zip(batch.input_ids, batch.prompt_lens):
        ids = ids.to(dev)
        logits = model(ids[None]).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        lps.append(logp[p - 1:-1].gather(-1, ids[p:, None]).squeeze(-1).cpu())
        ents.append(-(logp.exp() * logp).sum(-1)[p - 1:-1].cpu())
    return lps, ents


def _maxdiff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def logprob_worker(names, layouts):
    """For each config and (tp, pp) layout: max |log-prob diff| and |entropy diff| vs HF."""
    from m2po_megatron.actor.actor import MegatronActor

    out = {}
    for name in names:
        cfg = tiny_config(name)
        hf = make_hf_model(cfg)
        batch = make_batch(vocab=cfg["vocab_size"])
        ref_lp, ref_ent = hf_log_probs(hf, batch)
        for tp, pp in layouts:
            actor = MegatronActor(hf_config=cfg, load_from=hf, tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp, sequence_parallel=False,
                                  micro_batch_tokens=40, loss_name="grpo")
            lp, ent = actor.compute_log_probs(batch)
            out[(name, tp, pp)] = (_maxdiff(lp, ref_lp), _maxdiff(ent, ref_ent), actor.dp_size)
            actor.close()
    return out


def train_worker(name, jobs):
    """Run train jobs in order in this process group; each job is a dict:
    tp, pp, sp (sequence parallel), optimizer ('sgd'|'adam'), micro_batch_tokens, num_minibatches, save (dir or None), load (dir or
    None). A job without `load` runs train_step on batch A and returns metrics + HF-named weights; a job with
    `save` or `load` then (after saving / after loading) runs train_step on batch B and returns its loss and the
weights after it."""
    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.convert.export import gather_hf_state_dict

    cfg = tiny_config(name)
    hf = make_hf_model(cfg)
    batch_a = make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf)
    batch_b = make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf, seed=7)
    results = []
    for job in jobs:
        opt = job.get("optimizer", "sgd")
        actor = MegatronActor(hf_config=cfg, load_from=hf, tensor_model_parallel_size=job["tp"],
                              pipeline_model_parallel_size=job["pp"], micro_batch_tokens=job.get("mbt", 40),
                              sequence_parallel=job.get("sp", False),
                              optimizer=opt, lr=0.1 if opt == "sgd" else 1e-3, weight_decay=0.0,
                              clip_grad=0.0, loss_name="m2po", m2po_tau=0.02, m2po_scope="global",
                              use_distributed_optimizer=job.get("distopt", opt == "adam"))
        res = {"dp": actor.dp_size}
        if job.get("load"):
            try:
                actor.load(job["load"])
            except ValueError as e:
                if not job.get("expect_error"):
                    raise
                results.append({"error": str(e)})
                actor.close()
                continue
        else:
            res["metrics"] = actor.train_step(batch_a, num_minibatches=job.get("num_minibatches", 1))
            res["weights"] = gather_hf_state_dict(actor.model_chunks(), actor.spec)
            init = hf.state_dict()
            res["moved"] = max(float((v - init[k]).abs().max()) for k, v in res["weights"].items() if k in init)
        if job.get("save"):
            actor.save(job["save"])
        if job.get("save") or job.get("load"):
            res["loss_b"] = actor.train_step(batch_b, num_minibatches=1)["loss"]
            res["weights_b"] = gather_hf_state_dict(actor.model_chunks(), actor.spec)  # after an update: exposes the optimizer state
        results.append(res)
        actor.close()
    return results


def resume_worker(ckpt_dir: str, foreach_modes: tuple = (False, True)):
    """Distributed optimizer (DP = world size) over torch's AdamW: run A updates once, saves, updates twice more
    (uninterrupted); run B is a fresh actor that loads the checkpoint and makes the same two updates. Per foreach
    mode (False: torch's per-parameter kernel, its CPU default; True: the multi-tensor kernel, its CUDA default):
    the parameters after each update of both runs, and each run's final Adam 'step' values and how many distinct
    'step' tensors its parameters hold."""
    from m2po_megatron.actor.actor import MegatronActor

    cfg = tiny_config("qwen2_untied")
    hf = make_hf_model(cfg)
    batches = [make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf, seed=s) for s in (1, 7, 11)]

    def build(foreach):
        actor = MegatronActor(hf_config=cfg, load_from=hf, micro_batch_tokens=80, optimizer="adam", lr=1e-2,
                              weight_decay=0.1, clip_grad=0.0, loss_name="grpo", use_distributed_optimizer=True)
        (part,) = actor.optimizer.chained_optimizers
        assert type(part.optimizer).__name__ == "AdamW", type(part.optimizer)  # torch's, as without TE/Apex
        for g in part.optimizer.param_groups:
            g["foreach"] = foreach
        return actor, part.optimizer

    def params(actor):
        return [p.detach().clone() for p in actor.model_chunks()[0].parameters()]

    def steps(inner):
        st = [s["step"] for s in inner.state.values()]
        return sorted({float(t) for t in st}), len({id(t) for t in st}), len(st)

    out = {}
    for foreach in foreach_modes:
        path = os.path.join(ckpt_dir, f"foreach{int(foreach)}")
        a, inner_a = build(foreach)
        a.train_step(batches[0])
        a.save(path)
        run_a = []
        for b in batches[1:]:
            a.train_step(b)
            run_a.append(params(a))
        steps_a = steps(inner_a)
        a.close()
        b_actor, inner_b = build(foreach)
        b_actor.load(path)
        run_b = []
        for b in batches[1:]:
            b_actor.train_step(b)
            run_b.append(params(b_actor))
        out[foreach] = {"a": run_a, "b": run_b, "steps_a": steps_a, "steps_b": steps(inner_b),
                        "dp": b_actor.dp_size, "updates_b": b_actor.updates_applied}
        b_actor.close()
    return out


def recompute_worker(settings):
    """One M2PO step (SGD, micro-batched) per recompute setting; returns loss, HF-named weights, and how often
    decoder layers and core attention ran forward (recompute re-runs them in backward)."""
    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.convert.export import gather_hf_state_dict

    cfg = tiny_config("qwen2_untied")
    hf = make_hf_model(cfg)
    batch = make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf)
    out = {}
    for name, kw in settings.items():
        actor = MegatronActor(hf_config=cfg, load_from=hf, micro_batch_tokens=40, optimizer="sgd", lr=0.1,
                              weight_decay=0.0, clip_grad=0.0, m2po_tau=0.02, use_distributed_optimizer=False,
                              **kw)
        calls = {"layer": 0, "core_attn": 0}

        def count(key):
            def hook(module, args):
                calls[key] += 1
            return hook

        for layer in actor.model[0].module.decoder.layers:
            layer.register_forward_pre_hook(count("layer"))
            layer.self_attention.core_attention.register_forward_pre_hook(count("core_attn"))
        m = actor.train_step(batch, num_minibatches=2)
        out[name] = {"loss": m["loss"], "weights": gather_hf_state_dict(actor.model_chunks(), actor.spec), "calls": calls,
                     "microbatches": m["num_microbatches"]}
        actor.close()
    return out


def _packed_row(vocab: int, lens: list[int], pad: int = 0, seed: int = 3):
    """One packed micro-batch of sequences of `lens` tokens (+ `pad` trailing padding positions)."""
    from m2po_megatron.actor.batch import TrainBatch
    from m2po_megatron.actor.packing import build_microbatch

    g = torch.Generator().manual_seed(seed)
    b = TrainBatch([torch.randint(0, vocab, (n,), generator=g) for n in lens], [1] * len(lens))
    mb = build_microbatch(b, list(range(len(lens))))
    return b, (mb.padded_to(mb.seq_len + pad) if pad else mb)


def correction_worker():
    """The three-policy objective through the actor: (a) behaviour = proximal (the actor's own log-probs) with
    TIS gives bypass's step exactly, M2PO's global mask included; (b) behaviour shifted by a constant log c
    below the proximal gives TIS weight min(c, C) on every token, so GRPO without trust region (loss -A r)
    with c < C equals bypass, and with c > C is C / c of it; (c) MIS drops the tokens outside [1/C, C]."""
    import math

    from m2po_megatron.actor.actor import MegatronActor

    cfg = tiny_config("qwen2_untied")
    hf = make_hf_model(cfg)
    out = {}

    def actor(loss, corr):
        return MegatronActor(hf_config=cfg, load_from=hf, micro_batch_tokens=40, optimizer="sgd", lr=0.1,
                             weight_decay=0.0, clip_grad=0.0, loss_name=loss, m2po_tau=0.02,
                             use_distributed_optimizer=False, rollout_correction=corr)

    def step(loss, corr, batch, nmb=2):
        a = actor(loss, corr)
        m = a.train_step(batch, num_minibatches=nmb)
        w = {k: v.clone() for k, v in a.model_chunks()[0].state_dict().items() if isinstance(v, torch.Tensor)}
        a.close()
        return m, w

    batch = make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf)
    a = actor("m2po", None)
    own, _ = a.compute_log_probs(batch, with_entropy=False)
    a.close()
    batch.behav_log_probs = [x.clone() for x in own]
    out["same"] = {mode: step("m2po", None if mode == "bypass" else {"mode": mode}, batch)
                   for mode in ("bypass", "tis")}
    for name, c in (("below", 1.5), ("above", 3.0)):
        shifted = make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf)
        shifted.behav_log_probs = [x - math.log(c) for x in own]
        out[name] = {mode: step("grpo_notr", None if mode == "bypass" else {"mode": "tis", "threshold": 2.0},
                                shifted, nmb=1)[0] for mode in ("bypass", "tis")}
    noisy = make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf)  # behaviour = HF + N(0, 0.3) noise
    d = torch.cat(own) - torch.cat(noisy.behav_log_probs)
    out["mis"] = (step("grpo", {"mode": "mis", "threshold": 1.2}, noisy)[0],
                  float((d.abs() > math.log(1.2)).double().mean()), float(d.double().mean()),
                  float(d.double().square().mean()))
    # The first update (theta = p, so GRPO's ratio is 1): -sum(A w) over the kept tokens of the first
    # mini-batch (sequences 0-3), divided by the kept tokens only: dropped tokens leave the denominator.
    first = range(4)
    dd = torch.cat([own[i] - noisy.behav_log_probs[i] for i in first]).double()
    a = torch.cat([noisy.token_advantages(i) for i in first]).double()
    kept = dd.abs() <= math.log(1.2)
    out["mis_first_loss"] = float(-(a * dd.exp())[kept].sum() / kept.sum())
    return out


def m2_tokens_worker():
    """algo.m2po.m2_tokens through the actor's global mask: the first update's M2 before the mask, against
    transformers' log-probs at the starting weights (the mini-batch is the whole batch), over T and over all
    valid tokens."""
    from m2po_megatron.actor.actor import MegatronActor

    cfg = tiny_config("qwen2_untied")
    hf = make_hf_model(cfg)
    batch = make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf)
    lp, _ = hf_log_probs(hf, batch)
    lr = torch.cat([a - b for a, b in zip(lp, batch.behav_log_probs)]).double()
    adv = torch.cat([batch.token_advantages(i) for i in range(len(lp))]).double()
    tr = ((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0))
    out = {"hf": {"trust_region": float(lr[tr].square().mean()), "all": float(lr.square().mean())}}
    for tokens in ("trust_region", "all"):
        actor = MegatronActor(hf_config=cfg, load_from=hf, micro_batch_tokens=40, optimizer="sgd", lr=0.1,
                              weight_decay=0.0, clip_grad=0.0, loss_name="m2po", m2po_tau=0.02, m2po_scope="global",
                              use_distributed_optimizer=False, loss_kwargs={"m2_tokens": tokens})
        m = actor.train_step(batch, num_minibatches=1)
        out[tokens] = (m["m2po_global/m2_before"], m["m2po/m2_before"], m["m2po_global/num_dropped"])
        actor.close()
    return out


def short_batch_worker(sizes=(0, 1, 3, 5)):
    """Issue 35: mini-batches with fewer sequences than DP ranks (and none at all), one update each in turn,
    for M2PO (the mini-batch mask), GSPO (sequence means) and GRPO under a three-policy correction (TIS):
    per setting, the metrics and the weights after each update, to compare with DP = 1."""
    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.convert.export import gather_hf_state_dict

    cfg = tiny_config("qwen2_untied")
    hf = make_hf_model(cfg)
    settings = {"m2po": dict(loss_name="m2po", m2po_tau=0.02, m2po_scope="global"), "gspo": dict(loss_name="gspo"),
                "grpo-tis": dict(loss_name="grpo", rollout_correction={"mode": "tis", "threshold": 2.0})}
    out = {}
    for name, kw in settings.items():
        actor = MegatronActor(hf_config=cfg, load_from=hf, micro_batch_tokens=40, optimizer="sgd", lr=0.1,
                              weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=False, **kw)
        rows = []
        for n in sizes:
            batch = make_batch(n=max(n, 1), vocab=cfg["vocab_size"], ref_model=hf, seed=11 + n).select(range(n))
            m = actor.train_step(batch, num_minibatches=1)
            m.pop("per_update")
            w = gather_hf_state_dict(actor.model_chunks(), actor.spec)
            rows.append(({k: v for k, v in m.items() if not k.startswith("time/")}, w))
        out[name] = (actor.dp_size, rows)
        actor.close()
    return out


MOE = {  # a tiny Qwen3-MoE written here: 4 experts, top-2, every layer sparse
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_dropout": 0.0, "use_sliding_window": False,
    "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.0,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **TINY,
}


def _router_hooks(actor, seen: dict):
    """Forward hooks on every MoE router recording the experts it dispatched to ([tokens, E] routing map), split
    by pass: the forward, or a full-recompute re-run inside backward. An observation independent of the replay
    hook: what the layer's experts actually received."""
    from m2po_megatron.models.loading import unwrap

    handles = []
    for chunk in actor.model_chunks():
        for layer in unwrap(chunk).decoder.layers:
            def hook(mod, inp, out, i=layer.layer_number - 1):
                where = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
                seen.setdefault((where, i), []).append(out[1].detach().clone())
            handles.append(layer.mlp.router.register_forward_hook(hook))
    return handles


def moe_train_worker(jobs):
    """Tiny Qwen3-MoE jobs in order (each a dict: tp, pp, ep, sp, replay ('none'|'r2'|'r3'), recompute (bool),
    targets ('random' for R3 targets unlike the router's own)). Returns per job: dp, metrics, HF-named
    weights after one SGD update, and for R3 the share of tokens whose dispatched experts equal the targets,
    in forward and in recompute."""
    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.convert.export import gather_hf_state_dict

    cfg = MOE
    hf = make_hf_model(cfg)
    batch = make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf)
    g = torch.Generator().manual_seed(11)
    L, E, k = cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]
    routed = []
    for ids, p in zip(batch.input_ids, batch.prompt_lens):  # random distinct experts for the response tokens
        r = torch.full((ids.numel(), L, k), -1, dtype=torch.int16)
        r[p - 1:] = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range((ids.numel() - p + 1) * L)]
                                ).view(-1, L, k).to(torch.int16)
        routed.append(r)
    results = []
    for job in jobs:
        actor = MegatronActor(hf_config=cfg, load_from=hf, tensor_model_parallel_size=job.get("tp", 1),
                              pipeline_model_parallel_size=job.get("pp", 1),
                              expert_model_parallel_size=job.get("ep", 1), micro_batch_tokens=40,
                              sequence_parallel=job.get("sp", False),
                              optimizer="sgd", lr=0.1, weight_decay=0.0, clip_grad=0.0, loss_name="grpo",
                              use_distributed_optimizer=False,
                              routing_replay=job.get("replay", "none"),
                              recompute_granularity="full" if job.get("recompute") else None)
        b = batch.select(range(len(batch)))
        if job.get("replay") == "r3":
            b.routed_experts = routed
        seen: dict = {}
        handles = _router_hooks(actor, seen) if job.get("observe") else []
        recorded = _capture_r2(actor) if job.get("replay") == "r2" and job.get("observe") else {}
        res = {"dp": actor.dp_size, "metrics": actor.train_step(b, num_minibatches=job.get("num_minibatches", 1))}
        for h in handles:
            h.remove()
        res["weights"] = gather_hf_state_dict(actor.model_chunks(), actor.spec)
        if job.get("observe"):
            res["observed"] = {key: [m.sum().item() for m in maps] for key, maps in seen.items()}
            if job.get("replay") in ("r2", "r3"):  # R2: against the routing its recording pass produced
                res["exact"] = _replay_exact(actor, recorded.get("batch", b), seen, k)
        results.append(res)
        actor.close()
    return results


def _capture_r2(actor) -> dict:
    """{"batch": the step's batch with the routing R2 recorded}, filled when the step's recording pass ends."""
    out = {}
    prepare = actor.replay.prepare_step

    def capture(*args):
        out["batch"], metrics = prepare(*args)
        return out["batch"], metrics
    actor.replay.prepare_step = capture
    return out


def _replay_exact(actor, batch, seen, k):
    """(targets, equal) per pass: tokens with a target and those whose dispatched experts equal it, from the
    router hooks, over the training forward (the last of the forward calls: after the global-mask and
    diagnostics passes) and the recompute."""
    from m2po_megatron.actor.dp_share import rank_share
    from m2po_megatron.actor.routing_replay import row_targets, sp_share

    batch, _, shard, _ = rank_share(batch, actor.dp_size, actor.dp_rank)  # this rank's training micro-batches
    mbs = actor._plan(batch, shard)
    if actor.even:
        batch, _, mbs, _ = actor._even(batch, None, mbs)
    out = {}
    for where in ("forward", "recompute"):
        n_t = n_eq = 0
        for (w, i), maps in seen.items():
            if w != where:
                continue
            train = maps[-len(mbs):]  # this rank's training micro-batches, in schedule order
            for mb, m in zip(mbs, train):
                m = m.cpu()  # the router's map, on the model's device; the targets are host tensors
                t = row_targets(batch.routed_experts, mb, [i], k)
                if t is None:  # a filler micro-batch
                    continue
                t = sp_share(t[:, 0, :].long(), *actor.replay.sp_split)  # this TP rank's rows under SP
                has = t[:, 0] >= 0
                want = torch.zeros_like(m).scatter_(1, t.clamp_min(0), True)
                n_t += int(has.sum())
                n_eq += int(((want == m).all(1) & has).sum())
        out[where] = (n_t, n_eq)
    return out
