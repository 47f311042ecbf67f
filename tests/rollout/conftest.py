"""Fixtures for rollout tests: a tiny random Qwen2 saved to disk, and CPU servers started as real processes."""
import contextlib
import os

import pytest

os.environ.setdefault("M2PO_CPU_SERVER_THREADS", "1")


def make_tiny_qwen2(path, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return str(make_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2")))


@contextlib.contextmanager
def local_server(model_dir, log_dir, **spec_kwargs):
    """A CPU server subprocess (no Ray); stopped on exit even when the test fails."""
    from m2po_megatron.rollout.launcher import ServerProcess, ServerSpec

    max_restarts = spec_kwargs.pop("max_restarts", 0)
    spec = ServerSpec(model_path=str(model_dir), engine="local", **spec_kwargs)
    proc = ServerProcess(spec, os.path.join(str(log_dir), f"server_{spec.port or 'auto'}.log"),
                         max_restarts=max_restarts, health_timeout_s=180)
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


def hf_logprobs(model, prompt, output_ids):
    """The trainer's view: log_softmax of a plain full-sequence forward, gathered at the sampled tokens."""
    import torch

    ids = torch.tensor([list(prompt) + list(output_ids)])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return lp[len(prompt) - 1:-1].gather(-1, torch.tensor(output_ids)[:, None])[:, 0]


def make_tiny_qwen3_moe(path, seed: int = 0):
    """A tiny random Qwen3-MoE (2 layers, 4 experts, top-2) saved to disk. The routers get random weights of
    unit scale (transformers would leave them near zero): distinct, well separated top-k choices per token,
    so a routing comparison is not decided by float ties."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return path
