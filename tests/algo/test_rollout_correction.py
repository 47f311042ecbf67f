"""rollout_correction and ratio_parts: properties (bypass, behaviour == proximal, layouts, bad input) and small
cases worked out by hand. The comparison with verl's and slime's own code is test_rollout_correction_oracles.py."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from m2po_megatron.algo.rollout_correction import (
    CorrectionSpec,
    ratio_parts,
    read_stats,
    rollout_correction,
    split_log_ratio,
)

SPECS = [
    CorrectionSpec("bypass"),
    CorrectionSpec("tis"), CorrectionSpec("tis", "sequence", threshold=1.0),
    CorrectionSpec("mis", threshold=1.2), CorrectionSpec("mis", "sequence", threshold_lower=1.0),
    CorrectionSpec("icepop", threshold=5.0, threshold_lower=0.5),
    CorrectionSpec("geometric", threshold=1.001, threshold_lower=0.999),
    CorrectionSpec("geometric", threshold=1.0, geometric_action="truncate"),
    CorrectionSpec("clip", threshold=1.5), CorrectionSpec("clip", "sequence", threshold_lower=0.0),
    CorrectionSpec("geometric", threshold=1.01, geometric_action="clip"),
    CorrectionSpec("tis", batch_normalize=True), CorrectionSpec("mis", "sequence", batch_normalize=True),
    CorrectionSpec("tis", veto_threshold=1e-4, rejection="seq_max_k3", rejection_threshold=0.5),
    CorrectionSpec("icepop", threshold=5.0, rejection="token_k2", rejection_threshold=0.1),
]


def random_batch(seed, B=5, T=9):
    g = torch.Generator().manual_seed(seed)
    b = -5 * torch.rand(B, T, generator=g)
    d = torch.where(torch.rand(B, T, generator=g) < 0.1, torch.full((B, T), 40.0), torch.randn(B, T, generator=g))
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = False
    return b + d, b, mask


def close(x, expected):
    torch.testing.assert_close(x, torch.tensor(expected, dtype=x.dtype))


def run(p, b, mask, spec, **kw):
    c = rollout_correction(p, b, mask, spec, **kw)
    (m,) = read_stats([c.stats])
    return c, m


@pytest.mark.parametrize("seed", range(4))
def test_bypass_is_weight_one_everywhere(seed):
    p, b, mask = random_batch(seed)
    for prox in (p, None):
        c, m = run(prox, b, mask, CorrectionSpec("bypass"))
        assert torch.equal(c.weights, torch.ones_like(p))
        assert torch.equal(c.keep, mask)
        assert m["rollout_corr/masked_frac"] == 0 and m["rollout_corr/truncated_frac"] == 0
        assert ("rollout_corr/kl_k1" in m) == (prox is not None)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-{s.resolved_level}-{s.geometric_action}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_equal_policies_give_weight_one_and_mask_nothing(spec, dtype):
    _, b, mask = random_batch(7)
    b = b.to(dtype)
    c, m = run(b.clone(), b, mask, spec)
    assert torch.equal(c.weights, torch.ones_like(c.weights))
    assert torch.equal(c.keep, mask)
    assert m["rollout_corr/kl_k1"] == 0 and m["rollout_corr/kl_k3"] == 0
    assert m["rollout_corr/masked_frac"] == 0 and m["rollout_corr/truncated_frac"] == 0
    assert m["rollout_corr/seq_masked_frac"] == 0 and m["rollout_corr/weight_mean"] == 1
    assert all(m[f"rollout_corr/ratio_{k}"] == 1 for k in ("min", "p1", "p50", "p99", "max"))


def test_hand_example_token_level():
    # d = log(p/b) = [log 2, 0, -log 2] -> w = [2, 1, 1/2]. k1 = mean(-d) = 0. k3 = mean(e^d - 1 - d) =
    # ((1 - log 2) + 0 + (-1/2 + log 2)) / 3 = 1/6. Quantiles (linear, as torch.quantile) of [1/2, 1, 2]:
    # p1 at position 0.02 -> 1/2 + 0.02 * 1/2 = 0.51; p50 = 1; p99 at 1.98 -> 1 + 0.98 = 1.98.
    b = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    p = b + torch.tensor([[math.log(2), 0.0, -math.log(2)]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    c, m = run(p, b, mask, CorrectionSpec("tis", threshold=1.5))
    close(c.weights, [[1.5, 1.0, 0.5]])
    assert m["rollout_corr/kl_k1"] == pytest.approx(0, abs=1e-15)
    assert m["rollout_corr/kl_k3"] == pytest.approx(1 / 6)
    assert [m[f"rollout_corr/ratio_{k}"] for k in ("min", "p1", "p50", "p99", "max")] == pytest.approx(
        [0.5, 0.51, 1.0, 1.98, 2.0])
    assert m["rollout_corr/truncated_frac"] == pytest.approx(1 / 3)
    assert m["rollout_corr/weight_mean"] == pytest.approx(1.0)  # (1.5 + 1 + 0.5) / 3
    # mis with C = 1.5: band [2/3, 3/2] keeps only the middle token; the sequence counts as masked.
    c, m = run(p, b, mask, CorrectionSpec("mis", threshold=1.5))
    assert c.keep.tolist() == [[False, True, False]] and c.weights.tolist() == [[0.0, 1.0, 0.0]]
    assert m["rollout_corr/masked_frac"] == pytest.approx(2 / 3) and m["rollout_corr/seq_masked_frac"] == 1
    # Sequence level: the product 2 * 1 * 1/2 = 1, as is the geometric mean: nothing truncated or dropped.
    for spec in (CorrectionSpec("tis", "sequence", threshold=1.5), CorrectionSpec("mis", "sequence", threshold=1.5),
                 CorrectionSpec("geometric", threshold=1.5)):
        c, m = run(p, b, mask, spec)
        close(c.weights, [[1.0, 1.0, 1.0]])
        assert c.keep.all()


def test_hand_example_sequences_and_padding():
    # Row 0: d = [log 2, log 2, (pad: 5)] -> product 4, geometric mean 2. Row 1: d = [0, (pad), (pad)].
    # Row 2: all padding. tis sequence C = 3: row 0 weight 3 (truncated, 2 tokens), row 1 weight 1.
    # geometric mask, C = 1.5: row 0 (2 > 1.5) dropped, row 1 kept: 2 of 3 valid tokens, 1 of 2 sequences.
    l2 = math.log(2)
    b = torch.zeros(3, 3, dtype=torch.float64)
    p = torch.tensor([[l2, l2, 5.0], [0.0, 9.0, 9.0], [9.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    c, m = run(p, b, mask, CorrectionSpec("tis", "sequence", threshold=3.0))
    close(c.weights, [[3, 3, 1], [1, 1, 1], [1, 1, 1]])
    assert m["rollout_corr/truncated_frac"] == pytest.approx(2 / 3)
    assert m["rollout_corr/count_seqs"] == 2 and m["rollout_corr/count_tokens"] == 3
    c, m = run(p, b, mask, CorrectionSpec("geometric", threshold=1.5))
    assert c.keep.tolist() == [[False, False, False], [True, False, False], [False, False, False]]
    assert m["rollout_corr/masked_frac"] == pytest.approx(2 / 3) and m["rollout_corr/seq_masked_frac"] == 0.5
    c, _ = run(p, b, mask, CorrectionSpec("geometric", threshold=1.5, geometric_action="truncate"))
    close(c.weights, [[1.5, 1.5, 1], [1, 1, 1], [1, 1, 1]])


def test_sequence_weight_is_clamped_in_log_space():
    # 30 tokens with d = 2 each: the product e^60 overflows float32; the log-weight is clamped to 20 first.
    b = torch.zeros(1, 30)
    p = torch.full((1, 30), 2.0)
    mask = torch.ones(1, 30, dtype=torch.bool)
    c, m = run(p, b, mask, CorrectionSpec("tis", "sequence", threshold=1e12))
    assert torch.allclose(c.weights, torch.full((1, 30), math.exp(20)), rtol=1e-6)
    assert math.isfinite(m["rollout_corr/weight_mean"])


@pytest.mark.parametrize("spec", SPECS[1:], ids=lambda s: f"{s.mode}-{s.resolved_level}-{s.geometric_action}")
def test_flat_layout_equals_padded(spec):
    p, b, mask = random_batch(3)
    c, m = run(p, b, mask, spec)
    # The same tokens flat, in a shuffled order, with sparse ids: the same weights per token.
    perm = torch.randperm(p.numel(), generator=torch.Generator().manual_seed(0))
    ids = (torch.arange(p.shape[0]).unsqueeze(1).expand_as(p).reshape(-1) * 7 + 3)[perm]
    cf, mf = run(p.reshape(-1)[perm], b.reshape(-1)[perm], mask.reshape(-1)[perm], spec, seq_ids=ids)
    assert torch.equal(cf.keep, c.keep.reshape(-1)[perm])
    torch.testing.assert_close(cf.weights, c.weights.reshape(-1)[perm], rtol=1e-6, atol=0)
    assert mf == pytest.approx(m, rel=1e-6, nan_ok=True)


def test_flat_token_level_needs_no_sequences_and_sequence_level_does():
    p, b, mask = (x.reshape(-1) for x in random_batch(1))
    c, m = run(p, b, mask, CorrectionSpec("mis"))
    assert "rollout_corr/seq_masked_frac" not in m and c.keep.shape == p.shape
    with pytest.raises(ValueError, match="seq_ids"):
        rollout_correction(p, b, mask, CorrectionSpec("tis", "sequence"))


def test_nonfinite_input_is_dropped_then_raises_on_read():
    p, b, mask = random_batch(2)
    mask[1, 0] = True
    p[1, 0] = math.nan
    c = rollout_correction(p, b, mask, CorrectionSpec("tis"))
    assert not c.keep[1, 0] and torch.isfinite(c.weights).all()
    with pytest.raises(ValueError, match="proximal contains NaN or inf at 1 valid token"):
        read_stats([c.stats])
    b[1, 0] = math.inf  # behaviour alone, in bypass without proximal
    with pytest.raises(ValueError, match="behaviour contains NaN or inf"):
        read_stats([rollout_correction(None, b, mask, CorrectionSpec()).stats])


@pytest.mark.parametrize("kwargs, field", [
    (dict(mode="is"), "mode"), (dict(mode="tis", level="seq"), "level"),
    (dict(mode="icepop", level="sequence"), "level"), (dict(mode="geometric", level="token"), "level"),
    (dict(mode="geometric", geometric_action="cap"), "geometric_action"),
    (dict(mode="tis", veto_threshold=1.5), "veto_threshold"), (dict(mode="bypass", batch_normalize=True), "mode"),
    (dict(mode="tis", rejection="seq_max_k1", rejection_threshold=0.1), "rejection"),
    (dict(mode="tis", rejection="seq_max_k3"), "rejection"),
    (dict(mode="tis", rejection="token_k2", rejection_threshold=-1.0), "rejection_threshold"),
    (dict(mode="tis", threshold=0.5), "threshold"), (dict(mode="tis", threshold=math.inf), "threshold"),
    (dict(mode="tis", threshold=True), "threshold"), (dict(mode="mis", threshold=1.0), "threshold"),
    (dict(mode="mis", threshold=2.0, threshold_lower=1.5), "threshold_lower"),
    (dict(mode="mis", threshold=2.0, threshold_lower=-0.1), "threshold_lower"),
    (dict(mode="tis", threshold=2.0, threshold_lower=0.5), "threshold_lower"),  # tis truncates from above only
    (dict(mode="geometric", geometric_action="truncate", threshold_lower=0.9), "threshold_lower"),
    (dict(mode="bypass", threshold_lower=0.5), "threshold_lower"), (dict(mode="bypass", level="token"), "level"),
])
def test_bad_spec_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"rollout_correction\.{field}[ =]"):
        CorrectionSpec(**kwargs)


def test_correction_needs_proximal_outside_bypass():
    _, b, mask = random_batch(0)
    with pytest.raises(ValueError, match="needs the proximal log-probs"):
        rollout_correction(None, b, mask, CorrectionSpec("tis"))
    with pytest.raises(ValueError, match="shape"):
        rollout_correction(b[:, :-1], b, mask, CorrectionSpec("tis"))


def test_weights_and_keep_are_detached():
    p, b, mask = random_batch(0)
    p.requires_grad_()
    c = rollout_correction(p, b, mask, CorrectionSpec("tis"))
    assert not c.weights.requires_grad and not c.keep.requires_grad


def test_split_log_ratio_and_parts_by_hand():
    # t - p = [0.5, -0.25], p - b = [0.25, 0.25] (third token masked): total = [0.75, 0].
    # drift: mean 0.125, m2 (0.25 + 0.0625) / 2 = 0.15625; mismatch: mean 0.25, m2 0.0625; total: mean 0.375,
    # m2 0.28125; cross = (0.125 - 0.0625) / 2 = 0.03125, and 0.15625 + 0.0625 + 2 * 0.03125 = 0.28125.
    b = torch.tensor([-1.0, -2.0, -3.0])
    p = b + torch.tensor([0.25, 0.25, 7.0])
    t = (p + torch.tensor([0.5, -0.25, 1.0])).requires_grad_()
    drift, mismatch = split_log_ratio(t, p, b)
    assert drift.requires_grad and not mismatch.requires_grad
    torch.testing.assert_close(drift + mismatch, t - b)
    (m,) = read_stats([ratio_parts(t, p, b, torch.tensor([True, True, False]))])
    assert m == pytest.approx({
        "ratio_parts/count_tokens": 2, "ratio_parts/drift_mean": 0.125, "ratio_parts/drift_m2": 0.15625,
        "ratio_parts/mismatch_mean": 0.25, "ratio_parts/mismatch_m2": 0.0625, "ratio_parts/total_mean": 0.375,
        "ratio_parts/total_m2": 0.28125, "ratio_parts/cross": 0.03125})


def test_read_stats_reads_several_at_once():
    p, b, mask = random_batch(5)
    stats = [rollout_correction(p, b, mask, s).stats for s in SPECS[:3]] + [ratio_parts(p, p, b, mask)]
    out = read_stats(stats)
    assert [read_stats([s])[0] for s in stats] == out
    assert out[3]["ratio_parts/drift_m2"] == 0


def test_no_host_read_in_the_compute_path(monkeypatch):
    # CPU stand-in for the CUDA sync check below: every Python-level read of a tensor's value (bool, item,
    # int, float, tolist) and every torch.tensor (a host-to-device copy on CUDA) raises while the functions run.
    p, b, mask = random_batch(4)
    ids = torch.arange(p.shape[0]).unsqueeze(1).expand_as(p).reshape(-1)

    def boom(*args, **kwargs):
        raise AssertionError("host read in the compute path")

    with monkeypatch.context() as mp:
        for name in ("__bool__", "item", "__int__", "__float__", "tolist"):
            mp.setattr(torch.Tensor, name, boom)
        mp.setattr(torch, "tensor", boom)
        for spec in SPECS:
            rollout_correction(p, b, mask, spec)
            rollout_correction(p.reshape(-1), b.reshape(-1), mask.reshape(-1), spec, seq_ids=ids,
                               num_seq_ids=p.shape[0])
        rollout_correction(None, b, mask, CorrectionSpec())
        ratio_parts(p, p, b, mask)


@pytest.mark.gpu
def test_no_host_sync_on_cuda():  # the gpu marker skips it without CUDA (tests/conftest.py)
    p, b, mask = (x.cuda() for x in random_batch(4))
    for spec in SPECS:
        rollout_correction(p, b, mask, spec)  # warm-up: allocations and kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for spec in SPECS:
            rollout_correction(p, b, mask, spec)
        ratio_parts(p, p, b, mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@settings(max_examples=200, deadline=None)
@given(spec=st.sampled_from(SPECS), rows=st.integers(1, 6), cols=st.integers(1, 10), density=st.floats(0, 1),
       seed=st.integers(0, 10_000), flat=st.booleans())
def test_every_option_handles_every_batch_shape(spec, rows, cols, density, seed, flat):
    """Issue 35: any option, on any shape a step can produce (one token, empty sequences, nothing valid at
    all, padded or flat): finite weights, kept tokens among the valid ones, metrics that read."""
    g = torch.Generator().manual_seed(seed)
    b = -5 * torch.rand(rows, cols, generator=g)
    p = b + 3 * torch.randn(rows, cols, generator=g)
    mask = torch.rand(rows, cols, generator=g) < density
    kw = {}
    if flat:
        kw = dict(seq_ids=torch.arange(rows).repeat_interleave(cols)[mask.reshape(-1)], num_seq_ids=rows)
        p, b, mask = p[mask], b[mask], torch.ones(int(mask.sum()), dtype=torch.bool)
    c = rollout_correction(p, b, mask, spec, **kw)
    (m,) = read_stats([c.stats])
    assert torch.isfinite(c.weights).all() and not (c.keep & ~mask).any()
    assert (c.weights[mask & ~c.keep] == 0).all() and all(math.isfinite(v) for k, v in m.items()
                                                           if not k.startswith("rollout_corr/ratio_"))
