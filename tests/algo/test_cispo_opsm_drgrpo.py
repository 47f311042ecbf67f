"""CISPO, off-policy sequence masking (OPSM) and Dr.GRPO's seq-mean-token-sum-norm against verl's and slime's own
functions, run literally (tests/algo/_verl_cispo_agg.py, tests/algo/_slime_cispo_opsm.py: verbatim copies, sources
in their headers and docs/SOURCES.md), and every gradient against autograd of the formula written out here.

Inputs: random float64 padded batches with uneven lengths (an empty row, holes inside rows), log-ratios at three
scales plus extreme tokens (|log r| up to 30), per-sequence advantages of both signs and zeros. float64 keeps the
1e-6 comparisons about the definitions, not float32 rounding."""

from argparse import Namespace

import pytest
import torch

import _slime_cispo_opsm as slime
import _verl_cispo_agg as verl
from m2po_megatron.algo import global_m2po_keep_masks, policy_loss, reduce_metrics, seq_ids_from_cu_seqlens

SEEDS = range(6)
TOL = dict(rtol=1e-6, atol=1e-6)
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def batch(seed, extreme=True):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(2, 7, (1,), generator=g))
    T = int(torch.randint(3, 13, (1,), generator=g))
    scale = (0.01, 0.3, 1.5)[seed % 3]
    blp = -4 * torch.rand(B, T, generator=g, dtype=torch.float64)
    # a per-sequence drift as well, so that some sequences are far off-policy and some are not
    f64 = torch.float64
    d = scale * (torch.randn(B, T, generator=g, dtype=f64) + torch.randn(B, 1, generator=g, dtype=f64))
    if extreme:
        wild = torch.rand(B, T, generator=g) < 0.08
        d = torch.where(wild, 30 * (2 * torch.rand(B, T, generator=g, dtype=torch.float64) - 1), d)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[int(torch.randint(0, B, (1,), generator=g))] = 0  # an empty sequence
    mask = (torch.arange(T)[None] < lens[:, None]) & (torch.rand(B, T, generator=g) < 0.85)  # holes: loss mask
    if not mask.any():
        mask[0, 0] = True
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64)
    adv[int(torch.randint(0, B, (1,), generator=g))] = 0.0
    lp = (blp + d).requires_grad_(True)
    return lp, blp, adv, mask


def n_seqs(mask):
    return int((mask.sum(-1) > 0).sum())


def grad(loss, lp):
    (g,) = torch.autograd.grad(loss, lp, retain_graph=True)
    return g


def cispo_cfg(lo, hi, **info):
    return verl.ActorConfig(clip_ratio_low=lo, clip_ratio_high=hi, global_batch_info=info)


# ------------------------------------------------------------------ CISPO
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eps", [(1.0, 0.2), (0.2, 0.28), (10.0, 4.0)])
def test_cispo_matches_verl(seed, mode, eps):
    lp, blp, adv, mask = batch(seed)
    norm = {"loss_scale_factor": lp.shape[-1]} if mode == "seq-mean-token-sum-norm" else {}  # verl's default
    loss, m = policy_loss("cispo", lp, blp, adv, mask, loss_agg_mode=mode, eps_low=eps[0], eps_high=eps[1], **norm)
    vloss, vm = verl.compute_policy_loss_cispo(blp, lp, adv.expand_as(lp), mask, loss_agg_mode=mode,
                                               config=cispo_cfg(*eps))
    # verl's seq-mean-token-sum-norm sums the micro-batch's sequences; ours is their mean (docs/algo.md)
    k = n_seqs(mask) if mode == "seq-mean-token-sum-norm" else 1
    torch.testing.assert_close(loss * k, vloss, **TOL)
    torch.testing.assert_close(grad(loss, lp) * k, grad(vloss, lp), **TOL)
    # verl's pg_clipfrac: tokens with clip(r) != r (its exp(+-20) guard only differs past both bounds)
    assert m["clip_frac"] == pytest.approx(vm["actor/pg_clipfrac"], abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_matches_slime_and_the_written_formula(seed):
    lp, blp, adv, mask = batch(seed)
    lo, hi = 1.0, 4.0  # slime's advice for the canonical setting: --eps-clip 1.0 --eps-clip-high 4.0
    loss, m = policy_loss("cispo", lp, blp, adv, mask, eps_low=lo, eps_high=hi)
    A = adv.expand_as(lp)
    pg, clipfrac = slime.compute_cispo_loss.__wrapped__(blp - lp, lp, A, lo, hi)
    n = mask.sum()
    ref = torch.where(mask, pg, 0.0).sum() / n  # token-mean, slime's --calculate-per-token-loss
    torch.testing.assert_close(loss, ref, **TOL)
    torch.testing.assert_close(grad(loss, lp), grad(ref, lp), **TOL)
    assert m["clip_frac"] == pytest.approx(float(clipfrac[mask].mean()), abs=1e-6)
    # the formula: -sg(clip(r)) * A * log_prob; its gradient -clip(r) * A / n, on clipped tokens too
    w = torch.exp(lp.detach() - blp).clamp(1 - lo, 1 + hi)
    formula = torch.where(mask, -w * A * lp, 0.0).sum() / n
    g = grad(loss, lp)
    torch.testing.assert_close(g, grad(formula, lp), **TOL)
    torch.testing.assert_close(g, torch.where(mask, -w * A / n, 0.0), **TOL)


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_cispo_with_rollout_correction_weights_matches_verl(seed):
    lp, blp, adv, mask = batch(seed)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    loss, _ = policy_loss("cispo", lp, blp, adv, mask, weights=w)
    vloss, _ = verl.compute_policy_loss_cispo(blp, lp, adv.expand_as(lp), mask, config=cispo_cfg(1.0, 0.2),
                                              rollout_is_weights=w)
    torch.testing.assert_close(loss, vloss, **TOL)
    torch.testing.assert_close(grad(loss, lp), grad(vloss, lp), **TOL)


# ------------------------------------------------------------------ off-policy sequence masking
def slime_opsm(lp, blp, adv, mask, delta):
    """slime's per-token mask (1 keep, 0 drop) for padded rows: each row is one sample's response."""
    rows = range(lp.shape[0])
    keep, _ = slime.compute_opsm_mask(Namespace(opsm_delta=delta), [lp.detach()[i] for i in rows],
                                      [blp[i] for i in rows], [adv.expand_as(lp)[i] for i in rows],
                                      [mask[i].double() for i in rows])
    return keep.reshape(lp.shape)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("delta", [1e-4, 0.05])
@pytest.mark.parametrize("name", ["grpo_notr", "grpo", "cispo", "m2po"])
def test_opsm_matches_slime(seed, delta, name):
    lp, blp, adv, mask = batch(seed, extreme=False)
    kw = {"tau": 0.04} if name == "m2po" else {}
    loss, m = policy_loss(name, lp, blp, adv, mask, opsm_delta=delta, **kw)
    base, _ = policy_loss(name, lp, blp, adv, mask, **kw)
    keep = slime_opsm(lp, blp, adv, mask, delta)
    dropped = mask & (keep == 0)
    assert m["opsm/masked_frac"] * mask.sum().item() == pytest.approx(float(dropped.sum()))
    # slime multiplies the token losses by the mask and keeps the denominators: the dropped tokens' loss and
    # gradient are gone, every other token's are the loss without masking
    g, g0 = grad(loss, lp), grad(base, lp)
    torch.testing.assert_close(g, torch.where(dropped, 0.0, g0), **TOL)
    if name == "grpo_notr":  # the written formula with slime's mask: -A r * mask / n
        A = adv.expand_as(lp)
        formula = torch.where(mask, -A * torch.exp(lp - blp) * keep, 0.0).sum() / mask.sum()
        torch.testing.assert_close(loss, formula, **TOL)
        torch.testing.assert_close(g, grad(formula, lp), **TOL)


def test_opsm_drops_only_negative_advantages_of_off_policy_sequences():
    blp = torch.zeros(4, 3, dtype=torch.float64)
    lr = torch.tensor([[-0.5] * 3, [-0.5] * 3, [0.5] * 3, [-1e-5] * 3], dtype=torch.float64)  # seq_kl = -mean lr
    lp = (blp + lr).requires_grad_(True)
    adv = torch.tensor([[-1.0], [1.0], [-1.0], [-1.0]], dtype=torch.float64)
    mask = torch.ones(4, 3, dtype=torch.bool)
    loss, m = policy_loss("grpo_notr", lp, blp, adv, mask, opsm_delta=1e-4)
    g = grad(loss, lp)
    assert (g[0] == 0).all() and (g[1:] != 0).all()  # far off-policy and negative: only row 0 goes
    assert m["opsm/masked_frac"] == pytest.approx(0.25)


# ------------------------------------------------------------------ Dr.GRPO's aggregation
def ppo_clip_tokens(lp, blp, A, lo=0.2, hi=0.2):
    r = torch.exp(lp - blp)
    return torch.maximum(-A * r, -A * r.clamp(1 - lo, 1 + hi))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("factor", [None, 7, 2560])
def test_seq_mean_token_sum_norm_matches_verl_agg_loss(seed, factor):
    lp, blp, adv, mask = batch(seed, extreme=False)
    L = lp.shape[-1] if factor is None else factor  # verl's None: the padded length; ours must be given
    loss, _ = policy_loss("grpo", lp, blp, adv, mask, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=L)
    mat = ppo_clip_tokens(lp, blp, adv.expand_as(lp))
    vloss = verl.agg_loss(mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=factor)  # None: T, as ours
    k = n_seqs(mask)
    torch.testing.assert_close(loss * k, vloss, **TOL)
    torch.testing.assert_close(grad(loss, lp) * k, grad(vloss, lp), **TOL)
    # Dr.GRPO written out: (1/G) sum_i sum_t loss_it / L
    formula = torch.where(mask, mat, 0.0).sum(-1).sum() / (k * L)
    torch.testing.assert_close(loss, formula, **TOL)
    torch.testing.assert_close(grad(loss, lp), grad(formula, lp), **TOL)


# ------------------------------------------------------------------ composition
def micro_batches(lp, blp, adv, mask, splits):
    """Row ranges of one mini-batch: micro-batches of two simulated data-parallel ranks."""
    return [(lp[a:b], blp[a:b], adv[a:b], mask[a:b]) for a, b in splits]


@pytest.mark.parametrize("seed", SEEDS[:4])
@pytest.mark.parametrize("name", ["m2po", "cispo", "grpo"])
def test_split_over_micro_batches_and_ranks_equals_the_full_batch(seed, name):
    """Each micro-batch of each rank with the mini-batch's denominators (and M2PO's mini-batch-wide mask): the
    summed losses and gradients, which is what the DP all-reduce of Megatron adds up, are the full batch's."""
    lp, blp, adv, mask = batch(seed)
    B = lp.shape[0]
    splits = [(0, 1), (1, B // 2 + 1), (B // 2 + 1, B)]  # rank 0: two micro-batches, rank 1: one
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    kw = dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16, opsm_delta=1e-3)
    full_kw = dict(kw, weights=w)
    if name == "m2po":
        res = global_m2po_keep_masks(lp.detach() - blp, adv.expand_as(lp), mask, tau=0.04)
        full_kw["keep_mask"] = res.keep_masks[0]
    full, fm = policy_loss(name, lp, blp, adv, mask, **full_kw)
    parts = micro_batches(lp, blp, adv, mask, splits)
    num_tokens, num_seqs = int(mask.sum()), n_seqs(mask)
    if name == "m2po":
        res = global_m2po_keep_masks([p[0].detach() - p[1] for p in parts], [p[2].expand_as(p[0]) for p in parts],
                                     [p[3] for p in parts], tau=0.04)
    total, ms = 0.0, []
    for i, ((a, b), (p, q, A, mk)) in enumerate(zip(splits, parts)):
        extra = {"keep_mask": res.keep_masks[i]} if name == "m2po" else {}
        loss, m = policy_loss(name, p, q, A, mk, num_tokens=num_tokens, num_seqs=num_seqs, weights=w[a:b], **kw,
                              **extra)
        total = total + loss
        ms.append(m)
    torch.testing.assert_close(total, full, **TOL)
    torch.testing.assert_close(grad(total, lp), grad(full, lp), **TOL)
    red = reduce_metrics(ms)
    for key in ("loss", "opsm/masked_frac", "clip_frac", "count/tokens", "count/seqs"):
        assert red[key] == pytest.approx(fm[key], abs=1e-9), key


@pytest.mark.parametrize("name", ["cispo", "m2po", "grpo_notr"])
def test_masked_tokens_change_nothing(name):
    """The per-token loss mask: whatever a masked token holds, the loss, the sequence divergence of OPSM and the
    gradient of every other token stay the same, and the masked token gets no gradient."""
    lp, blp, adv, mask = batch(3)
    kw = dict(opsm_delta=1e-3, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=30)
    loss, m = policy_loss(name, lp, blp, adv, mask, **kw)
    g = grad(loss, lp)
    garbage = (lp.detach() + torch.where(mask, 0.0, 50.0)).requires_grad_(True)
    loss2, m2 = policy_loss(name, garbage, blp - torch.where(mask, 0.0, 9.0), adv, mask, **kw)
    g2 = grad(loss2, garbage)
    torch.testing.assert_close(loss2, loss, **TOL)
    torch.testing.assert_close(g2, g, **TOL)
    assert (g2[~mask] == 0).all()
    assert m2["opsm/masked_frac"] == m["opsm/masked_frac"]


@pytest.mark.parametrize("name", ["cispo", "m2po"])
def test_flat_layout_equals_padded(name):
    lp, blp, adv, mask = batch(5)
    kw = dict(opsm_delta=1e-3, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=12)
    loss, m = policy_loss(name, lp, blp, adv, mask, **kw)
    lens = torch.full((lp.shape[0],), lp.shape[1])
    seq = seq_ids_from_cu_seqlens(torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]))
    flat, fm = policy_loss(name, lp.reshape(-1), blp.reshape(-1), adv.expand_as(lp).reshape(-1), mask.reshape(-1),
                           seq_ids=seq, **kw)
    torch.testing.assert_close(flat, loss, **TOL)
    torch.testing.assert_close(grad(flat, lp), grad(loss, lp), **TOL)
    assert fm["opsm/masked_frac"] == m["opsm/masked_frac"]


# ------------------------------------------------------------------ errors and the recipe
@pytest.mark.parametrize("kw, msg", [
    (dict(name="cispo", dual_clip=3.0), "dual_clip does not apply to cispo"),
    (dict(name="grpo", loss_scale_factor=10), "applies to loss_agg_mode='seq-mean-token-sum-norm' only"),
    (dict(name="grpo", loss_agg_mode="seq-mean-token-sum-norm"), "needs loss_scale_factor"),
    (dict(name="grpo", loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=0), "finite constant > 0"),
    (dict(name="grpo", opsm_delta=float("nan")), "opsm_delta must be a finite"),
    (dict(name="cispo", eps_high=-0.1), "eps_high >= 0"),
    (dict(name="grpo", flat=True, opsm_delta=1e-4), "need seq_ids"),
])
def test_bad_options_name_the_fix(kw, msg):
    lp, blp, adv, mask = batch(0)
    name, flat = kw.pop("name"), kw.pop("flat", False)
    A = adv.expand_as(lp)
    if flat:
        lp, blp, A, mask = lp.reshape(-1), blp.reshape(-1), A.reshape(-1), mask.reshape(-1)
    with pytest.raises(ValueError, match=msg):
        policy_loss(name, lp, blp, A, mask, **kw)


def test_recipe_options_reach_the_loss_and_bad_ones_are_refused():
    from m2po_megatron.actor.options import actor_kwargs
    from m2po_megatron.config.loading import load_config
    from m2po_megatron.config.schema import ConfigError

    cfg = load_config(None, ["algo.name=cispo", "algo.use_opsm=true", "algo.loss_agg_mode=seq-mean-token-sum-norm",
                             "rollout.max_new_tokens=512"])
    kw = actor_kwargs(cfg)["loss_kwargs"]
    assert kw == {"loss_agg_mode": "seq-mean-token-sum-norm", "eps_low": 1.0, "eps_high": 0.2, "opsm_delta": 1e-4,
                  "loss_scale_factor": 512}
    lp, blp, adv, mask = batch(1)  # the keywords as the actor passes them
    assert torch.isfinite(policy_loss("cispo", lp, blp, adv, mask, **kw)[0])
    for bad, field in ((["algo.name=cispo", "algo.dual_clip_c=3.0"], "algo.dual_clip_c"),
                       (["algo.loss_scale_factor=100"], "algo.loss_scale_factor"),
                       (["algo.cispo.eps_clip_low=-1"], "algo.cispo.eps_clip_low")):
        with pytest.raises(ConfigError, match=field):
            load_config(None, bad)
