"""The reference model and the KL and entropy terms through a real MegatronActor (two gloo ranks on CPU: data
parallel 2). The reference holds the initial weights and stays frozen; its host copies are what the module holds
between passes; the update with KL (k1) and the entropy bonus equals transformers' autograd of the written
loss; and the terms compose with M2PO's global mask and a rollout correction."""
import pytest
import torch

from m2po_megatron.actor.batch import TrainBatch
from m2po_megatron.actor.correction import three_policy_batch
from m2po_megatron.actor.dp_share import rank_share
from m2po_megatron.algo.rollout_correction import CorrectionSpec

KL_COEF, ENT_COEF, LR = 0.5, 0.1, 0.1


def test_ref_log_probs_travel_with_select_filler_and_correction():
    ids = [torch.arange(6), torch.arange(5)]
    ref = [torch.full((3,), -1.0), torch.full((2,), -2.0)]
    b = TrainBatch(ids, [3, 3], behav_log_probs=[torch.full((3,), -1.5), torch.full((2,), -1.5)],
                   advantages=torch.ones(2), ref_log_probs=ref)
    assert b.select([1]).ref_log_probs[0] is ref[1]
    filled, _, shard, filler = rank_share(b.select([]), 2, 1)
    assert filler and shard == [0] and [len(x) for x in filled.ref_log_probs] == [1]  # the filler's own
    filled, _, shard, filler = rank_share(b.select([0]), 2, 1)
    assert filler and [len(x) for x in filled.ref_log_probs] == [3, 1]
    out, _ = three_policy_batch(b, [torch.full((3,), -1.4), torch.full((2,), -1.6)], CorrectionSpec(mode="tis"))
    assert out.ref_log_probs is b.ref_log_probs


def worker():
    import copy

    from actor_workers import hf_log_probs, make_batch, make_hf_model, tiny_config

    from m2po_megatron.actor.actor import MegatronActor

    cfg = tiny_config("qwen2_untied")
    hf = make_hf_model(cfg)
    batch = make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf)
    batch.advantages = torch.zeros(len(batch))  # the policy term has no gradient: the update is KL + entropy
    actor = MegatronActor(hf_config=cfg, load_from=hf, micro_batch_tokens=40, loss_name="grpo_notr",
                          optimizer="sgd", lr=LR, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=False,
                          reference=dict(kl_loss_coef=KL_COEF, kl_loss_type="k1", param_offload=True),
                          entropy_coeff=ENT_COEF)
    ref = actor.reference
    host = ref.host_tensors()
    before, _ = actor.compute_log_probs(batch)
    ref0 = actor.reference_log_probs(batch)
    held = all(t.data_ptr() == h.data_ptr() for t, h in zip((t for c in ref.chunks for t in c.parameters()), host))
    m1 = actor.train_step(batch)
    after, _ = actor.compute_log_probs(batch)
    m2 = actor.train_step(batch)
    ref1 = actor.reference_log_probs(batch)
    actor.close()

    # transformers' autograd of the written loss: KL_COEF x token-mean(log p - ref) - ENT_COEF x token-mean(H)
    model = copy.deepcopy(hf).train()
    total, n = 0.0, sum(batch.response_lens)
    for ids, p in zip(batch.input_ids, batch.prompt_lens):
        logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)[p - 1:-1]
        tok = logp.gather(-1, ids[p:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        total = total + (KL_COEF * tok.sum() - ENT_COEF * ent.sum()) / n
    total.backward()
    with torch.no_grad():
        for w in model.parameters():
            w -= LR * w.grad
    expected, _ = hf_log_probs(model.eval(), batch)

    # composes with M2PO's batch-level mask and a rollout correction (k3, the default type)
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(3))
    actor = MegatronActor(hf_config=cfg, load_from=hf, micro_batch_tokens=40, loss_name="m2po", m2po_tau=0.02,
                          m2po_scope="global", rollout_correction={"mode": "tis", "threshold": 2.0},
                          reference=dict(kl_loss_coef=KL_COEF, param_offload=False), entropy_coeff=ENT_COEF,
                          lr=1e-2)
    m3 = [actor.train_step(batch, num_minibatches=2) for _ in range(2)]
    actor.close()
    return dict(before=before, ref0=ref0, ref1=ref1, held=held, n_host=len(host), m1=m1, m2=m2, after=after,
                expected=expected, m3=m3)


@pytest.mark.timeout(400)
def test_reference_kl_and_entropy_through_the_actor():
    from m2po_megatron.actor.launch import run_multiprocess

    outs = run_multiprocess(worker, 2, timeout=380)
    o = outs[0]
    assert o["held"] and o["n_host"] > 0  # between passes the module holds the host copies
    # the reference is the initial weights, and stays them after two updates
    for a, b, c in zip(o["before"], o["ref0"], o["ref1"]):
        assert torch.equal(a, b) and torch.equal(b, c)
    m1, m2 = o["m1"], o["m2"]
    assert m1["kl_ref/k1"] == 0 and m1["kl_ref/k3"] == 0 and m1["kl_loss"] == 0  # theta = reference
    assert m2["kl_loss"] == pytest.approx(m2["kl_ref/k1"], rel=1e-6) != 0 and m2["kl_ref/k3"] > 0  # k1: signed and m2["time/actor/ref_pass"] > 0
    # one SGD step of KL (k1) + the entropy bonus equals transformers' autograd of the written loss
    diff = max(float((x - y).abs().max()) for x, y in zip(o["after"], o["expected"]))
    moved = max(float((x - y).abs().max()) for x, y in zip(o["after"], o["before"]))
    assert diff < 2e-4 < moved, (diff, moved)
    for m in o["m3"]:  # with M2PO's mask and a correction, over DP 2 and two updates per step
        assert {"kl_loss", "kl_ref/k1", "kl_ref/k3", "m2po_global/num_dropped", "entropy"} <= m.keys()
        assert m["num_updates"] == 2 and all("kl_loss" in u for u in m["per_update"])
    assert o["m3"][1]["kl_ref/k3"] > 0
    assert outs[1]["m2"]["kl_loss"] == m2["kl_loss"]  # every rank reports the same


LAYOUTS = [dict(pipeline_model_parallel_size=2), dict(tensor_model_parallel_size=2, sequence_parallel=True),
           dict(moe=True, expert_model_parallel_size=2, routing_replay="r2")]


def layout_worker():
    """Per layout on two ranks: the reference's log-probs against the actor's at the start and after two steps,
    and the KL then."""
    from actor_workers import MOE, make_batch, make_hf_model, tiny_config

    from m2po_megatron.actor.actor import MegatronActor

    out = []
    for lay in LAYOUTS:
        kw = dict(lay)
        cfg = MOE if kw.pop("moe", False) else tiny_config("qwen2_untied")
        hf = make_hf_model(cfg)
        batch = make_batch(n=8, vocab=cfg["vocab_size"], ref_model=hf)
        actor = MegatronActor(hf_config=cfg, load_from=hf, micro_batch_tokens=40, loss_name="grpo", lr=1e-2,
                              reference=dict(kl_loss_coef=0.1, param_offload=True), entropy_coeff=0.01, **kw)
        lp0, _ = actor.compute_log_probs(batch)
        ref0 = actor.reference_log_probs(batch)
        actor.train_step(batch)
        m = actor.train_step(batch)
        ref1 = actor.reference_log_probs(batch)
        actor.close()
        out.append((max(float((a - b).abs().max()) for a, b in zip(lp0, ref0)),
                    max(float((a - b).abs().max()) for a, b in zip(ref0, ref1)), m["kl_ref/k3"]))
    return out


@pytest.mark.timeout(400)
def test_the_reference_takes_the_actors_layout():
    """PP 2, TP 2 with sequence parallelism, and MoE at EP 2 with R2: the reference is the initial weights in
    each (its log-probs equal the actor's before any update, bit for bit), stays frozen, and the KL is live."""
    from m2po_megatron.actor.launch import run_multiprocess

    for lay, (start, frozen, kl) in zip(LAYOUTS, run_multiprocess(layout_worker, 2, timeout=380)[0]):
        assert start == 0 and frozen == 0 and kl > 0, (lay, start, frozen, kl)
