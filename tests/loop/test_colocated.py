"""cluster.colocate (docs/colocate.md), in-process: the refusals before anything starts, the trainer's offload
verbs and the colocated placement. The real colocated runs (the disaggregated equality, SIGTERM inside a swap,
a failed swap) are in tests/faults/test_colocated_faults.py, sharing their runs."""
import pytest

from m2po_megatron.config import ConfigError, load_config


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config("tiny-cpu", ["cluster.colocate=true", *overrides], check_files=False)
    return str(e.value)


def test_colocate_refusals_name_the_fields_and_the_fix():
    msg = _refusal("staleness.mode=bounded")
    assert "cluster.colocate = true with staleness.mode = bounded" in msg and "separate GPUs" in msg
    assert "use staleness.mode = fixed_lag or on_policy" in msg
    msg = _refusal("staleness.mode=on_policy", "rollout.num_servers=2")
    assert "rollout.num_servers x rollout.tp_size x rollout.dp_size = 2 x 1 x 1 = 2" in msg
    assert "use rollout.num_servers = 1" in msg
    msg = _refusal("staleness.mode=on_policy", "parallel.data_parallel_size=4", "rollout.tp_size=3")
    assert "trainer's 4 GPUs" in msg and "rollout.tp_size dividing 4" in msg
    msg = _refusal("staleness.mode=fixed_lag", "rollout.urls=[http://127.0.0.1:1]")
    assert "rollout.urls" in msg and "set rollout.urls = []" in msg
    msg = _refusal("staleness.mode=fixed_lag", "cluster.rollout_nodes=1")
    assert "cluster.rollout_nodes = 0" in msg
    # the layout that fits passes: DP2 with two engines
    load_config("tiny-cpu", ["cluster.colocate=true", "staleness.mode=on_policy", "parallel.data_parallel_size=2",
                             "rollout.num_servers=2"], check_files=False)


def test_a_bounded_colocated_run_exits_2_before_anything_starts(tmp_path, monkeypatch, capsys):
    from m2po_megatron.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny-cpu", f"run.output_dir={tmp_path}", "cluster.colocate=true"]) == 2
    assert "staleness.mode = bounded" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing was written


def test_offload_on_cpu_reports_and_refuses_compute_while_offloaded():
    from m2po_megatron.actor.offload import Offloader

    off = Offloader(enabled=False)
    with off.region():
        pass
    out = off.offload()
    assert out["bytes"] == 0 and out["seconds"] >= 0 and off.offloaded
    with pytest.raises(RuntimeError, match="offloaded; reload"):
        with off.region():
            pass
    with off.on_device():  # a checkpoint while offloaded: reloaded for the block, offloaded again after
        assert not off.offloaded
    assert off.offloaded
    assert off.reload()["bytes"] == 0 and not off.offloaded


def test_colocated_bundles_hold_a_whole_gpu_and_the_rollout_share():
    """Each trainer rank's bundle also offers `rollout` (the engine's actor sits there); on GPUs it holds one
    whole GPU that the rank (a fraction) and the engine share."""
    from m2po_megatron.infra.cluster import rank_bundles

    b = {"trainer": 1e-3, "rollout": 1e-3, "GPU": 1}
    assert rank_bundles(4, ranks_per_node=2, gpus_per_rank=0.5, shared_with="rollout") == [[b, b], [b, b]]
    assert rank_bundles(2, shared_with="rollout") == [[{"trainer": 1e-3, "rollout": 1e-3}] * 2]


def test_the_cpu_servers_injected_faults_hit_the_named_call_only(tmp_path):
    """The test-only hook of the CPU server (tests/faults/test_colocated_faults.py drives runs with it)."""
    import asyncio

    from m2po_megatron.rollout.server_memory import FAIL_ENV, HOLD_ENV, InjectedFaults

    for bad in ("resume_memory_occupation", "generate:1", "resume_memory_occupation:0", "release_memory_occupation:x"):
        with pytest.raises(ValueError, match=f"{FAIL_ENV}=.*ROUTE:N with ROUTE one of"):
            InjectedFaults({FAIL_ENV: bad})
    with pytest.raises(ValueError, match="ROUTE:N:DIR"):
        InjectedFaults({HOLD_ENV: "release_memory_occupation:1"})
    faults = InjectedFaults({FAIL_ENV: "resume_memory_occupation:2",
                             HOLD_ENV: f"release_memory_occupation:1:{tmp_path}"})

    async def calls():
        assert await faults.before("resume_memory_occupation") is None
        held = asyncio.ensure_future(faults.before("release_memory_occupation"))
        await asyncio.wait_for(_created(tmp_path / "held"), 60)
        assert not held.done()  # until the test's file
        (tmp_path / "go").touch()
        assert await asyncio.wait_for(held, 60) is None
        failed = await faults.before("resume_memory_occupation")
        assert failed.status == 500 and b"injected fault: call 2 of /resume_memory_occupation" in failed.body
        assert await faults.before("resume_memory_occupation") is None  # the 3rd goes on
        assert await InjectedFaults({}).before("resume_memory_occupation") is None

    async def _created(path):
        while not path.exists():
            await asyncio.sleep(0.01)

    asyncio.run(calls())


@pytest.mark.gpu
def test_offload_gives_the_gpu_back_and_restores_the_state():
    """On a GPU with torch_memory_saver: the region's memory is freed by offload and its content restored by
    reload (what a colocated trainer rank does each step)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("torch_memory_saver")
    from m2po_megatron.actor.offload import Offloader

    off = Offloader(enabled=True)
    with off.region():
        x = torch.arange(64 << 20, dtype=torch.float32, device="cuda")  # 256 MiB
    expect = x[-5:].cpu().clone()
    out = off.offload()
    assert out["bytes"] >= 200 << 20, out
    back = off.reload()
    assert back["bytes"] >= 200 << 20, back
    assert torch.equal(x[-5:].cpu(), expect)
