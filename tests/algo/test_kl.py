"""The KL-to-reference estimators (m2po_megatron.algo.kl) against verl's own kl_penalty / kl_penalty_forward, run
literally (tests/algo/_verl_kl.py: a verbatim copy, source in its header and docs/SOURCES.md), and each gradient
against autograd of the formula written out here.

Inputs: random [B, T] and flat [N] log-probs in float32 and float64, log-ratios at three scales plus extreme
tokens (|d| up to 30, past k3's clamps of the log-ratio at 20 and of the value at 10)."""

import pytest
import torch

import _verl_kl as verl
from m2po_megatron.algo.kl import KL_TYPES, check_kl_type, kl_penalty

SEEDS = range(4)
TOL = dict(rtol=1e-6, atol=1e-6)
BASE = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
PLUS = [n + "+" for n in BASE]


def inputs(seed, dtype, flat):
    g = torch.Generator().manual_seed(seed)
    shape = (int(torch.randint(1, 40, (1,), generator=g)),) if flat else \
        (int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g)))
    ref = -5 * torch.rand(shape, generator=g, dtype=dtype)
    d = (0.01, 0.5, 3.0)[seed % 3] * torch.randn(shape, generator=g, dtype=dtype)
    wild = torch.rand(shape, generator=g) < 0.1
    d = torch.where(wild, 30 * (2 * torch.rand(shape, generator=g, dtype=dtype) - 1), d)
    return (ref + d).requires_grad_(True), ref


def value_and_grad(fn, lp, ref):
    """fn's value and d sum(w * fn) / d lp for random weights w (so every token's gradient is seen)."""
    lp = lp.detach().clone().requires_grad_(True)
    v = fn(lp, ref)
    w = torch.rand(v.shape, generator=torch.Generator().manual_seed(7), dtype=v.dtype)
    (g,) = torch.autograd.grad((v * w).sum(), lp, allow_unused=True)
    return v.detach(), torch.zeros_like(lp) if g is None else g


def close(a, b):
    torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", BASE)
def test_matches_verl(name, seed, dtype, flat):
    lp, ref = inputs(seed, dtype, flat)
    ours = value_and_grad(lambda x, r: kl_penalty(x, r, name), lp, ref)
    theirs = value_and_grad(lambda x, r: verl.kl_penalty(x, r, name), lp, ref)
    assert ours[0].dtype == dtype and ours[0].shape == lp.shape
    close(ours[0], theirs[0])
    close(ours[1], theirs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", PLUS)
def test_plus_is_verl_straight_through(name, seed, dtype):
    """verl's kl_penalty hands "k3+" on to kl_penalty_forward, which raises at the commit vendored; its docstring
    and code say: the value of the type, the gradient of k2. That, from verl's own functions."""
    lp, ref = inputs(seed, dtype, flat=False)
    with pytest.raises(NotImplementedError):
        verl.kl_penalty(lp, ref, name)
    ours = value_and_grad(lambda x, r: kl_penalty(x, r, name), lp, ref)
    value = value_and_grad(lambda x, r: verl.kl_penalty_forward(x, r, name[:-1]), lp, ref)[0]
    grad = value_and_grad(lambda x, r: verl.kl_penalty_forward(x, r, "k2"), lp, ref)[1]
    close(ours[0], value)
    close(ours[1], grad)


@pytest.mark.parametrize("name", KL_TYPES)
def test_finite_far_from_the_reference(name):
    """|d| beyond float32's exp range (88): k3's clamp of the log-ratio keeps the value and the gradient finite,
    where exp would give inf and its backward 0 * inf = NaN."""
    ref = torch.tensor([-1.0, -200.0, -1.0, -0.5])
    lp = torch.tensor([-200.0, -1.0, -1000.0, -0.5])
    ours = value_and_grad(lambda x, r: kl_penalty(x, r, name), lp, ref)
    assert all(torch.isfinite(t).all() for t in ours)
    if not name.endswith("+"):
        theirs = value_and_grad(lambda x, r: verl.kl_penalty(x, r, name), lp, ref)
        close(ours[0], theirs[0])
        close(ours[1], theirs[1])


def written(name, lp, ref):
    """The formulas as written in docs/algo.md."""
    d = lp - ref
    if name in ("kl", "k1"):
        return d
    if name in ("mse", "k2"):
        return 0.5 * d ** 2
    if name == "abs":
        return torch.abs(d)
    x = torch.clamp(ref - lp, -20, 20)
    return torch.clamp(torch.exp(x) - x - 1, -10, 10)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", BASE + PLUS)
def test_gradient_is_autograd_of_the_formula(name, seed):
    lp, ref = inputs(seed, torch.float64, flat=False)
    ours = value_and_grad(lambda x, r: kl_penalty(x, r, name), lp, ref)
    base = name.rstrip("+")
    grad_of = "k2" if name.endswith("+") else base
    close(ours[0], value_and_grad(lambda x, r: written(base, x, r), lp, ref)[0])
    close(ours[1], value_and_grad(lambda x, r: written(grad_of, x, r), lp, ref)[1])
    # and in closed form: k1' = 1, k2' = d, abs' = sign(d), k3' = 1 - exp(-d) where neither clamp binds, else 0
    d = (lp - ref).detach()
    w = torch.rand(d.shape, generator=torch.Generator().manual_seed(7), dtype=d.dtype)
    k3 = torch.expm1(-d) + d
    closed = {"k1": torch.ones_like(d), "k2": d, "abs": torch.sign(d),
              "k3": torch.where((d.abs() <= 20) & (k3 <= 10), -torch.expm1(-d), 0.0)}
    close(ours[1], w * closed[check_kl_type(grad_of).rstrip("+")])


@pytest.mark.parametrize("name", KL_TYPES)
def test_zero_at_the_reference(name):
    """The reference is the initial weights, so the KL term starts at exactly 0; so does its gradient, except k1's
    per-token gradient, which is 1 everywhere (zero only in expectation over tokens sampled from pi_theta)."""
    ref = -3 * torch.rand(4, 7, generator=torch.Generator().manual_seed(1))
    v, g = value_and_grad(lambda x, r: kl_penalty(x, r, name), ref.clone(), ref)
    assert (v == 0).all()
    if name in ("kl", "k1"):
        assert (g != 0).all()
    else:
        assert (g == 0).all()


def test_ref_is_detached_and_k3_is_accurate_near_the_reference():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], requires_grad=True)
    kl_penalty(lp, ref, "k3").sum().backward()
    assert ref.grad is None and lp.grad is not None
    # d = 1e-4: k3 = d^2/2 - d^3/6 + ... ~ 5e-9; float32 exp(x) - x - 1 is rounding noise at this size
    d = torch.full((3,), 1e-4)
    exact = 1e-8 / 2 - 1e-12 / 6
    assert kl_penalty(d, torch.zeros(3), "k3")[0].item() == pytest.approx(exact, rel=1e-3)


def test_names():
    assert set(BASE + PLUS) == set(KL_TYPES)
    assert [check_kl_type(n) for n in ("kl", "mse", "low_var_kl", "abs", "k3+", "low_var_kl+", "kl+", "mse+")] == \
        ["k1", "k2", "k3", "abs", "k3+", "k3+", "k1+", "k2"]
    with pytest.raises(ValueError, match="whole vocabulary"):
        check_kl_type("full")
    for bad in ("k4", "K3", "low_var_kl++", ""):
        with pytest.raises(ValueError, match="low_var_kl"):
            check_kl_type(bad)
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(3), "k3")


def test_recipe_options_are_checked():
    from m2po_megatron.config.loading import load_config
    from m2po_megatron.config.schema import ConfigError

    cfg = load_config(None, ["algo.use_kl_loss=true", "algo.kl_loss_type=k3+", "algo.kl_loss_coef=0.01",
                             "algo.entropy_coeff=-0.001"])
    assert check_kl_type(cfg.algo.kl_loss_type) == "k3+"
    for bad, field in ((["algo.kl_loss_type=full"], "whole vocabulary"),
                       (["algo.kl_loss_type=k4"], "algo.kl_loss_type"),
                       (["algo.kl_loss_coef=-0.1"], "algo.kl_loss_coef"),
                       (["algo.kl_loss_coef=.nan"], "algo.kl_loss_coef"),
                       (["algo.entropy_coeff=.inf"], "algo.entropy_coeff")):
        with pytest.raises(ConfigError, match=field):
            load_config(None, bad)
