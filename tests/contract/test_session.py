"""The weight-update session: SGLang's own SchedulerWeightUpdaterManager and the CPU server answer the same
sequence of calls the same way (success and message; HTTP 400 when success is false)."""
import json

import pytest

from m2po_megatron.rollout import _http

pytestmark = pytest.mark.timeout(300)


class _ModelWithoutRunners:
    """The manager's tp_worker: a model with no weight-update runners (the session logic is the manager's)."""

    def weight_update_runners(self):
        return []


@pytest.fixture(scope="module")
def manager():
    import torch.distributed as dist
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    if not dist.is_initialized():  # the single-rank TP group of a one-GPU server, for the manager's barriers
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mgr = object.__new__(SchedulerWeightUpdaterManager)
    for name, value in {"tp_worker": _ModelWithoutRunners(), "draft_worker": None, "memory_saver_adapter": None,
                        "flush_cache": None, "is_fully_idle": None, "scheduler": None, "metrics_collector": None,
                        "offload_tags": set(), "stashed_model_static_state": None, "_session": None,
                        "tp_cpu_group": dist.group.WORLD}.items():
        setattr(mgr, name, value)
    yield mgr
    dist.destroy_process_group()


def test_session_calls_answer_alike(manager, cpu_server):
    from sglang.srt.managers import io_struct as io

    update = {"names": [], "dtypes": [], "shapes": [], "flush_cache": False}
    steps = [
        ("update_weights_from_distributed", io.UpdateWeightsFromDistributedReqInput(**update),
         "/update_weights_from_distributed", update),
        ("update_weights_from_tensor", io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[]),
         "/update_weights_from_tensor", {"serialized_named_tensors": []}),
        ("end_weight_update", io.EndWeightUpdateReqInput(), "/end_weight_update", {}),
        ("begin_weight_update", io.BeginWeightUpdateReqInput(), "/begin_weight_update", {}),
        ("begin_weight_update", io.BeginWeightUpdateReqInput(), "/begin_weight_update", {}),
        ("end_weight_update", io.EndWeightUpdateReqInput(), "/end_weight_update", {}),
        ("end_weight_update", io.EndWeightUpdateReqInput(), "/end_weight_update", {}),
    ]
    for method, req, path, body in steps:
        real = getattr(manager, method)(req)
        status, text = _http.request(f"{cpu_server.url}{path}", body)
        ours = json.loads(text)
        assert (status == 200) == real.success == ours["success"], (path, real, ours)
        if not real.success:
            assert ours["message"] == real.message, path
