"""actor.logprobs.token_log_probs: chunked fp32 log-probs and entropy from vocabulary-parallel logits, against
float64 log_softmax, at TP1 (in-process) and TP2 (two gloo processes holding half the vocabulary each)."""
import pytest
import torch

from m2po_megatron.actor.launch import run_multiprocess
from m2po_megatron.actor.logprobs import token_log_probs


def _case(seed=0, s=29, v=40, r=17):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(s, v, generator=g, dtype=torch.float64) * 4
    pos = torch.randperm(s, generator=g)[:r]
    tgt = torch.randint(0, v, (r,), generator=g)
    w = torch.randn(r, generator=g, dtype=torch.float64)
    return logits, pos, tgt, w


def _reference(logits, pos, tgt, w):
    x = logits.clone().requires_grad_()
    ls = torch.log_softmax(x, -1)[pos]
    lp = ls.gather(-1, tgt[:, None]).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    (lp * w).sum().backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("chunk_bytes", [10**9, 4 * 40 * 3])  # one chunk; chunks of 3 rows
def test_log_probs_entropy_and_gradient_match_float64(chunk_bytes):
    logits, pos, tgt, w = _case()
    ref_lp, ref_ent, ref_grad = _reference(logits, pos, tgt, w)
    x = logits.float().requires_grad_()
    lp, ent = token_log_probs(x, pos, tgt, chunk_bytes=chunk_bytes)
    assert lp.dtype == ent.dtype == torch.float32 and ent.requires_grad
    (lp * w.float()).sum().backward()
    assert (lp.double() - ref_lp).abs().max() <= 2e-6
    assert (ent.double() - ref_ent).abs().max() <= 2e-6
    assert (x.grad.double() - ref_grad).abs().max() <= 1e-6
    others = torch.ones(logits.shape[0], dtype=torch.bool)
    others[pos] = False
    assert x.grad[others].abs().max() == 0  # rows that predict no response token get no gradient


def test_bf16_logits_keep_their_dtype_and_nothing_vocab_sized_is_saved():
    """bf16 in, bf16 gradient out; for backward the op keeps the logits themselves (no copy) and a few
    vectors per response token, not an fp32 [R, V] softmax as megatron's cross-entropy does."""
    logits, pos, tgt, w = _case(s=64, v=1000, r=50)
    x = logits.to(torch.bfloat16).requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = token_log_probs(x, pos, tgt)
    others = [t for t in saved if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()]
    assert any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)
    assert sum(t.untyped_storage().nbytes() for t in others) <= 32 * pos.numel()
    (lp * w.float()).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    ref_lp, _, ref_grad = _reference(x.detach().double(), pos, tgt, w)
    assert (lp.double() - ref_lp).abs().max() <= 1e-5  # same bf16 inputs, fp32 arithmetic
    assert (x.grad.double() - ref_grad).abs().max() <= 1e-2  # the gradient rounded to bf16


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="logits must be"):
        token_log_probs(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        token_log_probs(torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long))


def _tp2_worker(chunk_bytes):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    logits, pos, tgt, w = _case(seed=4, v=40)
    x = logits.float()[:, rank * 20:(rank + 1) * 20].clone().requires_grad_()  # this rank's vocabulary half
    lp, ent = token_log_probs(x, pos, tgt, tp_group=dist.group.WORLD, chunk_bytes=chunk_bytes)
    (lp * w.float()).sum().backward()
    dist.destroy_process_group()
    return lp, ent, x.grad


@pytest.mark.timeout(120)
def test_vocab_parallel_tp2_matches_the_full_vocabulary():
    logits, pos, tgt, w = _case(seed=4, v=40)
    ref_lp, ref_ent, ref_grad = _reference(logits, pos, tgt, w)
    out = run_multiprocess(_tp2_worker, 2, args=(4 * 20 * 5,), timeout=100)
    for rank, (lp, ent, grad) in enumerate(out):
        assert (lp.double() - ref_lp).abs().max() <= 2e-6
        assert (ent.double() - ref_ent).abs().max() <= 2e-6
        assert (grad.double() - ref_grad[:, rank * 20:(rank + 1) * 20]).abs().max() <= 1e-6
