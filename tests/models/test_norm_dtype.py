"""Norm weights are built in the params dtype (models/norm.py): torch.nn.RMSNorm would otherwise be fp32 in a
bf16 model, which makes torch refuse its fused RMSNorm kernel on CUDA."""
import pytest
import torch

from tiny import make_hf_model, tiny_config


@pytest.fixture(scope="module")
def megatron_tp1():
    from m2po_megatron.actor import parallel

    torch.set_num_threads(1)
    parallel.init_distributed()
    yield
    parallel.destroy_distributed()


def _norms(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm))}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["sdpa", "local"])
def test_bf16_model_norm_weights_are_bf16_and_take_hf_weights(megatron_tp1, backend):
    from m2po_megatron import models

    cfg = tiny_config("qwen3")  # q/k norms too
    model = models.build_gpt_model(cfg, models.transformer_config_from_hf(cfg, params_dtype="bf16"),
                                   attention_backend=backend)
    norms = _norms(model)
    layers = cfg["num_hidden_layers"]
    # input, pre-MLP, q and k norm per layer, and the final norm
    assert len(norms) == 4 * layers + 1, sorted(norms)
    assert "decoder.final_layernorm" in norms
    assert {p.dtype for m in norms.values() for p in m.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # HF's bf16 norm weights load bit-exactly (bf16 -> bf16) and come back out of the export unchanged.
    from m2po_megatron.convert.export import iter_hf_tensors

    hf = make_hf_model(cfg).to(torch.bfloat16)
    models.load_hf_weights(model, hf)
    back = dict(iter_hf_tensors([model], models.read_hf_config(cfg)))
    ref = hf.state_dict()
    norm_keys = [k for k in ref if "norm" in k]
    assert len(norm_keys) == 4 * layers + 1
    for k in norm_keys:
        assert back[k].dtype == torch.bfloat16 and torch.equal(back[k], ref[k]), k
    ids = torch.randint(0, cfg["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=torch.arange(24)[None], attention_mask=None)
        ref_logits = hf(input_ids=ids).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    # bf16 against bf16 HF: the same model up to bf16 rounding (a wrong norm weight moves logits by O(1))
    assert (out.float() - ref_logits.float()).abs().max().item() < 0.25


@pytest.mark.timeout(100)
def test_fp32_model_norm_weights_stay_fp32(megatron_tp1):
    from m2po_megatron import models

    cfg = tiny_config("qwen2_untied")
    model = models.build_gpt_model(cfg, models.transformer_config_from_hf(cfg, params_dtype="fp32"))
    assert {p.dtype for m in _norms(model).values() for p in m.parameters()} == {torch.float32}


def test_the_swiglu_fusion_is_on_where_torch_compile_can_build_and_off_with_a_warning_where_it_cannot(
        monkeypatch):
    """A CPU with a C++ compiler runs megatron's compiled SwiGLU, like a GPU; without one (inductor's compiler
    is not there) the fusion is off, with a warning naming the fix, instead of failing at the first step."""
    import warnings

    import torch._inductor.config as inductor_config

    from m2po_megatron.models.builder import can_compile

    assert can_compile(True)
    assert can_compile(False)  # this machine has g++ (the suite's CPU compile tests need it too)
    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/c++"))  # what CXX=... sets
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not can_compile(False)
    assert any("install g++" in str(x.message) for x in w)
