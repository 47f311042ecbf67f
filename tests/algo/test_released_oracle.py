"""rule="cap" against the released M2PO code run literally (tests/algo/_released_m2po.py, a verbatim copy of
Infini-AI-Lab/M2PO's compute_m2po_policy_loss and its helpers; see docs/SOURCES.md).

The released function is called as its trainer calls it (miniclip off, token-mean) on a padded float32
micro-batch; its gradient with respect to log_prob is compared with policy_loss("m2po", rule="cap") on the
same tokens. They must agree everywhere except on the differences listed in docs/algo.md, each of which has
its own minimal example below, asserting what each side does."""

import contextlib
import io

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import _released_m2po as released
from m2po_megatron.algo import m2po_keep_mask, policy_loss


def released_grad(log_ratio, adv, mask, tau, old=None):
    """The released loss and its gradient w.r.t. log_prob for padded [B, T] float32 inputs."""
    old = torch.zeros_like(log_ratio) if old is None else old
    new = (old + log_ratio).detach().requires_grad_()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints M2 and the bounds on every call
        loss, *_, stats = released.compute_m2po_policy_loss(
            old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask.float(), M2_budget=tau,
            miniclip_low=None, miniclip_high=None, loss_agg_mode="token-mean")
    loss.backward()
    return loss.detach(), new.grad, stats


def our_grad(log_ratio, adv, mask, tau, old=None):
    old = torch.zeros_like(log_ratio) if old is None else old
    new = (old + log_ratio).detach().requires_grad_()
    loss, _ = policy_loss("m2po", new, old, adv, mask.bool(), rule="cap", tau=tau)
    loss.backward()
    return loss.detach(), new.grad


def trust_region(lr, adv, mask):
    return mask.bool() & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))


# Log-ratios and behaviour log-probs on a 2^-10 grid: the sum old + l and the difference are exact in float32,
# so both sides see the same log-ratios; |l| <= 0.8 keeps ratios far from the 1e5 cap, and distinct values
# are 1e-3 apart, far from float32 rounding. Advantages are per sequence (GRPO), as the released code assumes.
seq = st.tuples(st.sampled_from([-1.5, -1.0, -0.25, 0.0, 0.5, 1.0, 2.0]),
                st.lists(st.tuples(st.integers(-800, 800), st.integers(0, 4096), st.booleans()),
                         min_size=1, max_size=12))
batch = st.lists(seq, min_size=1, max_size=6)
taus = st.sampled_from([0.002, 0.01, 0.02, 0.04, 0.08, 0.16])


def padded(seqs):
    width = max(len(toks) for _, toks in seqs)
    lr = torch.zeros(len(seqs), width)
    old = torch.zeros(len(seqs), width)
    adv = torch.zeros(len(seqs), width)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (a, toks) in enumerate(seqs):
        adv[i] = a
        for j, (m, o, valid) in enumerate(toks):
            lr[i, j], old[i, j], mask[i, j] = m / 1024, -o / 1024, valid
        mask[i, 0] = True  # every sequence has a response token
    return lr, old, adv, mask


def away_from_rounding(lr, adv, mask, tau) -> bool:
    """False when M2 or a breakpoint sum f_k lies within 1e-4 (relative) of its threshold: there the
    released code's float32 sums may fall on the other side (a documented difference)."""
    v = torch.sort(lr[trust_region(lr, adv, mask)].double() ** 2).values
    n = v.numel()
    if n == 0:
        return True
    target = tau * n
    if abs(float(v.sum()) - target) <= 1e-4 * target:
        return False
    f = torch.cumsum(v, 0) + torch.arange(n - 1, -1, -1, dtype=torch.float64) * v
    return bool(((f - target).abs() > 1e-4 * target).all())


def at_released_bound(lr, adv, stats):
    """Tokens (A != 0) whose float32 ratio equals one of the released clip bounds e^-c, e^c: there -A r and
    -A clip(r) tie, torch.maximum splits the gradient and torch.clamp passes none at its bounds, so the
    released code gives such a token half its gradient."""
    r = torch.exp(lr)
    hi = torch.tensor(1 + stats["m2po/clip_high"], dtype=torch.float32)
    lo = torch.tensor(1 - stats["m2po/clip_low"], dtype=torch.float32)
    return (adv != 0) & ((r == hi) | (r == lo))


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(batch, taus)
def test_cap_has_the_released_gradient_except_at_the_bound(seqs, tau):
    lr, old, adv, mask = padded(seqs)
    assume(away_from_rounding(lr, adv, mask, tau))
    _, g_rel, stats = released_grad(lr, adv, mask, tau, old)
    _, g_ours = our_grad(lr, adv, mask, tau, old)
    tie = mask & at_released_bound(lr, adv, stats)
    torch.testing.assert_close(g_ours[~tie], g_rel[~tie], rtol=1e-5, atol=1e-9)
    # At a bound (documented): the released code gives half the gradient -A r / N; here a T token there is
    # dropped (zero) and a token outside T (A < 0 at e^c, A > 0 at e^-c, or ratio exactly 1 when c = 0)
    # keeps all of it.
    full = (-adv * torch.exp(lr) / mask.sum())[tie]
    torch.testing.assert_close(g_rel[tie], full / 2, rtol=1e-5, atol=1e-9)
    tr = trust_region(lr, adv, mask)
    torch.testing.assert_close(g_ours[tie], torch.where(tr[tie], torch.zeros_like(full), full), rtol=1e-5,
                               atol=1e-9)
    # As a mask: the T tokens the released code gives no or half a gradient are exactly cap's dropped ones.
    assert torch.equal(tr & ((g_rel == 0) | tie), tr & ~m2po_keep_mask(lr, adv, mask, tau=tau, rule="cap"))


def test_difference_the_boundary_token_gets_half_its_gradient_in_the_released_code():
    # v = 1/64, 4/64, 16/64 (A = +-1), tau = 1/16: k = 2, the released bound is c^2 = v_1 - 1e-12. In float32
    # exp(c) equals the 0.25 token's own ratio, so -A r and -A clip(r) tie: that token gets half its gradient
    # and the 0.5 token none. cap drops both (v >= v_1), the bound's intent.
    lr = torch.tensor([[0.125, 0.25, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    for sign in (1.0, -1.0):
        adv = torch.full((1, 3), sign)
        _, g_rel, stats = released_grad(lr * sign, adv, mask, 1 / 16)
        full = -adv * torch.exp(lr * sign) / 3
        torch.testing.assert_close(g_rel, full * torch.tensor([[1.0, 0.5, 0.0]]))
        assert m2po_keep_mask(lr * sign, adv, mask, tau=1 / 16, rule="cap").tolist() == [[True, False, False]]


def test_difference_float32_unit_ratios_are_outside_the_released_trust_region():
    # Two tokens with log-ratio 1e-8: exp(1e-8) == 1 in float32, so the released T is {0.3} alone
    # (M2 = 0.09 > 0.04: the 0.3 token is clipped). Here l > 0 puts them in T: M2 = 0.03 <= 0.04, no bound.
    lr = torch.tensor([[0.3, 1e-8, 1e-8]])
    adv = torch.ones(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    _, g_rel, _ = released_grad(lr, adv, mask, 0.04)
    assert (g_rel != 0).tolist() == [[False, True, True]]
    assert m2po_keep_mask(lr, adv, mask, tau=0.04, rule="cap").tolist() == [[True, True, True]]


def test_difference_the_released_code_caps_ratios_at_1e5_without_a_bound():
    # M2 = (144 + 199 * 1e-4) / 200 = 0.72 <= tau = 1: no bound. The released code then clips at ratio 1e5
    # (its "no bound" sentinel), so the token with ratio e^12 = 162755 loses its gradient; here it keeps it.
    lr = torch.tensor([[12.0] + [0.01] * 199])
    adv = torch.ones(1, 200)
    mask = torch.ones(1, 200, dtype=torch.bool)
    _, g_rel, _ = released_grad(lr, adv, mask, 1.0)
    _, g_ours = our_grad(lr, adv, mask, 1.0)
    assert g_rel[0, 0] == 0 and bool((g_rel[0, 1:] != 0).all())
    assert bool((g_ours != 0).all())


@pytest.mark.parametrize("lr, tau", [([5e-7, 1.0], 0.04), ([0.5, 1.0], 0.0)], ids=["c2-negative", "tau-zero"])
def test_difference_the_released_code_crashes_where_this_one_bounds(lr, tau):
    # c2-negative: v = 2.5e-13, 1 (A > 0): k = 1 and c^2 = 2.5e-13 - 1e-12 < 0; its sqrt is complex and
    # float() raises. tau-zero: its solver returns a bare 0.0 where a pair is unpacked. Here both bound,
    # v >= v_(k-1) (= 2.5e-13) and at tau = 0 every T token: both tokens are dropped.
    lrt = torch.tensor([lr])
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(TypeError):
        released_grad(lrt, adv, mask, tau)
    assert m2po_keep_mask(lrt, adv, mask, tau=tau, rule="cap").tolist() == [[False, False]]


def test_difference_micro_batch_weighting():
    # A mini-batch of 2 sequences (1 and 3 response tokens, A = 1, ratio 1) in two micro-batches. The
    # released actor scales each micro-batch's token-mean by its share of the mini-batch's sequences
    # (dp_actor.py with dynamic batch size: `policy_loss * (len(data) / ppo_mini_batch_size)`), so the
    # 1-token sequence's token weighs 1/2 and each of the other's 1/6. Here every token of the mini-batch
    # weighs 1/num_tokens = 1/4 (the paper's Eq. 5), whatever the micro-batching.
    micro = [torch.zeros(1, 1), torch.zeros(1, 3)]
    grads_rel = []
    for lr in micro:
        new = lr.clone().requires_grad_()
        with contextlib.redirect_stdout(io.StringIO()):
            loss, *_ = released.compute_m2po_policy_loss(lr, new, torch.ones_like(lr), torch.ones_like(lr),
                                                         M2_budget=0.04, miniclip_low=None, miniclip_high=None)
        (loss * (1 / 2)).backward()
        grads_rel.append(new.grad.flatten())
    assert torch.cat(grads_rel).tolist() == pytest.approx([-1 / 2, -1 / 6, -1 / 6, -1 / 6], rel=1e-6)
    grads_ours = []
    for lr in micro:
        new = lr.clone().requires_grad_()
        loss, _ = policy_loss("m2po", new, lr, torch.ones_like(lr), torch.ones_like(lr, dtype=torch.bool),
                              rule="cap", num_tokens=4)
        loss.backward()
        grads_ours.append(new.grad.flatten())
    assert torch.cat(grads_ours).tolist() == pytest.approx([-1 / 4] * 4)
