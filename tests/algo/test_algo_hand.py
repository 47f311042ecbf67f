"""Small cases worked out by hand (the reasoning is in the comments). Values are binary fractions so every
square and sum is exact and the expected masks do not depend on rounding."""

import math

import pytest
import torch

from m2po_megatron.algo import grpo_advantages, m2po_keep_mask, policy_loss, reduce_metrics, seq_ids_from_cu_seqlens
from m2po_megatron.algo.distributed import global_m2po_keep_masks


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def test_remove_drops_largest_until_bound_holds():
    # Tokens (log r, A): (1/8, +), (1/4, +), (1/2, +) are in T (A > 0, r > 1); (-2, +) is not (r < 1 with
    # A > 0); (-3/4, -) is in T (A < 0, r < 1). tau = 1/16.
    # v over T = 1/64, 4/64, 16/64, 36/64. Mean = 57/256 > 1/16 -> drop 36/64 (the -3/4 token).
    # Mean of 1/64, 4/64, 16/64 = 21/192 = 0.109 > 0.0625 -> drop 16/64 (the 1/2 token).
    # Mean of 1/64, 4/64 = 5/128 = 0.039 <= 0.0625 -> stop. The -2 token (v = 4, far larger) is outside T
    # and is kept: the mask never touches it.
    lr = t([0.125, 0.25, 0.5, -2.0, -0.75])
    adv = t([1.0, 1.0, 1.0, 1.0, -1.0])
    mask = torch.ones(5, dtype=torch.bool)
    keep = m2po_keep_mask(lr, adv, mask, tau=1 / 16)
    assert keep.tolist() == [True, True, False, True, False]


def test_cap_zeroes_more_than_remove():
    # Same T values sorted: v = [1/64, 4/64, 16/64] (three tokens, A > 0), n = 3, tau = 1/16, target
    # tau * n = 12/64. f_k = sum_i min(v_i, v_k): f_0 = 3/64, f_1 = 1/64 + 4/64 + 4/64 = 9/64 (< 12/64),
    # f_2 = 21/64 (>= 12/64) -> k = 2, c^2 = v_1 - 1e-12 = 4/64 - 1e-12. Zero-gradient set: v > c^2, i.e.
    # the 1/4 and 1/2 tokens (in float32 the released code gives the 1/4 token half its gradient instead:
    # test_released_oracle.py). Remove (Algorithm 1) drops only 1/2: 21/192 > 1/16 but 5/128 <= 1/16.
    lr = t([0.125, 0.25, 0.5])
    adv = t([1.0, 2.0, 0.5])
    mask = torch.ones(3, dtype=torch.bool)
    assert m2po_keep_mask(lr, adv, mask, tau=1 / 16, rule="remove").tolist() == [True, True, False]
    assert m2po_keep_mask(lr, adv, mask, tau=1 / 16, rule="cap").tolist() == [True, False, False]


def test_no_bound_when_m2_within_tau():
    # v = 1/64, 1/16 -> M2 = 5/128 = 0.039 <= 0.04: remove drops nothing and cap applies no bound at all.
    # The padded [1, 3] layout with an invalid third token (huge log-ratio) shows padding is ignored and
    # reported as not kept.
    lr = t([[0.125, -0.25, 9.0]])
    adv = t([[1.0, -1.0, 1.0]])
    mask = t([[1, 1, 0]])
    for rule in ("remove", "cap"):
        assert m2po_keep_mask(lr, adv, mask, tau=0.04, rule=rule).tolist() == [[True, True, False]]


def test_ties_drop_the_later_token_first():
    # v = 1/4 (x3, tokens 0..2) and 1/64 (token 3), all in T. Sorted: 1/64, 1/4, 1/4, 1/4.
    # Prefix means: m=1: 1/64; m=2: 17/128 = 0.133; m=3: 11/64 = 0.172; m=4: 49/256 = 0.191.
    # tau = 0.15 -> keep the m* = 2 smallest: token 3 and ONE of the three tied tokens. Algorithm 1 drops
    # "the largest"; among equals we drop the later ones first, so token 0 stays, tokens 1 and 2 go.
    lr = t([0.5, 0.5, 0.5, 0.125])
    adv = torch.ones(4)
    keep = m2po_keep_mask(lr, adv, torch.ones(4, dtype=torch.bool), tau=0.15)
    assert keep.tolist() == [True, False, False, True]


def test_tau_zero_drops_all_of_t():
    # tau = 0: any T token has v > 0, so the loop empties T. Token 2 (A = 0) and token 3 (A < 0, r > 1)
    # are not in T and stay.
    lr = t([0.25, -0.5, 1.0, 1.0])
    adv = t([1.0, -1.0, 0.0, -1.0])
    for rule in ("remove", "cap"):
        keep = m2po_keep_mask(lr, adv, torch.ones(4, dtype=torch.bool), tau=0.0, rule=rule)
        assert keep.tolist() == [False, False, True, True]


def test_grpo_advantages_by_hand():
    # Group 0 rewards 1, 0, 0, 1: mean 1/2, unbiased std sqrt(4 * 1/4 / 3) = sqrt(1/3); A = +-sqrt(3)/2.
    # Group 1 all 1: centred 0 -> A = 0 (std 0, eps keeps it finite).
    r = t([1, 0, 0, 1, 1, 1, 1, 1])
    a = grpo_advantages(r, group_size=4)
    h = math.sqrt(3) / 2
    torch.testing.assert_close(a, t([h, -h, -h, h, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    # The same groups given as (non-contiguous) ids, and Dr.GRPO's mean-only variant.
    ids = torch.tensor([7, 3, 3, 7, 7, 3, 3, 7])  # group 7: 1, 1, 1, 1 -> 0 ; group 3: 0, 0, 1, 1
    a2 = grpo_advantages(r, group_ids=ids, norm_by_std=False)
    torch.testing.assert_close(a2, t([0, -0.5, -0.5, 0, 0, 0.5, 0.5, 0]))


def test_grpo_clip_loss_and_gradient_by_hand():
    # Tokens (A, log r): (1, 1/2): r = 1.6487 > 1.2 -> clipped, loss -1.2, no gradient.
    # (-1, -1/2): r = 0.6065 < 0.8 -> clipped, loss +0.8, no gradient.
    # (2, 0): r = 1 -> loss -2, gradient d(-A r)/d log_prob = -A r = -2.
    # Token-mean over the 3 valid tokens (the 4th is padding): loss = (-1.2 + 0.8 - 2) / 3 = -0.8,
    # gradient [0, 0, -2/3, 0]; clip_frac = 2/3.
    lp = t([0.5, -0.5, 0.0, 5.0]).requires_grad_()
    blp = torch.zeros(4)
    adv = t([1.0, -1.0, 2.0, 1.0])
    mask = t([1, 1, 1, 0]).bool()
    loss, m = policy_loss("grpo", lp, blp, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(-0.8, abs=1e-6)
    torch.testing.assert_close(lp.grad, t([0, 0, -2 / 3, 0]))
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert m["ratio/max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    # Both clipped tokens leave the kept range: only r = 1 is left (the padding's r = e^5 is in neither).
    assert (m["ratio/kept_min"], m["ratio/kept_max"]) == (pytest.approx(1.0), pytest.approx(1.0))
    # k1 = mean(-log r) = 0; k3 = mean(r - 1 - log r) = (e^.5 - 1.5 + e^-.5 - .5 + 0) / 3
    assert m["kl/k1"] == pytest.approx(0.0, abs=1e-7)
    assert m["kl/k3"] == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5) / 3, rel=1e-6)


def test_m2po_masked_tokens_stay_in_denominator_and_dual_clip():
    # Tokens (A, log r): (1, 1/2) in T, v = 1/4; (1, 1/8) in T, v = 1/64; (-1, ln 5) outside T (A < 0, r > 1).
    # tau = 0.04: M2 = (1/4 + 1/64)/2 = 0.133 > 0.04 -> drop the 1/2 token; 1/64 <= 0.04 -> stop.
    # Loss = (0 + -1 * e^{1/8} + 1 * 5) / 3 (the dropped token still counts in the denominator).
    # With dual_clip = 3 the third token (A < 0, r = 5 > 3) becomes the constant -A * 3 = 3: no gradient.
    lp = t([0.5, 0.125, math.log(5.0)]).requires_grad_()
    blp = torch.zeros(3)
    adv = t([1.0, 1.0, -1.0])
    mask = torch.ones(3, dtype=torch.bool)
    loss, m = policy_loss("m2po", lp, blp, adv, mask, tau=0.04)
    loss.backward()
    assert loss.item() == pytest.approx((-math.exp(0.125) + 5.0) / 3, rel=1e-6)
    torch.testing.assert_close(lp.grad, t([0.0, -math.exp(0.125) / 3, 5.0 / 3]))
    assert m["m2po/masked_frac"] == pytest.approx(1 / 3)
    assert m["m2po/m2_before"] == pytest.approx((1 / 4 + 1 / 64) / 2)
    assert m["m2po/m2_after"] == pytest.approx(1 / 64)
    assert m["m2po/num_trust_region"] == 2
    # The dropped r = e^{1/2} is in the whole range, not the kept one; r = 5 is kept (outside T).
    assert m["ratio/max"] == pytest.approx(5.0, rel=1e-6)
    assert (m["ratio/kept_min"], m["ratio/kept_max"]) == (pytest.approx(math.exp(0.125)), pytest.approx(5.0))

    lp.grad = None
    loss, m = policy_loss("m2po", lp, blp, adv, mask, tau=0.04, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx((-math.exp(0.125) + 3.0) / 3, rel=1e-6)
    torch.testing.assert_close(lp.grad, t([0.0, -math.exp(0.125) / 3, 0.0]))
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    assert (m["ratio/kept_min"], m["ratio/kept_max"]) == (pytest.approx(math.exp(0.125)),) * 2  # r = 5 dual-clipped


def test_gspo_sequence_ratio_by_hand():
    # Flat layout, two sequences: seq 0 = tokens 0, 1 with log r = +0.1, -0.1 -> s_0 = exp(0) = 1;
    # seq 1 = token 2 with log r = ln 2 -> s_1 = 2 > 1 + 4e-4 with A > 0 -> clipped (loss -(1+4e-4)).
    # seq-mean-token-mean: ((-1 - 1) / 2 + -(1.0004)) / 2 = -1.0002.
    # Gradient: seq 0 tokens: d/d lr_t of mean_t(-A s_0) = -A s_0 / L_0 * (1/L_0) summed over L_0 tokens
    # = -1/2, divided by 2 sequences -> -1/4 each. Seq 1 is clipped: 0.
    lp = t([0.1, -0.1, math.log(2.0)]).requires_grad_()
    blp = torch.zeros(3)
    adv = t([1.0, 1.0, 1.0])
    mask = torch.ones(3, dtype=torch.bool)
    seq_ids = seq_ids_from_cu_seqlens(torch.tensor([0, 2, 3]))
    assert seq_ids.tolist() == [0, 0, 1]
    loss, m = policy_loss("gspo", lp, blp, adv, mask, seq_ids=seq_ids)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0002, abs=1e-6)
    torch.testing.assert_close(lp.grad, t([-0.25, -0.25, 0.0]))
    assert m["clip_frac"] == pytest.approx(1 / 3)


def test_reduce_metrics_is_exact_over_micro_batches():
    # Two micro-batches with global denominators: the losses sum to the full-batch loss, and token-weighted
    # means / extremes combine to the full-batch values.
    torch.manual_seed(0)
    lp = torch.randn(6, 5) * 0.3
    blp = torch.zeros(6, 5)
    adv = torch.randn(6, 1).expand(6, 5)
    mask = torch.rand(6, 5) > 0.3
    full_loss, full = policy_loss("grpo", lp, blp, adv, mask)
    n = int(mask.sum())
    parts = [policy_loss("grpo", lp[s], blp[s], adv[s], mask[s], num_tokens=n)[1] for s in (slice(0, 2), slice(2, 6))]
    red = reduce_metrics(parts)
    for k in ("loss", "clip_frac", "ratio/mean", "ratio/min", "ratio/max", "kl/k1", "kl/k3", "m2po/m2_before",
              "m2po/num_trust_region", "count/tokens"):
        assert red[k] == pytest.approx(full[k], rel=1e-5, abs=1e-7), k


def test_bad_inputs_raise_clear_errors():
    lp = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    bad = lp.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="behav_log_prob contains NaN or inf"):
        policy_loss("grpo", lp, bad, lp, mask)
    bad[1, 2] = float("-inf")
    with pytest.raises(ValueError, match="log_prob contains NaN or inf"):
        policy_loss("m2po", bad, lp, lp, mask)
    # -inf on a padded (invalid) position is fine.
    mask2 = mask.clone()
    mask2[1, 2] = False
    policy_loss("m2po", bad, lp, lp, mask2)
    with pytest.raises(ValueError, match="log_ratio contains NaN or inf"):
        m2po_keep_mask(bad, lp, mask)
    with pytest.raises(ValueError, match="name must be one of"):
        policy_loss("ppo", lp, lp, lp, mask)
    with pytest.raises(ValueError, match="seq_ids"):
        policy_loss("gspo", lp.reshape(-1), lp.reshape(-1), lp.reshape(-1), mask.reshape(-1))
    with pytest.raises(ValueError, match="broadcast per-sequence advantages"):
        policy_loss("grpo", lp, lp, torch.zeros(2), mask)
    with pytest.raises(ValueError, match="tau must be"):
        m2po_keep_mask(lp, lp, mask, tau=-1.0)


def test_half_precision_inputs_are_computed_in_fp32():
    # bf16 log-probs: the loss is float32 and equals the loss of the same (rounded) values given in fp32;
    # the gradient flows back to the bf16 leaf.
    torch.manual_seed(1)
    lp32 = (torch.randn(3, 7) * 0.2).bfloat16().float()
    adv = torch.randn(3, 1).expand(3, 7)
    mask = torch.ones(3, 7, dtype=torch.bool)
    lp16 = lp32.bfloat16().requires_grad_()
    loss16, _ = policy_loss("m2po", lp16, torch.zeros(3, 7, dtype=torch.bfloat16), adv, mask, tau=0.01)
    loss32, _ = policy_loss("m2po", lp32, torch.zeros(3, 7), adv, mask, tau=0.01)
    assert loss16.dtype == torch.float32
    assert loss16.item() == loss32.item()
    loss16.backward()
    assert lp16.grad.dtype == torch.bfloat16


def test_on_device_loss_defers_the_nan_check_and_keeps_the_gradient_finite():
    # policy_loss_on_device reads nothing: a NaN input is counted, its token leaves the loss (finite gradient),
    # and read_loss_stats raises naming it; the other tokens' loss is what policy_loss gives without it.
    from m2po_megatron.algo import policy_loss_on_device, read_loss_stats

    torch.manual_seed(3)
    lp = (torch.randn(10) * 0.2).requires_grad_()
    blp, adv = torch.zeros(10), torch.randn(10)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    bad = blp.clone()
    bad[4] = float("nan")
    loss, stats = policy_loss_on_device("gspo", lp, bad, adv, torch.ones(10, dtype=torch.bool), seq_ids=seq,
                                        num_seq_ids=4)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[4] == 0
    with pytest.raises(ValueError, match=r"behav_log_prob contains NaN or inf at 1 valid token\(s\)"):
        read_loss_stats([stats])
    keep = torch.ones(10, dtype=torch.bool)
    keep[4] = False
    ref, _ = policy_loss("gspo", lp.detach(), blp, adv, keep, seq_ids=seq)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    # dense ids given (num_seq_ids) or made dense by torch.unique: the same metrics
    _, a = policy_loss("gspo", lp.detach(), blp, adv, keep, seq_ids=seq, num_seq_ids=4)
    _, b = policy_loss("gspo", lp.detach(), blp, adv, keep, seq_ids=seq * 7 + 3)
    assert a == b


def test_m2_tokens_trust_region_against_all_valid_tokens_by_hand():
    # Tokens (A, log r), v = (log r)^2: (1, 0.5) in T, v = .25; (1, -0.3) off T (A > 0, r < 1), v = .09;
    # (-1, -0.1) in T, v = .01; (-1, 0.2) off T, v = .04. tau = 0.04.
    # trust_region: M2 over T = (.25 + .01) / 2 = .13 > tau -> drop .25; then .01 <= tau. Keep 2, 3, 4.
    # all: ascending .01, .04, .09, .25, prefix means .01, .025, .0467, .0975 -> keep the 2 smallest (3, 4).
    lp = t([0.5, -0.3, -0.1, 0.2])
    blp = torch.zeros(4)
    adv = t([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4, dtype=torch.bool)
    e = math.exp
    cases = {"trust_region": ([False, True, True, True], (-e(-0.3) + e(-0.1) + e(0.2)) / 4, 1 / 4, 0.13, 0.01),
             "all": ([False, False, True, True], (e(-0.1) + e(0.2)) / 4, 2 / 4, 0.0975, 0.025)}
    for tokens, (keep, want_loss, masked, before, after) in cases.items():
        assert m2po_keep_mask(lp, adv, mask, tau=0.04, tokens=tokens).tolist() == keep, tokens
        res = global_m2po_keep_masks([lp], [adv], [mask], tau=0.04, tokens=tokens)
        assert res.keep_masks[0].tolist() == keep, tokens
        x = lp.clone().requires_grad_()
        loss, m = policy_loss("m2po", x, blp, adv, mask, tau=0.04, m2_tokens=tokens)
        assert loss.item() == pytest.approx(want_loss, rel=1e-6), tokens
        assert m["m2po/masked_frac"] == pytest.approx(masked), tokens
        assert (m["m2po/m2_before"], m["m2po/m2_after"]) == (pytest.approx(before, rel=1e-6),
                                                             pytest.approx(after, rel=1e-6)), tokens
        # the mini-batch mask handed in gives the same loss and metrics
        loss2, m2 = policy_loss("m2po", x, blp, adv, mask, keep_mask=res.keep_masks[0], m2_tokens=tokens)
        assert loss2.item() == pytest.approx(want_loss, rel=1e-6) and m2["m2po/masked_frac"] == m["m2po/masked_frac"]
    with pytest.raises(ValueError, match="m2_tokens must be one of"):
        m2po_keep_mask(lp, adv, mask, tokens="quadrants")


def test_gspo_with_token_weights_is_verls_per_token_product_then_the_sequence_mean():
    # verl's compute_policy_loss_gspo multiplies each token's loss by its rollout weight, then
    # seq-mean-token-mean averages over the sequence's tokens in the (rejection-masked) response mask.
    # One sequence, log r = (0.1, -0.1, 0.3): s = exp(mean) = exp(0.1); A = 1; GSPO clip (3e-4, 4e-4) on
    # s = 1.105 > 1.0004 with A > 0: clipped, token loss -(1.0004) each. Weights (0.5, 2, 0): the third token is
    # dropped from the mask, so the sequence ratio is over the first two (mean 0: s = 1, not clipped) and the
    # loss is -(0.5 + 2) * 1 / 2.
    lp = t([0.1, -0.1, 0.3]).requires_grad_()
    blp = torch.zeros(3)
    adv = t([1.0, 1.0, 1.0])
    w = t([0.5, 2.0, 0.0])
    seq_ids = torch.zeros(3, dtype=torch.long)
    loss, m = policy_loss("gspo", lp, blp, adv, w > 0, seq_ids=seq_ids, weights=w)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2, rel=1e-6)
    # d loss / d lp_t = -A s w_t / L (the straight-through sequence ratio), over the kept tokens only
    torch.testing.assert_close(lp.grad, t([-0.5 / 2, -2.0 / 2, 0.0]))  # not the mean weight on each: -0.625
    # all three kept with equal weights 1: the plain GSPO loss, clipped
    loss1, _ = policy_loss("gspo", lp.detach(), blp, adv, torch.ones(3, dtype=torch.bool), seq_ids=seq_ids,
                           weights=torch.ones(3))
    assert loss1.item() == pytest.approx(-(1 + 4e-4), rel=1e-6)
