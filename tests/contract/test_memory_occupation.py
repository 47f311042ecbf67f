"""Colocation's requests against SGLang 0.5.23: every body the project sends to release and resume memory and
to update weights from tensors is one SGLang's HTTP layer parses, and the tensors' wire form is SGLang's
MultiprocessingSerializer's, both ways."""
import pytest
import torch

from tests.contract.conftest import running_cpu_server

pytestmark = pytest.mark.timeout(300)


def _named():
    torch.manual_seed(0)
    base = torch.randn(4, 6)
    return [("a.weight", torch.randn(3, 5)), ("b.bias", torch.randn(7).to(torch.bfloat16)),
            ("c.ids", torch.arange(5)), ("d.view", base[1:, 2:]), ("e.t", torch.randn(2, 3).t())]


@pytest.fixture
def file_system_sharing():
    """SGLang's serializer pickles under the process's sharing strategy; the one a server in another process
    can open is file_system (memory_occupation.py)."""
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    yield
    mp.set_sharing_strategy(before)


def _same(a, b):
    assert [n for n, _ in a] == [n for n, _ in b]
    for (n, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), n


def test_serialize_named_tensors_is_sglangs_wire_form(file_system_sharing):
    from sglang.srt.utils import MultiprocessingSerializer

    from m2po_megatron.rollout.memory_occupation import serialize_named_tensors
    from m2po_megatron.rollout.server_memory import load_named_tensors

    named = _named()
    ours = serialize_named_tensors(named)
    theirs = MultiprocessingSerializer.serialize(named, output_str=True)
    assert ours == theirs  # the same bytes for the same tensors
    _same(MultiprocessingSerializer.deserialize(ours), named)  # SGLang's (safe) reader takes ours
    _same(load_named_tensors(theirs), named)  # our restricted reader takes SGLang's


def test_every_colocation_request_is_accepted_by_sglang(sglang_http, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from m2po_megatron.rollout.memory_occupation import (KV, TAGS_ALL, WEIGHTS, release_memory, resume_memory,
                                                         serialize_named_tensors, update_weights_from_tensor)
    from tests.contract.test_traffic import RecordingProxy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    with running_cpu_server(tiny_model_dir, tmp_path / "server.log") as url:
        proxy = RecordingProxy(url)
        try:  # one colocated swap, as the loop runs it
            release_memory(proxy.url, None, TAGS_ALL, 60)
            resume_memory(proxy.url, None, WEIGHTS, 60)
            update_weights_from_tensor(proxy.url, None, [serialize_named_tensors(named)], "1", 60)
            resume_memory(proxy.url, None, KV, 60)
        finally:
            proxy.close()
    paths = [p for _, p, _, _ in proxy.records]
    assert paths == ["/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update",
                     "/update_weights_from_tensor", "/end_weight_update", "/resume_memory_occupation"]
    for method, path, body, status in proxy.records:
        assert status == 200, f"the CPU server refused the project's {method} {path} {body!r:.300}"
        want, text = sglang_http.request(method, path, body)
        assert want == 200, f"SGLang refuses the project's {method} {path} {body!r:.300}: {text[:500]}"
    update = proxy.records[3][2]
    assert update["weight_version"] == "1" and update["flush_cache"] is True and update.get("load_format") is None
    # what SGLang's HTTP layer does with a body that is not its form: refused, as on the CPU server
    assert sglang_http.request("POST", "/release_memory_occupation", {"tags": "weights"})[0] == 400
