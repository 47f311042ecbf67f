"""TrainBatch.loss_mask through the actor (multi-turn rollouts): environment tokens inside a response go through
the forward pass but count nowhere a response token counts. The batch's checks and denominators, the filler,
the three-policy batch and the micro-batches' M2PO mask on their own (no model), then a real MegatronActor on
CPU: perturbing what the environment tokens hold changes no loss, metric or weight."""
import math
import pickle

import pytest
import torch

from m2po_megatron.actor.batch import TrainBatch
from m2po_megatron.actor.correction import three_policy_batch
from m2po_megatron.actor.dp_share import rank_share
from m2po_megatron.actor.global_mask import behav_and_advantages, m2po_keep_masks
from m2po_megatron.actor.packing import plan_microbatches
from m2po_megatron.algo.rollout_correction import CorrectionSpec


def _batch(n=8, vocab=256, seed=1, min_len=8, max_len=20) -> TrainBatch:
    """Random sequences whose responses hold environment blocks (loss mask 0) between policy tokens, with
    per-token advantages and behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    ids, plens, masks = [], [], []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        p = int(torch.randint(2, 5, (1,), generator=g))
        ids.append(torch.randint(0, vocab, (length,), generator=g))
        plens.append(p)
        r = length - p
        m = torch.ones(r, dtype=torch.bool)
        a = int(torch.randint(1, r - 1, (1,), generator=g))  # a tool output block inside the response
        m[a:a + int(torch.randint(1, r - a, (1,), generator=g))] = False
        masks.append(m)
    rl = [len(x) - p for x, p in zip(ids, plens)]
    return TrainBatch(ids, plens, behav_log_probs=[-torch.rand(r, generator=g) * 3 for r in rl],
                      advantages=[torch.randn(1, generator=g).expand(r).clone() for r in rl], loss_mask=masks)


def _perturbed(b: TrainBatch, seed=5, nan=False) -> TrainBatch:
    """b with large random behaviour log-probs and advantages on its environment tokens (NaN behaviour values
    with nan=True: an engine may leave them unset)."""
    g = torch.Generator().manual_seed(seed)
    out = b.select(range(len(b)))
    env = [~m for m in b.loss_mask]
    noise = [torch.full_like(x, math.nan) if nan else -50 * torch.rand(x.shape, generator=g) for x in b.behav_log_probs]
    out.behav_log_probs = [torch.where(e, z, x) for e, z, x in zip(env, noise, b.behav_log_probs)]
    out.advantages = [torch.where(e, 1e3 * torch.randn(x.shape, generator=g), x) for e, x in zip(env, b.advantages)]
    return out


def _policy_tokens(b: TrainBatch) -> int:
    return sum(int(m.sum()) for m in b.loss_mask)


def test_validate_names_the_loss_mask_and_the_fix():
    b = _batch()
    b.validate(for_training=True, vocab_size=256)
    _perturbed(b, nan=True).validate(for_training=True)  # an environment token's value is never read
    b.loss_mask = [m.long() for m in b.loss_mask]  # 0/1 integers are a mask too
    b.validate(for_training=True)
    bad = b.select(range(len(b)))
    bad.loss_mask[2] = bad.loss_mask[2][1:]
    with pytest.raises(ValueError, match=r"loss_mask\[2\] has shape .*expected .*response length"):
        bad.validate(for_training=False)
    bad.loss_mask[2] = torch.full_like(b.loss_mask[2], 2)
    with pytest.raises(ValueError, match=r"loss_mask\[2\] must be bool or 0/1"):
        bad.validate(for_training=False)
    bad.loss_mask[2] = torch.zeros_like(b.loss_mask[2])
    with pytest.raises(ValueError, match=r"loss_mask\[2\] has no policy token.*drop the sample"):
        bad.validate(for_training=False)
    bad.loss_mask = bad.loss_mask[:3]
    with pytest.raises(ValueError, match=r"loss_mask must be a list of 8 tensors"):
        bad.validate(for_training=False)
    nan = b.select(range(len(b)))
    nan.behav_log_probs[4] = nan.behav_log_probs[4].clone()
    nan.behav_log_probs[4][int(nan.loss_mask[4].nonzero()[0])] = math.nan  # on a policy token: refused
    with pytest.raises(ValueError, match=r"behav_log_probs\[4\] has non-finite values"):
        nan.validate(for_training=True)


def test_loss_counts_leave_environment_tokens_and_their_sequences_out():
    b = _batch()
    assert b.loss_counts() == (_policy_tokens(b), len(b))
    # with the correction's weights: policy tokens of weight > 0; a sequence left with none is not counted
    b.loss_weights = [torch.ones(len(m)) for m in b.loss_mask]
    b.loss_weights[3] = (~b.loss_mask[3]).float()  # weight only on the environment tokens: nothing left
    b.loss_weights[5][0] = 0.0
    n5 = int(b.loss_mask[5][0])
    assert b.loss_counts() == (_policy_tokens(b) - int(b.loss_mask[3].sum()) - n5, len(b) - 1)
    b.loss_mask = None  # without a mask as before: every response token of weight > 0
    assert b.loss_counts() == (sum(int((w > 0).sum()) for w in b.loss_weights), len(b))
    b.loss_weights = None
    assert b.loss_counts() == (sum(b.response_lens), len(b))


def test_the_mask_travels_with_pickle_select_and_the_filler():
    b = _batch()
    c = pickle.loads(pickle.dumps(b, protocol=5))
    assert all(x.dtype == torch.bool and torch.equal(x, y) for x, y in zip(c.loss_mask, b.loss_mask, strict=True))
    assert [m.tolist() for m in b.select([6, 1]).loss_mask] == [b.loss_mask[6].tolist(), b.loss_mask[1].tolist()]
    assert pickle.loads(pickle.dumps(_batch().select([]))).loss_mask == []
    one = b.select([0])
    filled, _, shard, filler = rank_share(one, dp_size=2, dp_rank=1)
    assert filler and shard == [1]
    assert filled.loss_mask[1].tolist() == [False] and filled.loss_weights[1].tolist() == [0]
    one.loss_mask = None
    assert rank_share(one, dp_size=2, dp_rank=1)[0].loss_mask is None  # no mask: none appears


@pytest.mark.parametrize("spec", [CorrectionSpec("tis", level="sequence", threshold=1.5),
                                  CorrectionSpec("mis", threshold=1.3), CorrectionSpec("geometric", threshold=1.1)],
                         ids=["tis-seq", "mis", "geometric"])
def test_three_policy_batch_corrects_policy_tokens_only(spec):
    b = _batch()
    g = torch.Generator().manual_seed(3)
    prox = [x + 0.3 * torch.randn(x.shape, generator=g) for x in b.behav_log_probs]
    out, m = three_policy_batch(b, prox, spec)
    p = _perturbed(b)
    env_prox = [torch.where(mk, x, x - 40) for mk, x in zip(b.loss_mask, prox)]
    p_out, p_m = three_policy_batch(p, env_prox, spec)
    assert m == p_m and m["rollout_corr/count_tokens"] == _policy_tokens(b)
    for w, pw, mk in zip(out.loss_weights, p_out.loss_weights, b.loss_mask):
        assert torch.equal(w[mk], pw[mk]) and bool((w[~mk] == 1).all())
    assert out.loss_mask is b.loss_mask
    assert 0 < out.loss_counts()[0] <= _policy_tokens(b)


@pytest.mark.parametrize("rule", ["remove", "cap"])
def test_micro_batch_inputs_and_the_m2po_mask_leave_environment_tokens_out(rule):
    """behav_and_advantages' mask is loss mask & weight > 0; the mini-batch M2PO mask over several planned
    micro-batches keeps the same policy tokens and reports the same M2 whatever the environment tokens hold."""
    b = _batch(n=10)
    g = torch.Generator().manual_seed(9)
    b.loss_weights = [(torch.rand(len(m), generator=g) > 0.2).float() * 1.5 for m in b.loss_mask]
    mbs = plan_microbatches(b, list(range(len(b))), 40)
    assert len(mbs) > 2
    cur = {id(mb): torch.cat([b.behav_log_probs[i] for i in mb.seq_index]) + 0.5 * torch.randn(
        sum(mb.response_lens), generator=g) for mb in mbs}
    for mb in mbs:
        x = behav_and_advantages(b, mb, "cpu")
        pol = torch.cat([b.loss_mask[i] for i in mb.seq_index])
        assert torch.equal(x.policy, pol) and torch.equal(x.mask, pol & (x.weights > 0))
    keep, stats = m2po_keep_masks(b, mbs, cur, tau=0.04, rule=rule, dp_group=None)
    p = _perturbed(b)
    p_cur = {k: torch.where(behav_and_advantages(b, mb, "cpu").policy, v, v + 30)
             for mb, (k, v) in zip(mbs, cur.items())}
    p_keep, p_stats = m2po_keep_masks(p, mbs, p_cur, tau=0.04, rule=rule, dp_group=None)
    assert stats == p_stats and stats["m2po_global/num_dropped"] > 0
    for mb in mbs:
        mask = behav_and_advantages(b, mb, "cpu").mask
        assert torch.equal(keep[id(mb)], p_keep[id(mb)]) and not keep[id(mb)][~mask].any()
    b.loss_mask = b.loss_weights = None  # neither: every token counts, as before the field existed
    x = behav_and_advantages(b, mbs[0], "cpu")
    assert x.policy is None and x.weights is None and bool(x.mask.all())


def test_routing_replay_log_prob_mismatch_is_over_policy_tokens():
    from m2po_megatron.actor.routing_replay import _mean_abs_diff

    b = _batch()
    g = torch.Generator().manual_seed(4)
    lp = [x + 0.1 * torch.randn(x.shape, generator=g) for x in b.behav_log_probs]
    ref = torch.cat([(x - y)[m] for x, y, m in zip(lp, b.behav_log_probs, b.loss_mask)]).abs().mean()
    got = _mean_abs_diff(lp, _perturbed(b).behav_log_probs, b.loss_mask)
    assert got == pytest.approx(float(ref), rel=1e-6)
    assert _mean_abs_diff(lp, b.behav_log_probs) != pytest.approx(got, rel=1e-3)  # without the mask: every token


# ---- the real actor (one gloo rank on CPU) -------------------------------------------------------------------

SETTINGS = {  # (actor options, mini-batches): the batch-level M2PO mask; GSPO's sequence ratio in a three-policy
    # step with sequence-level masking (the correction's weights, ratio_parts) over two updates
    "m2po-global": (dict(loss_name="m2po", m2po_tau=0.02, m2po_scope="global"), 1),
    "gspo-mis-seq": (dict(loss_name="gspo", rollout_correction={"mode": "mis", "level": "sequence",
                                                                "threshold": 2.0}), 2),
}


def mask_worker():
    """Per setting: the metrics and weights after train_step on the batch and on its perturbed copy, and (at
    the starting weights) the entropy of every response token."""
    from actor_workers import hf_log_probs, make_hf_model, tiny_config

    from m2po_megatron.actor.actor import MegatronActor

    cfg = tiny_config("qwen2_untied")
    hf = make_hf_model(cfg)
    batch = _batch(vocab=cfg["vocab_size"])
    g = torch.Generator().manual_seed(2)  # behaviour = the model's own log-probs + noise, as a stale engine's
    batch.behav_log_probs = [x + 0.3 * torch.randn(x.shape, generator=g) for x in hf_log_probs(hf, batch)[0]]
    out = {}
    for name, (kw, nmb) in SETTINGS.items():
        runs = []
        for b in (batch, _perturbed(batch)):
            actor = MegatronActor(hf_config=cfg, load_from=hf, micro_batch_tokens=40, optimizer="sgd", lr=0.1,
                                  weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=False, **kw)
            _, ent = actor.compute_log_probs(b)
            m = actor.train_step(b, num_minibatches=nmb)
            m = {k: v for k, v in m.items() if not k.startswith("time/") and k != "per_update"}
            w = {k: v.clone() for k, v in actor.model_chunks()[0].state_dict().items() if isinstance(v, torch.Tensor)}
            runs.append((m, w, ent))
            actor.close()
        out[name] = runs
    return out, batch


@pytest.mark.timeout(300)
def test_train_step_ignores_what_environment_tokens_hold():
    from m2po_megatron.actor.launch import run_multiprocess

    out, batch = run_multiprocess(mask_worker, 1, timeout=280)[0]
    n_policy = _policy_tokens(batch)
    for name, ((m, w, ent), (pm, pw, _)) in out.items():
        assert m.keys() == pm.keys(), name
        for k, v in m.items():
            assert v == pm[k] or v == pytest.approx(pm[k], rel=1e-6, abs=1e-9), (name, k, v, pm[k])
        assert max(float((w[k] - pw[k]).abs().max()) for k in w if w[k].is_floating_point()) <= 1e-6, name
        assert m["num_updates"] == SETTINGS[name][1], name
        assert m["count/tokens"] == m["num_tokens"] <= n_policy, name  # no environment token in any count
    m, _, ent = out["m2po-global"][0]
    assert m["num_tokens"] == n_policy and m["num_seqs"] == len(batch)
    assert m["m2po_global/num_dropped"] > 0
    # one update at the starting weights: the entropy is the mean over the policy tokens alone
    ref = torch.cat([e[mk] for e, mk in zip(ent, batch.loss_mask)]).double().mean()
    assert m["entropy"] == pytest.approx(float(ref), rel=1e-5)
    assert m["entropy"] != pytest.approx(float(torch.cat(ent).double().mean()), rel=1e-5)
    m = out["gspo-mis-seq"][0][0]
    assert m["rollout_corr/count_tokens"] == m["ratio_parts/count_tokens"] == n_policy  # dropped ones included
    assert 0 < m["rollout_corr/masked_frac"] < 1 and 0 < m["num_tokens"] < n_policy  # the band dropped some


def sync_worker():
    """Host-sync counts (tests/actor/sync_workers.SyncCounter) of one train_step on a batch with environment
    tokens packed into 2 and into 6 micro-batches (M2PO's batch-level mask in a three-policy step)."""
    from actor_workers import tiny_config
    from sync_workers import SyncCounter

    from m2po_megatron.actor.actor import MegatronActor

    cfg = tiny_config("qwen2_untied")
    batch = _batch(n=12, min_len=16, max_len=16, vocab=cfg["vocab_size"])
    out = []
    for n_mb in (2, 6):
        actor = MegatronActor(hf_config=cfg, micro_batch_tokens=16 * 12 // n_mb, lr=1e-4, loss_name="m2po",
                              m2po_scope="global", rollout_correction={"mode": "tis", "threshold": 2.0})
        actor.train_step(batch)  # warm-up: lazy state is built once
        with SyncCounter() as c:
            m = actor.train_step(batch)
        out.append((dict(c.counts), m["num_microbatches"]))
        actor.close()
    return out


@pytest.mark.timeout(300)
def test_the_mask_adds_no_host_sync_per_micro_batch():
    from m2po_megatron.actor.launch import run_multiprocess

    (two, n2), (six, n6) = run_multiprocess(sync_worker, 1, timeout=280)[0]
    assert (n2, n6) == (2, 6)
    assert two == six and two.get("item", 0) > 0
