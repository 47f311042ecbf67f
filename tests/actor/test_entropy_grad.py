"""The per-token entropy of actor.fused_logprobs and actor.logprobs as a differentiable output (the bonus of
`algo.entropy_coeff`): for random losses sum(a * log p + b * H), the gradients to the hidden states and the
output weight (fused) or to the logits (logits-level) equal autograd of the plain formula (logits = h @ W.T,
log_softmax, H = -(p * log p).sum), in fp32 and bf16, over several chunks, with either output alone in the
loss, and at TP2 (two gloo ranks, each holding half the vocabulary). verl's entropy_from_logits and its
chunked variant, run literally (tests/algo/_verl_entropy.py), give the same entropy and entropy gradient.
An entropy left out of the loss costs backward nothing."""
import importlib.util
import pathlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_workers as fw
from m2po_megatron.actor.fused_logprobs import fused_token_log_probs
from m2po_megatron.actor.launch import run_multiprocess
from m2po_megatron.actor.logprobs import token_log_probs

S, H, V, R = 41, 16, 60, 29  # rows, hidden, vocabulary, response rows
CHUNKS = [4 * V * 1, 4 * V * 4, 10**9]  # chunks of 1 and 4 rows (4 does not divide 29), and one chunk


def _verl():
    path = pathlib.Path(__file__).resolve().parents[1] / "algo" / "_verl_entropy.py"
    spec = importlib.util.spec_from_file_location("_verl_entropy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _case(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(S, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7  # logits of scale ~3: far from uniform
    pos = torch.randperm(S, generator=g)[:R]
    tgt = torch.randint(0, V, (R,), generator=g)
    a = torch.randn(R, generator=g, dtype=torch.float64)
    b = torch.randn(R, generator=g, dtype=torch.float64)
    return h.to(dtype), w.to(dtype), pos, tgt, a, b


def _plain(h, w, pos, tgt, a, b):
    """Autograd of the written formula in float64 -> (log p, H, d/dh, d/dW); a or b None: left out."""
    h = h.double().requires_grad_()
    w = w.double().requires_grad_()
    ls = torch.log_softmax(h @ w.t(), -1)[pos]
    lp = ls.gather(-1, tgt[:, None]).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    loss = sum(c.double() @ t for c, t in ((a, lp), (b, ent)) if c is not None)
    loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _fused(h, w, pos, tgt, a, b, chunk_bytes=None):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fused_token_log_probs(h, w, pos, tgt, chunk_bytes=chunk_bytes)
    assert lp.requires_grad and ent.requires_grad
    loss = sum((c.float() * t).sum() for c, t in ((a, lp), (b, ent)) if c is not None)
    loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _close(got, ref, rel, what):
    scale = max(1.0, float(ref.abs().max()))
    err = float((got.double() - ref).abs().max())
    assert err <= rel * scale, (what, err, scale)


@pytest.mark.parametrize("chunk_bytes", CHUNKS)
@pytest.mark.parametrize("terms", ["both", "entropy only", "log-prob only"])
def test_fused_gradients_equal_autograd_of_the_formula_fp32(chunk_bytes, terms):
    h, w, pos, tgt, a, b = _case()
    a = None if terms == "entropy only" else a
    b = None if terms == "log-prob only" else b
    ref = _plain(h, w, pos, tgt, a, b)
    got = _fused(h, w, pos, tgt, a, b, chunk_bytes)
    for name, x, y in zip(("log-prob", "entropy", "hidden grad", "weight grad"), got, ref):
        _close(x, y, 1e-5, name)
    assert float(ref[2].abs().max()) > 0.1  # the gradient under test is not trivially small
    others = torch.ones(S, dtype=torch.bool)
    others[pos] = False
    assert got[2][others].abs().max() == 0  # rows that predict no response token get no gradient


def test_fused_entropy_gradient_is_the_entropy_term():
    """The entropy's share of the gradient is large enough that dropping it would fail the test above."""
    h, w, pos, tgt, a, b = _case(seed=3)
    both = _plain(h, w, pos, tgt, a, b)
    lp_only = _plain(h, w, pos, tgt, a, None)
    assert float((both[2] - lp_only[2]).abs().max()) > 0.1 * float(both[2].abs().max())


def test_fused_gradients_in_bf16_stay_within_rounding():
    """bf16 hidden states and weight: the same bf16 GEMMs, softmax and both gradient terms in fp32, the
    gradients rounded to bf16 (the tolerance of test_fused_logprobs' bf16 test)."""
    h, w, pos, tgt, a, b = _case(seed=1, dtype=torch.bfloat16)
    ref = _plain(h, w, pos, tgt, a, b)
    got = _fused(h, w, pos, tgt, a, b, 4 * V * 5)
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    _close(got[0], ref[0], 2e-2, "log-prob")  # against float64 logits: one bf16 rounding of each logit
    _close(got[1], ref[1], 2e-2, "entropy")
    for name, x, y in zip(("hidden grad", "weight grad"), got[2:], ref[2:]):
        assert float((x.double() - y).abs().max()) <= 2e-2 * float(y.abs().max()), name


@pytest.mark.parametrize("chunk_bytes", [4 * V * 3, 10**9])
def test_logits_level_gradient_equals_autograd_in_float64(chunk_bytes):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(S, V, generator=g, dtype=torch.float64) * 3
    _, _, pos, tgt, a, b = _case(seed=5)
    x = logits.clone().requires_grad_()
    ls = torch.log_softmax(x, -1)[pos]
    (a @ ls.gather(-1, tgt[:, None]).squeeze(-1) + b @ -(ls.exp() * ls).sum(-1)).backward()
    y = logits.float().requires_grad_()
    lp, ent = token_log_probs(y, pos, tgt, chunk_bytes=chunk_bytes)
    ((a.float() * lp).sum() + (b.float() * ent).sum()).backward()
    assert (y.grad.double() - x.grad).abs().max() <= 1e-6 * max(1.0, float(x.grad.abs().max()))
    y2 = logits.float().requires_grad_()  # the entropy alone in the loss
    (b.float() * token_log_probs(y2, pos, tgt, chunk_bytes=chunk_bytes)[1]).sum().backward()
    x2 = logits.clone().requires_grad_()
    ls2 = torch.log_softmax(x2, -1)[pos]
    (b @ -(ls2.exp() * ls2).sum(-1)).backward()
    assert (y2.grad.double() - x2.grad).abs().max() <= 1e-6 * max(1.0, float(x2.grad.abs().max()))


def test_verl_entropy_from_logits_matches_ours_values_and_gradient():
    """verl's entropy_from_logits (float64 logits) and its chunked variant (fp32 inside) against our entropy
    from the same logits in fp32, and the gradient of sum(b * H) through verl's function (autograd) against
    ours."""
    verl = _verl()
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(S, V, generator=g, dtype=torch.float64) * 3
    _, _, pos, tgt, _, b = _case(seed=7)
    x = logits.clone().requires_grad_()
    ref = verl.entropy_from_logits(x[pos])
    (b @ ref).backward()
    chunked = verl.entropy_from_logits_with_chunking(logits[pos].float(), chunk_size=4)
    y = logits.float().requires_grad_()
    _, ent = token_log_probs(y, pos, tgt, chunk_bytes=4 * V * 4)
    (b.float() * ent).sum().backward()
    assert (ent.double() - ref.detach()).abs().max() <= 1e-6
    # the chunked variant computes in fp32 itself (logsumexp minus sum p l, each of size ~10 here): its own
    # rounding against float64 reaches ~1e-6, so against ours (fp32 as well) the bound is 2e-6
    assert (chunked.double() - ent.detach().double()).abs().max() <= 2e-6
    assert (y.grad.double() - x.grad).abs().max() <= 1e-6
    h, w = _case(seed=7)[:2]  # and the fused path against verl on its own logits
    _, ent_f = fused_token_log_probs(h, w, pos, tgt)
    assert (ent_f.double() - verl.entropy_from_logits((h.double() @ w.double().t())[pos])).abs().max() <= 1e-5


class _CountExp(TorchDispatchMode):
    """How many out-of-place exp ops ran (the entropy's gradient term makes one per chunk and block; the
    log-prob's gradient exponentiates in place)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.exp.default
        return func(*args, **(kwargs or {}))


def test_entropy_outside_the_loss_costs_backward_nothing_and_no_vocab_sized_tensor():
    h, w, pos, tgt, a, b = _case(seed=2)
    for use_entropy in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = fused_token_log_probs(hh, ww, pos, tgt, chunk_bytes=4 * V * 4)
        loss = (a.float() * lp).sum() + ((b.float() * ent).sum() if use_entropy else 0.0)
        count, watch = _CountExp(), fw.LargestVocabTensor(V)
        with count, watch:
            loss.backward()
        assert count.n == (8 if use_entropy else 0)  # ceil(29 / 4) chunks, one block each
        assert watch.largest <= max(4 * V, V * H) < R * V  # one chunk of logit rows, or the weight gradient


def _tp2_worker(chunk_bytes):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, half = dist.get_rank(), V // 2
    h, w, pos, tgt, a, b = _case(seed=4)
    logits = (h.double() @ w.double().t()).float()
    x = logits[:, rank * half:(rank + 1) * half].clone().requires_grad_()  # this rank's vocabulary half
    lp, ent = token_log_probs(x, pos, tgt, tp_group=dist.group.WORLD, chunk_bytes=chunk_bytes)
    ((a.float() * lp).sum() + (b.float() * ent).sum()).backward()
    hh = h.clone().requires_grad_()
    ww = w[rank * half:(rank + 1) * half].clone().requires_grad_()
    flp, fent = fused_token_log_probs(hh, ww, pos, tgt, tp_group=dist.group.WORLD, chunk_bytes=chunk_bytes)
    ((a.float() * flp).sum() + (b.float() * fent).sum()).backward()
    dist.destroy_process_group()
    return {"ent": ent.detach(), "logits_grad": x.grad, "fused_ent": fent.detach(), "hidden_grad": hh.grad,
            "weight_grad": ww.grad}


@pytest.mark.timeout(150)
def test_tp2_entropy_gradients_match_the_full_vocabulary():
    """Two gloo ranks, half the vocabulary each, chunks of 5 rows: both paths' entropy and gradients (the
    logits' slice; the hidden states' after the all-reduce; the weight's slice) equal the full formula's."""
    h, w, pos, tgt, a, b = _case(seed=4)
    half = V // 2
    _, ref_ent, ref_h, ref_w = _plain(h, w, pos, tgt, a, b)
    x = (h.double() @ w.double().t()).float().double().requires_grad_()
    ls = torch.log_softmax(x, -1)[pos]
    (a @ ls.gather(-1, tgt[:, None]).squeeze(-1) + b @ -(ls.exp() * ls).sum(-1)).backward()
    out = run_multiprocess(_tp2_worker, 2, args=(4 * half * 5,), timeout=120)
    for rank, res in enumerate(out):
        cols = slice(rank * half, (rank + 1) * half)
        _close(res["ent"], ref_ent, 2e-6, (rank, "entropy"))
        _close(res["fused_ent"], ref_ent, 1e-5, (rank, "fused entropy"))
        _close(res["logits_grad"], x.grad[:, cols], 1e-6, (rank, "logits grad"))
        _close(res["hidden_grad"], ref_h, 1e-5, (rank, "hidden grad"))
        _close(res["weight_grad"], ref_w[cols], 1e-5, (rank, "weight grad"))
