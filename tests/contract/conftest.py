"""Fixtures of the contract suite (`make test-sglang`): the real SGLang HTTP layer in-process, and our CPU
server as a real process of this environment, both for the same tiny model and context length."""
import os

import pytest

pytest.importorskip("sglang")
os.environ.setdefault("M2PO_CPU_SERVER_THREADS", "1")

CONTEXT = 64  # --context-length of both sides


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.rollout.conftest import make_tiny_qwen2

    return str(make_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2")))


@pytest.fixture(scope="session")
def sglang_http(tiny_model_dir):
    from tests.contract.sglang_http import SGLangHTTP

    return SGLangHTTP(tiny_model_dir, CONTEXT)


@pytest.fixture(scope="session")
def cpu_server(tiny_model_dir, tmp_path_factory):
    """The CPU server in the PROJECT's environment (M2PO_PROJECT_PYTHON, which `make test-sglang` sets to
    .venv's python): its engine needs the project's transformers, not the older one sglang pins."""
    import subprocess
    from types import SimpleNamespace

    from m2po_megatron.infra.net import free_port
    from m2po_megatron.rollout.launcher import ServerSpec, build_command, wait_healthy

    python = os.environ.get("M2PO_PROJECT_PYTHON")
    if not python:
        pytest.fail("M2PO_PROJECT_PYTHON is not set: run the contract suite with `make test-sglang`")
    spec = ServerSpec(model_path=tiny_model_dir, engine="local", port=free_port("127.0.0.1"),
                      context_length=CONTEXT, enable_deterministic_inference=True, random_seed=0)
    log_path = tmp_path_factory.mktemp("logs") / "cpu_server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(build_command(spec, python=python), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{spec.port}"
    try:
        wait_healthy(url, timeout_s=180, proc=proc, log_path=str(log_path))
        yield SimpleNamespace(url=url, log_path=str(log_path))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def pytest_configure(config):
    # FastAPI's note about SGLang's response class, once per request of the in-process HTTP layer
    config.addinivalue_line("filterwarnings", "ignore:ORJSONResponse is deprecated")
