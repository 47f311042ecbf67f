"""model.moe_grouped_gemm: a MoE layer's local experts as one grouped GEMM (models/grouped_experts.py) equal
megatron's SequentialMLP with the same weights: logits and gradients (fp32, CPU), under R3 routing replay, and
through conversion (HF -> Megatron -> HF, and dist checkpoints shared with SequentialMLP). One process, TP1."""
import re

import pytest
import torch

from tiny import make_hf_model, tiny_config

TOL = 1e-5
SEQ = 40


@pytest.fixture(scope="module")
def world():
    from m2po_megatron.actor import parallel

    torch.set_num_threads(1)
    parallel.init_distributed()
    yield
    parallel.destroy_distributed()


@pytest.fixture(scope="module")
def pair(world):
    """(cfg, hf model, SequentialMLP model, grouped model), both Megatron models loaded from the same HF weights."""
    from m2po_megatron import models

    cfg = tiny_config("qwen3_moe")
    hf = make_hf_model(cfg)
    out = []
    for grouped in (False, True):
        tc = models.transformer_config_from_hf(cfg, moe_grouped_gemm=grouped, routing_replay=True)
        m = models.build_gpt_model(cfg, tc)
        models.load_hf_weights(m, hf)
        out.append(m)
    return cfg, hf, *out


def _ids(cfg):
    ids = torch.randint(0, cfg["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(5))
    return ids, torch.arange(SEQ).unsqueeze(0)


def _grads(model) -> dict:
    """Every gradient under one name per expert matrix: SequentialMLP's local_experts.{e}.linear_fcN and the
    grouped [experts, ...] tensor's slice e alike."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        x = re.match(r"(.*mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$", n)
        if x:
            out[f"{x.group(1)}{x.group(3)}.{x.group(2)}"] = g
        elif re.search(r"mlp\.experts\.linear_fc[12]\.weight$", n):
            for e in range(g.shape[0]):
                out[f"{n[:-len('.weight')]}.{e}"] = g[e]
        else:
            out[n] = g
    return out


def _forward_backward(model, ids, pos):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, attention_mask=None)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    (logits * w).sum().backward()
    return logits.detach(), _grads(model)


def _assert_same(a, b, tol=TOL):
    la, ga = a
    lb, gb = b
    assert (la - lb).abs().max().item() <= tol
    assert sorted(ga) == sorted(gb)
    for k in ga:
        assert (ga[k] - gb[k]).abs().max().item() <= tol, k


def test_grouped_module_equals_sequential_mlp_with_an_idle_expert(world):
    """The experts module alone, fed as megatron's dispatcher feeds it (tokens sorted by expert, one expert
    without tokens): outputs and the input's and weights' gradients equal SequentialMLP's."""
    from megatron.core.models.gpt import gpt_layer_specs as s
    from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection

    from m2po_megatron import models
    from m2po_megatron.models.grouped_experts import GroupedExperts

    cfg = tiny_config("qwen3_moe")
    tc = models.transformer_config_from_hf(cfg)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    moe = s.get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm").submodules.mlp
    seq = moe.keywords["submodules"].experts(4, tc, pg_collection=pgs)
    grp = GroupedExperts(4, tc, pg_collection=pgs)
    with torch.no_grad():
        for e, expert in enumerate(seq.local_experts):
            grp.linear_fc1.weight[e].copy_(expert.linear_fc1.weight)
            grp.linear_fc2.weight[e].copy_(expert.linear_fc2.weight)
    counts = torch.tensor([5, 0, 7, 3])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(int(counts.sum()), 64, generator=g)
    probs = torch.rand(int(counts.sum()), generator=g)
    outs = []
    for mod in (seq, grp):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, bias = mod(xi, counts, pi)
        assert bias is None
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y.detach(), xi.grad, pi.grad))
    for a, b in zip(*outs):
        assert (a - b).abs().max().item() <= TOL
    for e, expert in enumerate(seq.local_experts):
        assert (grp.linear_fc1.weight.grad[e] - expert.linear_fc1.weight.grad).abs().max().item() <= TOL
        assert (grp.linear_fc2.weight.grad[e] - expert.linear_fc2.weight.grad).abs().max().item() <= TOL
    assert grp.linear_fc1.weight.grad[1].abs().max().item() == 0.0  # the idle expert


def test_grouped_linear_kernel_path_matches_the_loop_in_bf16():
    """The grouped-kernel branch (what runs on a CUDA GPU: torch's grouped_mm with int32 offsets) against the
    per-expert loop, run here with torch's CPU grouped_mm where this torch has it; bf16, an idle expert."""
    from m2po_megatron.models.grouped_experts import grouped_linear

    g = torch.Generator().manual_seed(2)
    counts = [6, 0, 9, 1]
    x = torch.randn(sum(counts), 32, generator=g).bfloat16()
    w = (torch.randn(4, 48, 32, generator=g) / 6).bfloat16()
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    res = []
    for offs in (None, offsets):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        try:
            y = grouped_linear(xi, wi, counts, offs)
            y.float().square().sum().backward()
        except (RuntimeError, NotImplementedError) as e:  # no CPU kernel in this torch build
            pytest.skip(f"torch has no CPU grouped_mm here: {e}")
        res.append((y.float(), xi.grad.float(), wi.grad.float()))
    for a, b in zip(*res):
        assert (a - b).abs().max().item() <= 0.02 * max(1.0, a.abs().max().item())


def test_logits_and_gradients_equal_sequential_mlp(pair):
    cfg, hf, seq, grp = pair
    ids, pos = _ids(cfg)
    a, b = _forward_backward(seq, ids, pos), _forward_backward(grp, ids, pos)
    _assert_same(a, b)
    with torch.no_grad():
        assert (b[0] - hf(input_ids=ids).logits).abs().max().item() <= TOL
    assert any(k.endswith("linear_fc1.3") and v.abs().max() > 0 for k, v in b[1].items())  # experts got gradients


def test_r3_replay_routes_the_grouped_experts_as_sequential(pair):
    """R3 targets unlike the routers' own choice: both models dispatch every token to its target experts (the
    routers' load is the targets' histogram) and give the same logits and gradients, unlike without replay."""
    from m2po_megatron.actor.routing_replay import RoutingReplay

    cfg, _, seq, grp = pair
    ids, pos = _ids(cfg)
    t = torch.arange(SEQ)
    targets = torch.stack([torch.stack([(t + i) % 4, (t + i + 1 + t % 2) % 4], 1) for i in range(2)], 1)  # [S, L, k]
    free = _forward_backward(grp, ids, pos)
    runs = []
    for m in (seq, grp):
        replay = RoutingReplay([m], mode="r3", num_experts=4, topk=2, recompute=False)
        for _, h in replay.layers:
            h.apply, h.count = True, True
        replay.before_forward(targets)
        runs.append(_forward_backward(m, ids, pos))
        for j, (_, h) in enumerate(replay.layers):
            want = torch.bincount(targets[:, j].flatten(), minlength=4)
            assert torch.equal(h.load.cpu(), want)
            assert int(h.counts[0, 0]) == SEQ and int(h.counts[0, 1]) > 0  # replayed, and unlike own routing
        for _, h in replay.layers:
            h.apply, h.count, h.target = False, False, None
    _assert_same(*runs)
    assert (runs[1][0] - free[0]).abs().max().item() > 1e-3


def test_conversion_round_trip_and_checkpoints_shared_with_sequential(pair, tmp_path):
    """HF -> grouped Megatron -> HF is exact under HF's names; a dist checkpoint saved from the grouped model
    converts back to the same HF tensors (megatron_to_hf reads it with SequentialMLP's layout) and loads into a
    SequentialMLP model, and one saved from SequentialMLP loads into the grouped model."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    from m2po_megatron import models
    from m2po_megatron.convert.checkpoint import load_megatron_checkpoint, megatron_to_hf
    from m2po_megatron.convert.export import gather_hf_state_dict
    from m2po_megatron.models.hf_checkpoint import on_disk_state_dict
    from m2po_megatron.models.weights import expected_hf_names

    cfg, hf, seq, grp = pair
    want = on_disk_state_dict(hf)
    got = gather_hf_state_dict(grp, cfg)
    assert sorted(got) == sorted(expected_hf_names(models.read_hf_config(cfg)))
    assert all(torch.equal(got[k], want[k]) for k in got)

    (tmp_path / "hf").mkdir()
    hf.config.save_pretrained(tmp_path / "hf")
    saved = tmp_path / "grouped_ckpt"
    saved.mkdir()
    dist_checkpointing.save({"model": grp.sharded_state_dict()}, str(saved))
    out = megatron_to_hf(str(saved), str(tmp_path / "back"), hf_config=str(tmp_path / "hf"))
    back = {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(load_file(str(f)))
    assert sorted(back) == sorted(got) and all(torch.equal(back[k], want[k]) for k in back), out

    fresh = [models.build_gpt_model(cfg, models.transformer_config_from_hf(cfg, moe_grouped_gemm=g))
             for g in (False, True)]
    load_megatron_checkpoint(fresh[0], str(saved))
    seq_saved = tmp_path / "seq_ckpt"
    seq_saved.mkdir()
    dist_checkpointing.save({"model": seq.sharded_state_dict()}, str(seq_saved))
    load_megatron_checkpoint(fresh[1], str(seq_saved))
    for m in fresh:
        assert all(torch.equal(v, want[k]) for k, v in gather_hf_state_dict(m, cfg).items())


def test_flag_on_a_dense_model_is_refused(world):
    from m2po_megatron import models

    with pytest.raises(ValueError, match="moe_grouped_gemm.*dense"):
        models.transformer_config_from_hf(tiny_config("qwen3"), moe_grouped_gemm=True)


def test_config_refuses_the_flag_on_a_dense_model_and_takes_it_on_a_moe_model():
    from tiny import CONFIGS

    from m2po_megatron.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.moe_grouped_gemm = true .* Qwen3ForCausalLM is dense"):
        load_config(None, [f"model.hf_config={CONFIGS / 'Qwen__Qwen3-8B-Base'}", "model.moe_grouped_gemm=true"])
    cfg = load_config(None, [f"model.hf_config={CONFIGS / 'Qwen__Qwen3-30B-A3B-Base'}", "model.moe_grouped_gemm=true",
                             "parallel.data_parallel_size=8", "parallel.expert_model_parallel_size=8",
                             "cluster.gpus_per_node=8"], check_files=False)
    assert cfg.model.moe_grouped_gemm is True
