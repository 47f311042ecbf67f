"""policy_loss's per-token `weights` (the rollout correction's factors): each token's loss, and so its
gradient, is multiplied by its weight; the denominators stay; all-ones weights change nothing."""
import math

import pytest
import torch

from m2po_megatron.algo.losses import policy_loss


def _inputs(seed=0, n=12):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(n, generator=g) * 0.3 - 1.0).requires_grad_()
    blp = lp.detach() + torch.randn(n, generator=g) * 0.2
    adv = torch.randn(n, generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    mask[-2:] = False
    return lp, blp, adv, mask


@pytest.mark.parametrize("name", ["m2po", "grpo", "grpo_notr"])
def test_all_ones_weights_change_nothing(name):
    lp, blp, adv, mask = _inputs()
    l0, m0 = policy_loss(name, lp, blp, adv, mask)
    (g0,) = torch.autograd.grad(l0, lp)
    l1, m1 = policy_loss(name, lp, blp, adv, mask, weights=torch.ones_like(blp))
    (g1,) = torch.autograd.grad(l1, lp)
    assert float(l0) == float(l1) and torch.equal(g0, g1) and m0 == m1


def test_weights_scale_each_tokens_gradient_and_keep_the_denominator():
    lp, blp, adv, mask = _inputs(seed=3)
    w = torch.linspace(0.0, 2.0, lp.numel())
    w[-1] = math.nan  # off the valid tokens: never reaches the loss
    loss, _ = policy_loss("grpo_notr", lp, blp, adv, mask, weights=w)
    (g,) = torch.autograd.grad(loss, lp)
    r = torch.exp(lp.detach() - blp)
    n = int(mask.sum())
    expected = torch.where(mask, -adv * r * torch.nan_to_num(w) / n, torch.zeros(()))
    assert torch.isfinite(loss) and torch.allclose(g, expected, atol=1e-7)
    assert float(loss) == pytest.approx(float((-adv * r * torch.nan_to_num(w))[mask].sum() / n), rel=1e-6)


def test_weights_of_another_shape_are_refused():
    lp, blp, adv, mask = _inputs()
    with pytest.raises(ValueError, match="weights has shape"):
        policy_loss("grpo", lp, blp, adv, mask, weights=torch.ones(3))
