"""rollout_correction against verl's and slime's own functions, run literally (tests/algo/_verl_rollout_corr.py,
tests/algo/_slime_tis.py: verbatim copies, sources in their headers and docs/SOURCES.md).

Inputs are random float32 log-probs with log-ratios at three scales, extreme tokens (|log w| up to 30, past
the exp(+-20) safety bound), masked tokens and all-masked sequences. Both sides compute d = p - b with the
same float32 subtraction; the only tolerated disagreement is a token whose log-weight lies within 1e-5 of a
bound (log space here, ratio space or 1/x in the oracles: rounding may fall either way), which such inputs
almost never produce. Each known difference of definition has its own test, asserting what each side does."""

import math
from types import SimpleNamespace

import pytest
import torch

import _slime_tis as slime
import _verl_rollout_corr as verl
from m2po_megatron.algo.rollout_correction import CorrectionSpec, read_stats, rollout_correction

SEEDS = range(12)


def batch(seed, extreme=True):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 7, (1,), generator=g))
    T = int(torch.randint(1, 13, (1,), generator=g))
    scale = (0.01, 0.3, 2.0)[seed % 3]
    b = -5 * torch.rand(B, T, generator=g)
    d = scale * torch.randn(B, T, generator=g)
    if extreme:
        wild = torch.rand(B, T, generator=g) < 0.1
        d = torch.where(wild, 30 * (2 * torch.rand(B, T, generator=g) - 1), d)
    p = b + d
    mask = torch.rand(B, T, generator=g) < 0.8
    if B > 1:
        mask[int(torch.randint(0, B, (1,), generator=g))] = False  # an all-masked sequence
    if not mask.any():
        mask[0, 0] = True  # verl raises on an empty batch
    return p, b, mask


def level_log_weight(p, b, mask, level):
    d = torch.where(mask, p - b, torch.zeros_like(p))
    if level == "token":
        lw = d
    else:
        s = d.sum(-1, keepdim=True)
        if level == "geometric":
            s = s / mask.sum(-1, keepdim=True).clamp(min=1)
        lw = s.expand_as(d)
    return lw.clamp(-20, 20)


def far_from(lw, *bounds):
    """Tokens whose log-weight is not within 1e-5 of any bound (in log space)."""
    ok = torch.ones_like(lw, dtype=torch.bool)
    for x in bounds:
        if x > 0:
            ok &= (lw - math.log(x)).abs() > 1e-5
    return ok


def rows(x, mask):
    return [x[i] for i in range(x.shape[0])], [mask[i].float() for i in range(x.shape[0])]


def slime_mis(p, b, mask, level, mode, lo, hi):
    args = SimpleNamespace(use_tis=True, tis_level=level, tis_mode=mode, tis_lower_bound=lo, tis_upper_bound=hi,
                           use_rs=False, rs_level=level, rs_lower_bound=None, rs_upper_bound=None,
                           rs_veto_threshold=None, tis_batch_normalize=False)
    train, masks = rows(p, mask)
    weights, new_masks, metrics = slime.compute_mis_weights(args, train_log_probs=train,
                                                            rollout_log_probs=rows(b, mask)[0], loss_masks=masks)
    return torch.stack(weights), torch.stack(new_masks) > 0, metrics


def slime_flat(fn, p, b, mask, lo, hi):
    """vanilla_tis_function / icepop_function: the per-token factor they put on pg_loss (ones)."""
    train, masks = rows(p, mask)
    out, _, metrics = fn(SimpleNamespace(tis_clip=hi, tis_clip_low=lo), pg_loss=torch.ones(p.numel()),
                         train_log_probs=train, rollout_log_probs=rows(b, mask)[0], loss_masks=masks)
    return out.reshape(p.shape), metrics


def ours(p, b, mask, **spec):
    c = rollout_correction(p, b, mask, CorrectionSpec(**spec))
    (m,) = read_stats([c.stats])
    return c.weights, c.keep, m


def verl_rs_spec(lo, hi):
    """verl's k1 "lower_upper" bounds exp(-d) = b/p: our band [lo, hi] is its "1/hi_1/lo"."""
    return f"{1 / hi!r}_{1 / lo!r}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_matches_verl_and_slime(seed, level):
    p, b, mask = batch(seed)
    C = 2.0
    w, keep, m = ours(p, b, mask, mode="tis", level=level, threshold=C)
    assert torch.equal(keep, mask)
    ok = mask & far_from(level_log_weight(p, b, mask, level), C)
    vw, vm = verl.compute_rollout_correction_weights(p - b, mask.float(), rollout_is=level, rollout_is_threshold=C)
    torch.testing.assert_close(w[ok], vw[ok], rtol=1e-5, atol=0)
    sw, _, _ = slime_mis(p, b, mask, level, "truncate", None, C)
    torch.testing.assert_close(w[ok], sw[ok], rtol=1e-5, atol=0)
    if level == "token":
        # slime's default --use-tis function: no exp(+-20) bound, so it differs below e^-20 by < 2.1e-9
        fw, fm = slime_flat(slime.vanilla_tis_function, p, b, mask, 0.0, C)
        torch.testing.assert_close(w[ok], fw[ok], rtol=1e-5, atol=2.1e-9)
        assert m["rollout_corr/truncated_frac"] == pytest.approx(vm["rollout_is_ratio_fraction_high"], abs=1e-6)
        n_trunc = int(((fm["tis_clipfrac"].reshape(p.shape) > 0) & mask).sum())
        assert m["rollout_corr/truncated_frac"] * mask.sum().item() == pytest.approx(n_trunc)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("band", [(None, 2.0), (0.8, 1.5)])
def test_mis_matches_slime(seed, level, band):
    p, b, mask = batch(seed)
    lo, hi = band
    w, keep, m = ours(p, b, mask, mode="mis", level=level, threshold=hi, threshold_lower=lo)
    lo = 1 / hi if lo is None else lo
    ok = mask & far_from(level_log_weight(p, b, mask, level), lo, hi)
    sw, skeep, _ = slime_mis(p, b, mask, level, "mask", lo, hi)
    assert torch.equal(keep[ok], skeep[ok])
    torch.testing.assert_close(w[ok & keep], sw[ok & keep], rtol=1e-5, atol=0)
    assert (w[mask & ~keep] == 0).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("band", [(None, 2.0), (0.8, 1.5)])
def test_mis_matches_verl_rejection_with_is_weights(seed, level, band):
    # verl's seq_sum_k1 sums token log-ratios each clamped to +-20, this module clamps the sum
    # (test_sequence_clamp_differs_from_verl): compared here without the extreme tokens.
    p, b, mask = batch(seed, extreme=(level == "token"))
    lo, hi = band
    w, keep, m = ours(p, b, mask, mode="mis", level=level, threshold=hi, threshold_lower=lo)
    lo = 1 / hi if lo is None else lo
    ok = mask & far_from(level_log_weight(p, b, mask, level), lo, hi)
    option = "token_k1" if level == "token" else "seq_sum_k1"
    vmask, vm = verl.compute_rollout_rejection_mask(p - b, mask.float(), option, verl_rs_spec(lo, hi))
    assert torch.equal(keep[ok], (vmask > 0)[ok])
    vw, _ = verl.compute_rollout_correction_weights(p - b, mask.float(), rollout_is=level, rollout_is_threshold=hi)
    torch.testing.assert_close(w[ok & keep], vw[ok & keep], rtol=1e-5, atol=0)
    if ok[mask].all():
        assert m["rollout_corr/masked_frac"] == pytest.approx(vm["rollout_rs_masked_fraction"], abs=1e-6)
        # verl divides by every row, empty ones included; this module by the sequences with a valid token
        n_masked_seqs = m["rollout_corr/seq_masked_frac"] * m["rollout_corr/count_seqs"]
        assert n_masked_seqs == pytest.approx(vm["rollout_rs_seq_masked_fraction"] * p.shape[0], abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("band", [(0.5, 5.0), (0.0, 2.0), (0.9, 1.1)])
def test_icepop_matches_slime_and_verl(seed, band):
    p, b, mask = batch(seed)
    lo, hi = band
    w, keep, _ = ours(p, b, mask, mode="icepop", threshold=hi, threshold_lower=lo)
    ok = mask & far_from(level_log_weight(p, b, mask, "token"), lo, hi)
    sw, _ = slime_flat(slime.icepop_function, p, b, mask, lo, hi)
    # both 0 outside the band and w inside; slime's icepop has no exp(+-20) bound (lo = 0 keeps w < e^-20)
    torch.testing.assert_close(w[ok], sw[ok], rtol=1e-5, atol=2.1e-9)
    if lo > 0:
        vmask, _ = verl.compute_rollout_rejection_mask(p - b, mask.float(), "token_k1", verl_rs_spec(lo, hi))
        assert torch.equal(keep[ok], (vmask > 0)[ok])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("action", ["mask", "truncate"])
def test_geometric_matches_slime(seed, action):
    p, b, mask = batch(seed)
    lo, hi = 0.999, 1.001  # slime's documented band for the geometric level
    w, keep, _ = ours(p, b, mask, mode="geometric", threshold=hi, threshold_lower=lo if action == "mask" else None,
                      geometric_action=action)  # truncation has no lower bound (slime's ignores it)
    ok = mask & far_from(level_log_weight(p, b, mask, "geometric"), lo, hi)
    sw, skeep, _ = slime_mis(p, b, mask, "geometric", action, lo, hi)
    assert torch.equal(keep[ok], skeep[ok])
    torch.testing.assert_close(w[ok & keep], sw[ok & keep], rtol=1e-5, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_geometric_mask_matches_verl_seq_mean_k1(seed):
    p, b, mask = batch(seed, extreme=False)
    lo, hi = 1 / 1.05, 1.05
    _, keep, _ = ours(p, b, mask, mode="geometric", threshold=hi)
    ok = mask & far_from(level_log_weight(p, b, mask, "geometric"), lo, hi)
    vmask, _ = verl.compute_rollout_rejection_mask(p - b, mask.float(), "seq_mean_k1", str(hi))
    assert torch.equal(keep[ok], (vmask > 0)[ok])


@pytest.mark.parametrize("seed", SEEDS)
def test_mismatch_metrics_match_verl_and_slime(seed):
    p, b, mask = batch(seed)
    _, _, m = ours(p, b, mask, mode="bypass")
    vm = verl.compute_offpolicy_metrics(old_log_prob=p, rollout_log_prob=b, response_mask=mask.float())
    # float32 sums in verl against float64 here
    assert m["rollout_corr/kl_k1"] == pytest.approx(vm["kl"], rel=1e-4, abs=1e-5)
    assert m["rollout_corr/kl_k3"] == pytest.approx(vm["k3_kl"], rel=1e-4, abs=1e-5)
    metrics = {}
    for pi, bi, mi in zip(p, b, mask):
        slime.add_ppl_metrics(pi, bi, mi, metrics)
    flat_mask = mask.reshape(-1)
    for ours_key, key in (("kl_k1", "kl"), ("kl_k3", "k3_kl")):
        per_token = torch.cat(metrics[key]).double()[flat_mask]
        assert m[f"rollout_corr/{ours_key}"] == pytest.approx(per_token.mean().item(), rel=1e-5, abs=1e-6)
    ratio = torch.exp((p - b).double())[mask]
    expect = torch.quantile(ratio, torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64))
    got = [m[f"rollout_corr/ratio_{k}"] for k in ("p1", "p50", "p99")]
    assert got == pytest.approx(expect.tolist(), rel=1e-12)
    assert m["rollout_corr/ratio_min"] == ratio.min().item()
    assert m["rollout_corr/ratio_max"] == ratio.max().item()


def test_sequence_clamp_differs_from_verl():
    # verl's seq_sum_k1 clamps each token's log-ratio to +-20 before the sum; this module and slime clamp the
    # sum. They differ only when a token passes +-20: log-ratios +25 and -20.5 sum to 4.5 (w = 90, outside
    # [1/2, 2]: dropped here and in slime), while verl sums 20 - 20 = 0 (w = 1: kept).
    b = torch.zeros(1, 2)
    p = torch.tensor([[25.0, -20.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, keep, _ = ours(p, b, mask, mode="mis", level="sequence", threshold=2.0)
    _, skeep, _ = slime_mis(p, b, mask, "sequence", "mask", 0.5, 2.0)
    vmask, _ = verl.compute_rollout_rejection_mask(p - b, mask.float(), "seq_sum_k1", "2.0")
    assert keep.tolist() == skeep.tolist() == [[False, False]]
    assert vmask.tolist() == [[1.0, 1.0]]


def test_verl_k1_band_is_inverted():
    # verl's token_k1 "0.8_1.5" keeps b/p in [0.8, 1.5], i.e. p/b in [0.667, 1.25]: a token with p/b = 1.4
    # is kept by this module's band [0.8, 1.5] and by slime's icepop, dropped by verl's spec "0.8_1.5", and
    # kept by verl's "1/1.5_1/0.8", which is what the oracle tests pass.
    b = torch.zeros(1, 1)
    p = torch.full((1, 1), math.log(1.4))
    mask = torch.ones(1, 1, dtype=torch.bool)
    _, keep, _ = ours(p, b, mask, mode="icepop", threshold=1.5, threshold_lower=0.8)
    sw, _ = slime_flat(slime.icepop_function, p, b, mask, 0.8, 1.5)
    literal, _ = verl.compute_rollout_rejection_mask(p - b, mask.float(), "token_k1", "0.8_1.5")
    mapped, _ = verl.compute_rollout_rejection_mask(p - b, mask.float(), "token_k1", verl_rs_spec(0.8, 1.5))
    assert keep.item() and sw.item() > 0
    assert literal.item() == 0.0 and mapped.item() == 1.0
