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
    from tests.rollout.conftest import local_server

    with local_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), context_length=CONTEXT,
                      enable_deterministic_inference=True, random_seed=0) as proc:
        yield proc
