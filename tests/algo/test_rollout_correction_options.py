"""The options verl's and slime's users reach for (issue 35), each against the anchor's own function run
literally (the vendored copies of test_rollout_correction_oracles.py): slime's clip mode and veto, verl's
and slime's batch-normalised weights, verl's k2/k3 rejection criteria at token and sequence level, verl's
effective sample size and chi^2 divergences."""

import math
from types import SimpleNamespace

import pytest
import torch

import _slime_tis as slime
import _verl_rollout_corr as verl
from test_rollout_correction_oracles import batch, far_from, level_log_weight, ours, rows, slime_mis

SEEDS = range(10)


def full_rows(seed, extreme=False):
    """batch() with a valid token in every row (the anchors average some statistics over all rows)."""
    p, b, mask = batch(seed, extreme=extreme)
    mask[:, 0] = True
    return p, b, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_clip_matches_slime(seed, level):
    p, b, mask = batch(seed)
    lo, hi = 0.5, 2.0
    spec = (dict(mode="geometric", geometric_action="clip") if level == "geometric"
            else dict(mode="clip", level=level))
    w, keep, m = ours(p, b, mask, threshold=hi, threshold_lower=lo, **spec)
    assert torch.equal(keep, mask) and m["rollout_corr/masked_frac"] == 0  # clipping drops nothing
    ok = mask & far_from(level_log_weight(p, b, mask, level), lo, hi)
    sw, smask, _ = slime_mis(p, b, mask, level, "clip", lo, hi)
    assert torch.equal(smask[mask], mask[mask])
    torch.testing.assert_close(w[ok], sw[ok], rtol=1e-5, atol=0)
    assert w[mask].min() >= lo * (1 - 1e-6) and w[mask].max() <= hi * (1 + 1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_veto_matches_slime(seed):
    p, b, mask = batch(seed)
    veto = 1e-3
    _, keep, m = ours(p, b, mask, mode="tis", threshold=2.0, veto_threshold=veto)
    args = SimpleNamespace(use_tis=True, tis_level="token", tis_mode="truncate", tis_lower_bound=None,
                           tis_upper_bound=2.0, use_rs=True, rs_level="token", rs_lower_bound=1e-30,
                           rs_upper_bound=1e30, rs_veto_threshold=veto, tis_batch_normalize=False)
    train, masks = rows(p, mask)
    _, new_masks, _ = slime.compute_mis_weights(args, train_log_probs=train, rollout_log_probs=rows(b, mask)[0],
                                                loss_masks=masks)
    skeep = torch.stack(new_masks) > 0
    assert torch.equal(keep, skeep & mask)
    vetoed_rows = (mask & ((p - b) < math.log(veto))).any(-1)
    assert not keep[vetoed_rows].any()  # the whole sequence goes
    assert m["rollout_corr/vetoed_seq_frac"] == pytest.approx(vetoed_rows.sum().item() / mask.any(-1).sum().item())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalised_tis_matches_verl_and_slime(seed, level):
    p, b, mask = full_rows(seed)
    C = 2.0
    if not far_from(level_log_weight(p, b, mask, level), C)[mask].all():
        pytest.skip("a weight within rounding of the bound")
    w, _, m = ours(p, b, mask, mode="tis", level=level, threshold=C, batch_normalize=True)
    vw, vm = verl.compute_rollout_correction_weights(p - b, mask.float(), rollout_is=level, rollout_is_threshold=C,
                                                     rollout_is_batch_normalize=True)
    torch.testing.assert_close(w[mask], vw[mask], rtol=1e-5, atol=0)
    assert m["rollout_corr/batch_norm_factor"] == pytest.approx(vm["rollout_is_batch_norm_factor"], rel=1e-5)
    args = SimpleNamespace(use_tis=True, tis_level=level, tis_mode="truncate", tis_lower_bound=None,
                           tis_upper_bound=C, use_rs=False, rs_level=level, rs_lower_bound=None,
                           rs_upper_bound=None, rs_veto_threshold=None, tis_batch_normalize=True)
    train, masks = rows(p, mask)
    sw, _, _ = slime.compute_mis_weights(args, train_log_probs=train, rollout_log_probs=rows(b, mask)[0],
                                         loss_masks=masks)
    torch.testing.assert_close(w[mask], torch.stack(sw)[mask], rtol=1e-5, atol=0)
    kept = w[mask].double()
    mean = kept.mean() if level == "token" else torch.stack([w[i][mask[i]][0] for i in range(len(w))]).double().mean()
    assert mean.item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rejection", ["token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2",
                                       "seq_mean_k3", "seq_max_k2", "seq_max_k3"])
def test_k2_k3_rejection_matches_verl(seed, rejection):
    p, b, mask = batch(seed, extreme=seed % 2 == 0)
    t = 0.02 if "mean" in rejection or "max" in rejection or rejection.startswith("token") else 0.2
    _, keep, m = ours(p, b, mask, mode="tis", threshold=2.0, rejection=rejection, rejection_threshold=t)
    vmask, _ = verl.compute_rollout_rejection_mask(p - b, mask.float(), rejection, str(t))
    vkeep = (vmask > 0) & mask
    assert torch.equal(keep, vkeep), (keep, vkeep)
    assert m["rollout_corr/rejected_frac"] == pytest.approx((mask & ~keep).sum().item() / mask.sum().item())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ess_and_chi2_match_verl(seed, level):
    p, b, mask = full_rows(seed, extreme=seed % 2 == 0)
    C = 2.0
    _, _, m = ours(p, b, mask, mode="tis", level=level, threshold=C)
    _, vm = verl.compute_rollout_correction_weights(p - b, mask.float(), rollout_is=level, rollout_is_threshold=C)
    assert m["rollout_corr/ess"] == pytest.approx(vm["rollout_is_eff_sample_size"], rel=1e-4)
    om = verl.compute_offpolicy_metrics(old_log_prob=p, rollout_log_prob=b, response_mask=mask.float())
    assert m["rollout_corr/chi2_token"] == pytest.approx(om["chi2_token"], rel=1e-4, abs=1e-5)
    assert m["rollout_corr/chi2_seq"] == pytest.approx(om["chi2_seq"], rel=1e-4, abs=1e-5)


def test_masking_modes_normalise_over_the_tokens_they_keep():
    # Token ratios 1, 4, 1.5 with MIS [1/2, 2]: 4 is dropped; the kept weights 1 and 1.5 are normalised to
    # mean 1 over themselves (0.8, 1.2). verl and slime normalise their IS weights over every valid token,
    # rejection aside; here the mean that matters is that of the weights the loss uses.
    b = torch.zeros(1, 3)
    p = torch.log(torch.tensor([[1.0, 4.0, 1.5]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, keep, m = ours(p, b, mask, mode="mis", threshold=2.0, batch_normalize=True)
    assert keep.tolist() == [[True, False, True]]
    torch.testing.assert_close(w, torch.tensor([[0.8, 0.0, 1.2]]))
    assert m["rollout_corr/batch_norm_factor"] == pytest.approx(1.25)
