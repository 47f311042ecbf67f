"""The fake mode's first-level dispatch cache (m2po_megatron.infra.fake_cache): what it builds on a hit is what
torch's uncached dispatch builds (metadata, attributes, the storage it aliases), the allocator model sees the
same bytes with and without it, its check can fail, and a real Megatron step traces the same peak, kinds and
collectives either way."""
from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from m2po_megatron.infra.fake_cache import _NEW, _NoKey
from m2po_megatron.infra.fake_world import RehearsalMode

REPO = Path(__file__).resolve().parents[2]


def _program(w):
    """Ops of every first-level kind: new tensors, views, in-place ops, _unsafe_view (a 3-D matmul), splits
    (lists), unbind (a tuple), and a backward through them."""
    x = torch.empty(4, 8, 16)
    h = x @ w  # mm on a view, then _unsafe_view back to 3-D
    q, k, v = h.split([8, 4, 4], dim=-1)
    parts = h.unbind(0)
    y = (q.permute(1, 0, 2) * 2).reshape(8, -1) + torch.cat([k, v], -1).transpose(0, 1).reshape(8, -1)
    y.add_(1.0)
    z = y.detach().t().contiguous()
    loss = y.float().pow(2).mean() + z.sum() + sum(p.sum() for p in parts)
    loss.backward()
    return loss


def _run(fast: bool, crosscheck: bool = False, rounds: int = 3):
    mode = RehearsalMode(fast_cache=fast, crosscheck=crosscheck)
    with mode:
        w = torch.empty(16, 16, requires_grad=True)
    with mode, mode.saved_as_activations():
        for _ in range(rounds):  # the same shapes again: the rounds after the first hit
            _program(w)
    return mode


def test_hits_build_what_torchs_dispatch_builds():
    checked = _run(fast=True, crosscheck=True)  # every hit re-dispatched without a cache and compared
    assert checked.fast_enabled and checked.fast_hits > 50 and checked.fast_misses > 0
    plain = _run(fast=False)
    assert plain.fast_hits == 0
    fast = _run(fast=True)
    assert (fast.peak, fast.breakdown()) == (plain.peak, plain.breakdown()) and fast.peak > 0


def test_the_crosscheck_can_sample_every_nth_hit():
    every3 = _run(fast=True, crosscheck=3)
    assert every3.fast_hits > 50 and every3.fast_checked == every3.fast_hits // 3
    assert _run(fast=True).fast_checked == 0
    with pytest.raises(ValueError, match="crosscheck = -1"):
        RehearsalMode(crosscheck=-1)


def test_the_crosscheck_fails_on_a_wrong_entry():
    mode = _run(fast=True, crosscheck=True, rounds=1)
    news = [k for k, e in mode._fast.items() if isinstance(e, tuple) and e[0] == _NEW and len(e[1][0]) == 2]
    assert news
    for k in news:  # every new 2-D tensor's entry: one more row
        shape, *rest = mode._fast[k][1]
        mode._fast[k] = (_NEW, ((shape[0] + 1, shape[1]), *rest))
    with pytest.raises(AssertionError, match="first-level cache built"):
        with mode, mode.saved_as_activations():
            _program(torch.empty(16, 16, requires_grad=True))


def test_real_tensors_and_other_arguments_take_torchs_path():
    mode = RehearsalMode(crosscheck=True)
    real = torch.arange(6.0).reshape(2, 3)
    with mode:
        fake = torch.empty(2, 3)
        for _ in range(2):
            mixed = fake + real  # a real tensor among the arguments: no first-level key
    assert isinstance(mixed, torch._subclasses.fake_tensor.FakeTensor) and mixed.shape == (2, 3)
    for args in ((fake, real), (fake, object()), (fake, [fake, real])):  # no first-level key: torch's path
        with pytest.raises(_NoKey):
            mode._fast_key(torch.ops.aten.add.Tensor, args, {})
    assert mode._fast_key(torch.ops.aten.add.Tensor, (fake, fake), {"alpha": 2})  # all fake, plain: a key


def _child(args: dict, out: str) -> None:
    from m2po_megatron.rehearse.stage import child_main

    child_main(args, out)


@pytest.mark.timeout(400)
def test_a_megatron_step_traces_the_same_with_and_without_it(tmp_path):
    """Qwen3-1.7B's recipe (TP2 x DP4, sequence parallel, M2PO) with 2 of its 28 layers and 2 micro-batches:
    torch's cache alone, and the first level with every hit checked against torch's uncached dispatch."""
    from m2po_megatron.config import load_config
    from m2po_megatron.infra.fake_world import fake_world_rank
    from m2po_megatron.rehearse.plan import minibatch_seqs, traced_kwargs

    cfg = json.loads((REPO / "m2po_megatron/assets/configs/Qwen__Qwen3-1.7B-Base/config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = load_config("recipes/paper/qwen3-1.7b-base.yaml", [f"model.hf_config={tmp_path}"], check_files=False)
    kw, _ = traced_kwargs(rc)
    p = rc.parallel
    args = dict(kwargs=kw, rank=fake_world_rank(0, p.tensor_model_parallel_size, p.data_parallel_size),
                world_size=8, minibatch_seqs=minibatch_seqs(rc, 2), max_new_tokens=rc.rollout.max_new_tokens)
    ctx = mp.get_context("spawn")
    res = []
    for fast, check in ((False, False), (True, True)):
        out = tmp_path / f"{fast}.json"
        proc = ctx.Process(target=_child, args=(dict(args, fast_cache=fast, crosscheck=check), str(out)))
        proc.start()
        proc.join(timeout=300)
        if proc.is_alive():
            proc.kill()
            pytest.fail("the rehearsal process did not finish in 300 s")
        r = json.loads(out.read_text())
        assert r["ok"], r.get("traceback")
        res.append(r["result"])
    plain, fast = res
    assert fast["dispatch_cache"]["fast"] and fast["dispatch_cache"]["hits"] > 1000
    assert not plain["dispatch_cache"]["fast"] and plain["microbatches"] >= 2
    for key in ("peak_bytes", "at_peak", "built_bytes", "collectives", "microbatches", "peak_phase"):
        assert fast[key] == plain[key], key


@pytest.mark.timeout(400)
def test_a_moe_step_crosschecks_every_hit_and_traces_as_without_the_cache(tmp_path):
    """The mixture-of-experts path (a tiny Qwen3-MoE in the Qwen3-30B-A3B recipe at TP2 x DP2, EP2, sequence
    parallel: the dispatcher's all-to-all, the experts one by one) through `m2po rehearse`: with
    --fake-cache-crosscheck 1 every first-level hit is dispatched again by torch and compared (a difference fails
    the stage), and --no-fake-cache traces the same peak, parts and collectives with torch's cache alone."""
    import subprocess
    import sys

    cfg = json.loads((REPO / "m2po_megatron/assets/configs/Qwen__Qwen3-30B-A3B-Base/config.json").read_text())
    cfg.update(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, vocab_size=1024)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes/paper/qwen3-30b-a3b.yaml'}\nmodel:\n  hf_config: {tmp_path}\n"
                      "parallel:\n  tensor_model_parallel_size: 2\n  pipeline_model_parallel_size: 1\n"
                      "  data_parallel_size: 2\n  expert_model_parallel_size: 2\n  sequence_parallel: true\n"
                      "rollout:\n  num_servers: 2\ncluster:\n  trainer_nodes: 1\n  gpus_per_node: 4\n")
    # a model this small is mostly the estimate's fixed terms: its error is no subject here
    common = [sys.executable, "-m", "m2po_megatron.cli", "rehearse", str(recipe), "--max-microbatches", "1",
              "--tolerance", "1000", "--format", "json"]
    procs = [subprocess.Popen(common + extra, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in (["--fake-cache-crosscheck", "1"], ["--no-fake-cache"])]
    reps = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the rehearsal did not finish in 300 s")
        assert p.returncode == 0, (out[-2000:], err[-4000:])
        (stage,) = json.loads(out)["stages"]
        reps.append(stage)
    checked, plain = reps
    c = checked["dispatch_cache"]
    assert c["fast"] and c["crosscheck"] == 1 and c["hits"] > 1000 and c["checked"] == c["hits"]
    assert not plain["dispatch_cache"]["fast"] and plain["dispatch_cache"]["hits"] == 0
    assert ("all_to_all_single", "ep") in {(x["call"], x["group"]) for x in checked["collectives"]}
    for key in ("traced_gib", "at_peak_gib", "collectives", "microbatches", "peak_phase", "params"):
        assert checked[key] == plain[key], key
