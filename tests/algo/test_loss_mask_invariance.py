"""Masked-token invariance of every loss, mask, correction and metric of algo/ (multi-turn rollouts).

A response interleaves the policy's tokens (loss mask 1) with the environment's (tool output, template; loss
mask 0). Whatever a masked token holds (its current and behaviour log-probs, its advantage, hence its ratio;
here large random values) must change no loss, no gradient on the policy's tokens, no M2 value, no keep flag
of a policy token and no logged metric: bit for bit, as the masked positions are zeroed by `where` before any
arithmetic. Stronger still, the masked tokens behave as if they were absent: the same call on the policy
tokens alone (the responses compacted) gives the same results, to float rounding (sums group differently).
"""
import itertools
import math

import pytest
import torch

from m2po_megatron.algo import (
    AGG_MODES,
    LOSSES,
    RULES,
    global_m2po_keep_masks,
    m2po_keep_mask,
    policy_loss,
    reduce_metrics,
)
from m2po_megatron.algo import rollout_correction as rc
from m2po_megatron.algo.mask import M2_TOKENS

SEEDS = (0, 1, 2)
TAU = 0.04
DUAL_CLIPS = (None, 3.0)


def _spec_list() -> list[rc.CorrectionSpec]:
    """Every mode, level, geometric action and rejection criterion, the veto and batch normalisation."""
    specs = [rc.CorrectionSpec()]
    for mode, level in itertools.product(("tis", "mis", "clip"), rc.LEVELS):
        specs.append(rc.CorrectionSpec(mode, level=level, threshold=1.5))
    specs.append(rc.CorrectionSpec("icepop", threshold=1.5, threshold_lower=0.5))
    specs += [rc.CorrectionSpec("geometric", threshold=1.2, geometric_action=a) for a in rc.GEOMETRIC_ACTIONS]
    specs += [rc.CorrectionSpec("tis", threshold=1.5, rejection=r, rejection_threshold=0.05) for r in rc.REJECTIONS]
    specs.append(rc.CorrectionSpec("mis", level="sequence", threshold=3.0, veto_threshold=0.3))
    specs += [rc.CorrectionSpec("tis", level=lv, threshold=1.5, batch_normalize=True) for lv in rc.LEVELS]
    return specs


SPECS = _spec_list()
# a few of them under the losses (every one is checked on its own in test_rollout_correction_*)
LOSS_SPECS = (None, SPECS[1], SPECS[4], SPECS[8], SPECS[-1])


def _inputs(seed: int, n_seqs: int = 7) -> dict:
    """Flat per-token inputs of n_seqs responses with environment blocks inside them; every response keeps
    at least one policy token (TrainBatch.validate's rule)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 14, (n_seqs,), generator=g)
    seq = torch.repeat_interleave(torch.arange(n_seqs), lens)
    n = int(lens.sum())
    policy = torch.rand(n, generator=g) < 0.6
    starts = torch.cumsum(lens, 0) - lens
    policy[starts] = True
    eng = -torch.rand(n, generator=g) * 3  # the engine's (behaviour) log-probs
    prox = eng + 0.4 * torch.randn(n, generator=g)  # the trainer's at the step's start
    lp = prox + 0.6 * torch.randn(n, generator=g) + 0.8 * torch.randn(n_seqs, generator=g)[seq]  # theta
    adv = torch.randn(n_seqs, generator=g)[seq] if seed % 2 else torch.randn(n, generator=g)  # per seq / token
    return dict(seq=seq, S=n_seqs, policy=policy, eng=eng, prox=prox, lp=lp, adv=adv)


def _perturbed(x: dict, seed: int) -> dict:
    """x with every masked token's log-probs and advantage replaced by large random values."""
    g = torch.Generator().manual_seed(1000 + seed)
    env = ~x["policy"]
    out = dict(x)
    for k, scale in (("eng", 40.0), ("prox", 40.0), ("lp", 40.0), ("adv", 1e3)):
        out[k] = torch.where(env, scale * torch.randn(x[k].shape, generator=g) - (scale if k != "adv" else 0), x[k])
    return out


def _compact(x: dict) -> dict:
    """The policy tokens alone (sequence ids stay dense: each sequence has one)."""
    keep = x["policy"]
    out = {k: (v[keep] if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    return out


def _same(a: dict, b: dict, where, exact: bool = True) -> None:
    assert a.keys() == b.keys(), where
    for k in a:
        x, y = float(a[k]), float(b[k])
        if math.isnan(x) or math.isnan(y):
            assert math.isnan(x) and math.isnan(y), (where, k, x, y)
        elif exact:
            assert x == y, (where, k, x, y)
        else:
            assert x == y or math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6), (where, k, x, y)


def _correction(x: dict, spec):
    """(weights, the loss mask = policy & weight > 0, metrics) as the actor builds them; None: bypass."""
    if spec is None:
        return None, x["policy"], {}
    c = rc.rollout_correction(x["prox"], x["eng"], x["policy"], spec, seq_ids=x["seq"], num_seq_ids=x["S"])
    return c.weights, x["policy"] & (c.weights > 0), rc.read_stats([c.stats])[0]


def _loss(name: str, x: dict, spec, **kw):
    """(loss, d loss / d lp, metrics incl. the correction's) with the correction's weights and mask."""
    weights, mask, corr = _correction(x, spec)
    lp = x["lp"].clone().requires_grad_(True)
    if kw.get("loss_agg_mode") == "seq-mean-token-sum-norm":
        kw = dict(kw, loss_scale_factor=64)  # Dr.GRPO's constant, required in that mode
    loss, m = policy_loss(name, lp, x["prox"], x["adv"], mask, seq_ids=x["seq"], num_seq_ids=x["S"],
                          weights=weights, **kw)
    loss.backward()
    return loss.item(), lp.grad, {**m, **corr}


def _variants(name: str):
    """The loss options of `name`: M2PO's rules and M2 token sets (mask inside the loss: micro-batch scope;
    the mini-batch scope is test_global_m2po_mask_*), each with and without the dual clip."""
    m2po = [dict(rule=r, m2_tokens=t, tau=TAU) for r in RULES for t in M2_TOKENS] if name == "m2po" else [{}]
    return [dict(kw, dual_clip=c) for kw in m2po for c in DUAL_CLIPS if c is None or name != "cispo"]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", LOSSES)
def test_losses_ignore_masked_tokens(name, agg):
    seen = dict.fromkeys(("m2po/masked_frac", "clip_frac", "dual_clip_frac", "rollout_corr/masked_frac"), 0.0)
    for seed, spec, kw in itertools.product(SEEDS, LOSS_SPECS, _variants(name)):
        where = (name, agg, seed, spec, kw)
        x = _inputs(seed)
        loss, grad, m = _loss(name, x, spec, loss_agg_mode=agg, **kw)
        p_loss, p_grad, p_m = _loss(name, _perturbed(x, seed), spec, loss_agg_mode=agg, **kw)
        assert p_loss == loss and torch.equal(p_grad, grad), where
        _same(m, p_m, where)
        assert not grad[~x["policy"]].any(), where  # no gradient reaches an environment token
        c_loss, c_grad, c_m = _loss(name, _compact(x), spec, loss_agg_mode=agg, **kw)
        assert c_loss == pytest.approx(loss, rel=1e-6, abs=1e-7), where
        torch.testing.assert_close(c_grad, grad[x["policy"]], rtol=1e-6, atol=1e-7, msg=str(where))
        _same(m, c_m, where, exact=False)
        assert m["count/tokens"] == float((x["policy"] & (_correction(x, spec)[1])).sum()), where
        for k in seen:
            seen[k] = max(seen[k], m.get(k, 0.0))
    # the test exercised what it claims: tokens dropped by M2PO, clipped, dual-clipped, rejected
    assert seen["rollout_corr/masked_frac"] > 0 and (seen["clip_frac"] > 0 or name in ("m2po", "grpo_notr"))
    assert seen["dual_clip_frac"] > 0 or name == "cispo"  # cispo's weight is capped: no dual clip
    assert seen["m2po/masked_frac"] > 0 or name != "m2po"


@pytest.mark.parametrize("name", LOSSES)
def test_the_perturbation_would_show_if_it_were_not_masked(name):
    """Control: the same perturbation on tokens the mask counts changes the loss and its metrics, so the
    invariance above is the mask's doing."""
    x = _inputs(0)
    everything = dict(x, policy=torch.ones_like(x["policy"]))
    loss, _, m = _loss(name, everything, None)
    p_loss, _, p_m = _loss(name, dict(_perturbed(x, 0), policy=everything["policy"]), None)
    assert p_loss != loss and p_m["ratio/max"] != m["ratio/max"]


@pytest.mark.parametrize("tokens", M2_TOKENS)
@pytest.mark.parametrize("scope", ("minibatch", "microbatch"))
@pytest.mark.parametrize("rule", RULES)
def test_global_m2po_mask_ignores_masked_tokens(rule, scope, tokens):
    """The M2PO mask over micro-batches (both scopes) and the m2po loss of each micro-batch with it and the
    global denominators, reduced as the actor reduces them: keep flags of policy tokens, M2 before/after,
    counts, loss, gradient and metrics unchanged by masked tokens, and as without them."""
    for seed in SEEDS:
        x = _inputs(seed, n_seqs=9)
        runs = [_global_step(v, rule, scope, tokens) for v in (x, _perturbed(x, seed), _compact(x))]
        (keep, res, loss, grad, m), (p_keep, p_res, p_loss, p_grad, p_m), (c_keep, c_res, c_loss, c_grad, c_m) = runs
        where = (rule, scope, tokens, seed)
        pol = x["policy"]
        assert torch.equal(keep[pol], p_keep[pol]) and torch.equal(keep[pol], c_keep), where
        assert not keep[~pol].any(), where  # an environment token is never "kept"
        for r in (p_res, c_res):
            assert (r.num_tokens, r.num_seqs, r.num_trust_region, r.num_dropped) == (
                res.num_tokens, res.num_seqs, res.num_trust_region, res.num_dropped), where
        assert (p_res.m2_before, p_res.m2_after) == (res.m2_before, res.m2_after), where
        assert c_res.m2_before == pytest.approx(res.m2_before, rel=1e-12)
        assert c_res.m2_after == pytest.approx(res.m2_after, rel=1e-12)
        assert res.num_tokens == int(pol.sum()) and res.num_seqs == x["S"] and res.num_dropped > 0, where
        assert p_loss == loss and torch.equal(p_grad, grad), where
        _same(m, p_m, where)
        assert c_loss == pytest.approx(loss, rel=1e-6, abs=1e-7), where
        torch.testing.assert_close(c_grad, grad[pol], rtol=1e-6, atol=1e-7)
        _same(m, c_m, where, exact=False)


def _global_step(x: dict, rule: str, scope: str, tokens: str):
    """Three micro-batches of whole sequences: the global keep masks, then each micro-batch's m2po loss."""
    cuts = [0, 3, 6, x["S"]]
    parts = [((x["seq"] >= a) & (x["seq"] < b)) for a, b in zip(cuts, cuts[1:])]
    lp = x["lp"].clone().requires_grad_(True)
    lr = [(lp.detach() - x["prox"])[p] for p in parts]
    res = global_m2po_keep_masks(lr, [x["adv"][p] for p in parts], [x["policy"][p] for p in parts], tau=TAU,
                                 rule=rule, scope=scope, tokens=tokens, seq_ids=[x["seq"][p] for p in parts])
    total, metrics = 0.0, []
    for p, keep, a, b in zip(parts, res.keep_masks, cuts, cuts[1:]):
        loss, m = policy_loss("m2po", lp[p], x["prox"][p], x["adv"][p], x["policy"][p], keep_mask=keep,
                              seq_ids=x["seq"][p] - a, num_seq_ids=b - a,
                              num_tokens=res.num_tokens, num_seqs=res.num_seqs, m2_tokens=tokens, dual_clip=3.0)
        loss.backward()
        total += loss.item()
        metrics.append(m)
    keep_all = torch.zeros_like(x["policy"])
    for p, keep in zip(parts, res.keep_masks):
        keep_all[p] = keep
    return keep_all, res, total, lp.grad, reduce_metrics(metrics)


@pytest.mark.parametrize("tokens", M2_TOKENS)
@pytest.mark.parametrize("rule", RULES)
def test_m2po_keep_mask_ignores_masked_tokens(rule, tokens):
    for seed in SEEDS:
        x = _inputs(seed)
        pol = x["policy"]
        keep = [m2po_keep_mask(v["lp"] - v["prox"], v["adv"], v["policy"], TAU, rule, tokens)
                for v in (x, _perturbed(x, seed), _compact(x))]
        assert torch.equal(keep[0], keep[1]) and torch.equal(keep[0][pol], keep[2]), (rule, tokens, seed)
        assert not keep[0][~pol].any() and not keep[0][pol].all()  # something was dropped


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-{s.level}-{s.geometric_action}-{s.rejection}-"
                                                          f"{s.veto_threshold}-{s.batch_normalize}")
def test_rollout_correction_ignores_masked_tokens(spec):
    """Weights and keep flags of policy tokens and every rollout_corr/* metric: unchanged by masked tokens
    (their proximal and behaviour log-probs) and as without them; a masked token's weight is 1 (neutral) and
    it is never kept, so policy & weight > 0 is the loss mask."""
    dropped = 0.0
    for seed in SEEDS:
        x = _inputs(seed)
        pol = x["policy"]
        outs = []
        for v in (x, _perturbed(x, seed), _compact(x)):
            c = rc.rollout_correction(v["prox"], v["eng"], v["policy"], spec, seq_ids=v["seq"], num_seq_ids=v["S"])
            outs.append((c.weights, c.keep, rc.read_stats([c.stats])[0]))
        (w, k, m), (p_w, p_k, p_m), (c_w, c_k, c_m) = outs
        assert torch.equal(w, p_w) and torch.equal(k, p_k), (spec, seed)
        _same(m, p_m, (spec, seed))
        assert torch.equal(k[pol], c_k) and not k[~pol].any() and bool((w[~pol] == 1).all()), (spec, seed)
        torch.testing.assert_close(w[pol], c_w, rtol=1e-6, atol=0)
        _same(m, c_m, (spec, seed), exact=False)
        assert m.get("rollout_corr/count_tokens", pol.sum()) == pol.sum()
        dropped = max(dropped, m.get("rollout_corr/masked_frac", 0.0))
    assert dropped > 0 or not (spec.masks or spec.rejection or spec.veto_threshold)  # the mode did drop


def test_ratio_parts_ignore_masked_tokens():
    for seed in SEEDS:
        x = _inputs(seed)
        rows = [rc.read_stats([rc.ratio_parts(v["lp"], v["prox"], v["eng"], v["policy"])])[0]
                for v in (x, _perturbed(x, seed), _compact(x))]
        _same(rows[0], rows[1], seed)
        _same(rows[0], rows[2], seed, exact=False)
        assert rows[0]["ratio_parts/count_tokens"] == float(x["policy"].sum())


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", LOSSES)
def test_kl_and_entropy_terms_ignore_masked_tokens(name, agg):
    """The reference KL and the entropy bonus on the policy tokens only: an environment token's reference
    log-prob and entropy change nothing, and the compacted batch gives the same loss and gradients."""
    def run(x, ref, ent):
        lp = x["lp"].clone().requires_grad_(True)
        e = ent.clone().requires_grad_(True)
        kw = dict(loss_scale_factor=64) if agg == "seq-mean-token-sum-norm" else {}
        loss, m = policy_loss(name, lp, x["prox"], x["adv"], x["policy"], seq_ids=x["seq"], num_seq_ids=x["S"],
                              loss_agg_mode=agg, ref_log_prob=ref, kl_coef=0.3, kl_type="low_var_kl", entropy=e,
                              entropy_coeff=0.05, **kw)
        loss.backward()
        return loss.item(), lp.grad, e.grad, m

    for seed in SEEDS:
        x = _inputs(seed)
        g = torch.Generator().manual_seed(7 + seed)
        ref = x["lp"] + 0.5 * torch.randn(x["lp"].shape, generator=g)
        ent = 3 * torch.rand(x["lp"].shape, generator=g)
        env = ~x["policy"]
        loss, grad, egrad, m = run(x, ref, ent)
        p = run(_perturbed(x, seed), torch.where(env, -50.0, ref), torch.where(env, 1e3, ent))
        assert p[0] == loss and torch.equal(p[1], grad) and torch.equal(p[2], egrad), (name, agg, seed)
        _same(m, p[3], (name, agg, seed))
        assert not grad[env].any() and not egrad[env].any() and egrad[x["policy"]].lt(0).all()
        keep = x["policy"]
        c = run(_compact(x), ref[keep], ent[keep])
        assert c[0] == pytest.approx(loss, rel=1e-6, abs=1e-7)
        torch.testing.assert_close(c[1], grad[keep], rtol=1e-6, atol=1e-7)
        assert m["kl_ref/k3"] > 0 and m["kl_loss"] > 0
        # control: the same perturbation on counted tokens shows
        assert run(x, ref + 0.1, ent)[0] != loss and run(x, ref, ent + 0.1)[0] != loss
