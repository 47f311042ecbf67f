"""Fixtures of the contract suite (`make test-sglang`): the real SGLang HTTP layer in-process, and our CPU
server as a real process of this environment, both for the same tiny model and context length."""
import contextlib
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


def project_python() -> str:
    python = os.environ.get("M2PO_PROJECT_PYTHON")
    if not python:
        pytest.fail("M2PO_PROJECT_PYTHON is not set: run the contract suite with `make test-sglang`")
    return python


@contextlib.contextmanager
def running_cpu_server(model_dir: str, log_path, **spec_kw):
    """The CPU server in the PROJECT's environment (M2PO_PROJECT_PYTHON, which `make test-sglang` sets to
    .venv's python: its engine needs the project's transformers, not the older one sglang pins), healthy;
    yields its URL and stops it after."""
    import subprocess

    from m2po_megatron.infra.net import free_port
    from m2po_megatron.rollout.launcher import ServerSpec, build_command, wait_healthy

    python = project_python()
    spec = ServerSpec(model_path=str(model_dir), engine="local", port=free_port("127.0.0.1"),
                      context_length=CONTEXT, enable_deterministic_inference=True, random_seed=0, **spec_kw)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(build_command(spec, python=python), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{spec.port}"
    try:
        wait_healthy(url, timeout_s=180, proc=proc, log_path=str(log_path))
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="session")
def cpu_server(tiny_model_dir, tmp_path_factory):
    from types import SimpleNamespace

    log_path = tmp_path_factory.mktemp("logs") / "cpu_server.log"
    with running_cpu_server(tiny_model_dir, log_path) as url:
        yield SimpleNamespace(url=url, log_path=str(log_path))


@pytest.fixture
def tm(sglang_http):
    """The harness's TokenizerManager, with a request table of its own for these requests."""
    tm = sglang_http.tm
    saved = tm.rid_to_state
    tm.rid_to_state = {}
    yield tm
    tm.rid_to_state = saved


def pytest_configure(config):
    # FastAPI's note about SGLang's response class, once per request of the in-process HTTP layer
    config.addinivalue_line("filterwarnings", "ignore:ORJSONResponse is deprecated")
