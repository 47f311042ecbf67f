"""The CPU engine on a tiny Qwen3-MoE: per-expert on-disk weight names land in transformers' fused expert
tensors as transformers' own loader puts them, and return_routed_experts records, for every sequence of a
batch, the experts a plain teacher-forced HF forward over prompt + output chooses at every fed position."""
import asyncio
import threading

import numpy as np
import pytest
import torch

from m2po_megatron.rollout import routing
from tests.rollout.conftest import local_server, make_tiny_qwen3_moe

pytestmark = pytest.mark.timeout(300)
LAYERS, TOPK, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe")))


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def teacher_forced_routing(model, tokens) -> np.ndarray:
    """[len(tokens), layers, top_k]: the routers' choices in one plain forward over `tokens`."""
    seen = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out, l=l: seen.__setitem__(l, out[2]))
             for l, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([seen[l] for l in range(len(seen))], dim=1).numpy()


def test_per_expert_names_fill_the_fused_tensors_as_transformers_loads_them(moe_dir, tmp_path):
    from safetensors.torch import load_file

    from m2po_megatron.rollout.engine import Engine

    other = _model(make_tiny_qwen3_moe(tmp_path / "other", seed=1))
    engine = Engine(other)
    try:
        on_disk = load_file(f"{moe_dir}/model.safetensors")
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in on_disk  # the per-expert layout is what we load
        engine.load_weights(sorted(on_disk.items()), "7")
        want = dict(_model(moe_dir).named_parameters())  # transformers' own conversion of the same file
        for name, p in other.named_parameters():
            torch.testing.assert_close(p, want[name], rtol=0, atol=0, msg=name)
        assert engine.weight_version == "7"
        with pytest.raises(ValueError, match="expert 4"):
            engine.load_weights([("model.layers.0.mlp.experts.4.gate_proj.weight", torch.zeros(32, 64))], None)
        with pytest.raises(ValueError, match="shape"):
            engine.load_weights([("model.layers.0.mlp.experts.0.down_proj.weight", torch.zeros(32, 64))], None)
    finally:
        engine.shutdown()


def test_dense_model_refuses_routed_experts(tiny_model_dir):
    from m2po_megatron.rollout.engine import Engine

    with pytest.raises(ValueError, match="MoE router"):
        Engine(_model(tiny_model_dir), return_routed_experts=True)


def _run(engine, jobs):
    """Submit (prompt, SamplingParams, n) jobs together; the finished sequences, in job order."""
    done = threading.Semaphore(0)
    seqs = engine.submit_many([(p, sp, n, lambda s: done.release(), None) for p, sp, n in jobs])
    for _ in range(sum(n for *_, n in jobs)):
        assert done.acquire(timeout=120)
    return [s for group in seqs for s in group]


def test_engine_records_every_fed_position_of_every_batched_sequence(moe_dir):
    from m2po_megatron.rollout.engine import Engine, SamplingParams

    model = _model(moe_dir)
    engine = Engine(model, return_routed_experts=True, deterministic=True)
    try:
        sp = lambda n_new, seed: SamplingParams(max_new_tokens=n_new, ignore_eos=True, sampling_seed=seed)
        # prompts of different lengths prefilled together (left padding), two samples of one prompt (other
        # seeds) sharing one prefill row; then a request after a retraction emptied the batch
        first = _run(engine, [([5, 6, 7, 8, 9], sp(6, 1), 1), ([5, 6, 7, 8, 9], sp(6, 4), 1),
                              ([10, 11], sp(9, 2), 1)])
        engine.pause("retract")  # drop the KV cache: the next request re-prefills prompt + output alike
        engine.resume()
        later = _run(engine, [([12, 13, 14], sp(4, 3), 1)])
    finally:
        engine.shutdown()
    ref = _model(moe_dir)
    for s in first + later:
        tokens = s.prompt + s.out
        got = s.routed_experts().numpy()
        assert got.shape == (routing.expected_rows(len(s.prompt), len(s.out)), LAYERS, TOPK)
        np.testing.assert_array_equal(got, teacher_forced_routing(ref, tokens)[:-1])
        assert routing.routing_problem(got, num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS,
                                       num_tokens=len(tokens) - 1) is None
    assert len({tuple(s.routed_experts().flatten().tolist()) for s in first}) == 3  # distinct records


def test_engine_routing_survives_retraction_mid_sequence(moe_dir):
    """A retracted sequence is prefilled again over prompt + output; its record restarts from that prefill
    and keeps growing by decode, still equal to the teacher-forced routing."""
    from m2po_megatron.rollout.engine import Engine, SamplingParams

    engine = Engine(_model(moe_dir), return_routed_experts=True, deterministic=True)
    done, paused = threading.Event(), threading.Event()
    held: list = []
    step = engine._step

    def step_then_retract_after_4():  # in the engine's own thread, right after the step that made token 4:
        step()                        # no race with the decode loop, whatever the machine's load
        if held and len(held[0].out) >= 4 and not paused.is_set():
            engine.pause("retract")
            paused.set()

    engine._step = step_then_retract_after_4
    try:
        with engine.lock:  # hold the scheduler until the sequence is queued
            [seq] = engine.submit([3, 4, 5], SamplingParams(max_new_tokens=24, ignore_eos=True), 1,
                                  lambda s: done.set())
            held.append(seq)
        assert paused.wait(120)
        retracted_at = len(seq.out)
        engine.resume()
        assert done.wait(120)
    finally:
        engine.shutdown()
    assert retracted_at == 4
    tokens = seq.prompt + seq.out
    np.testing.assert_array_equal(seq.routed_experts().numpy(), teacher_forced_routing(_model(moe_dir), tokens)[:-1])


def test_server_answers_routed_experts_as_sglang(moe_dir, tmp_path):
    """End to end over HTTP: the client asks, the CPU server answers SGLang's base64 int32 rows, the group
    maker attaches them to the samples, and they equal the teacher-forced routing of prompt + response."""
    from m2po_megatron.rollout.client import RolloutClient
    from m2po_megatron.rollout.groups import GroupMaker, RoutingSpec
    from m2po_megatron.rollout.samples import Group

    prompt = [7, 8, 9, 10]
    with local_server(moe_dir, tmp_path, enable_deterministic_inference=True,
                      enable_return_routed_experts=True) as proc:
        async def go():
            async with RolloutClient([proc.url]) as c:
                on = await c.generate(prompt, {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 5}, n=2,
                                      return_routed_experts=True)
                off = await c.generate(prompt, {"max_new_tokens": 3}, n=1)
                return on, off
        on, off = asyncio.run(go())
    assert off[0].routed_experts is None and "routed_experts" not in off[0].meta_info  # not asked: not sent
    maker = GroupMaker(None, None, None, None, {}, n=2, seed=0, routing=RoutingSpec(LAYERS, TOPK, EXPERTS))
    group = maker.fill(Group(group_id="g0", prompt_id="p0", prompt_ids=prompt, answer="1"), on)
    ref = _model(moe_dir)
    for s in group.samples:
        assert s.routing_problem is None and s.routed_experts.dtype == np.int16
        assert s.routed_experts.shape == (len(prompt) + len(s.output_ids) - 1, LAYERS, TOPK)
        np.testing.assert_array_equal(s.routed_experts, teacher_forced_routing(ref, prompt + s.output_ids)[:-1])


def test_server_without_the_flag_ignores_the_field(moe_dir, tmp_path):
    """As SGLang: without --enable-return-routed-experts the request field is accepted and nothing is sent."""
    from m2po_megatron.rollout.client import SyncRolloutClient

    with local_server(moe_dir, tmp_path) as proc:
        client = SyncRolloutClient([proc.url])
        try:
            [r] = client.generate([5, 6], {"max_new_tokens": 2}, return_routed_experts=True, timeout=120)
        finally:
            client.close()
    assert r.finish_reason == "length" and r.routed_experts is None


def test_routing_is_requested_only_for_r3_on_a_moe_model(moe_dir, tiny_model_dir):
    from types import SimpleNamespace

    from m2po_megatron.rollout.groups import RoutingSpec, routing_spec

    cfg = lambda mode, path: SimpleNamespace(algo=SimpleNamespace(routing_replay=mode),
                                             model=SimpleNamespace(hf_path=path))
    assert routing_spec(cfg("r3", moe_dir)) == RoutingSpec(num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
    assert routing_spec(cfg("r2", moe_dir)) is None and routing_spec(cfg("none", moe_dir)) is None
    assert routing_spec(cfg("r3", tiny_model_dir)) is None  # a dense model routes nothing
