import os

# Keep CPU tests predictable on 2 cores, offline, and away from any other Ray or wandb state.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import importlib.util
import pathlib
import shutil

import pytest

# tests/contract/ runs in the environment of `make test-sglang` (the real sglang); elsewhere it is not collected.
collect_ignore = [] if importlib.util.find_spec("sglang") else ["contract"]

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_dir():
    """../shared beside the checkout (read-only data of the project's workplace: the DeepScaleR/eval files and
    the configs the bundled ones were copied from). Only tests of that data use it; model tests use the configs
    bundled in m2po_megatron/assets/configs."""
    if not SHARED.is_dir():
        pytest.skip("needs ../shared/data (the workplace's datasets and original HF configs), absent here")
    return SHARED


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """The embedded default's task (tokenizer, warmed-up tiny Qwen2, synthetic data), built once per test
    session (~40 s of CPU), or reused from M2PO_TINY_TASK_DIR when that points at a finished build."""
    from m2po_megatron.demo.tiny_model import INFO_FILE, build_tiny_task

    given = os.environ.get("M2PO_TINY_TASK_DIR")
    if given and (pathlib.Path(given) / INFO_FILE).exists():
        return pathlib.Path(given)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.mktemp("tiny-task")
        build_tiny_task(out, seed=0, log=lambda *_: None)
        return out
    # Under pytest-xdist the workers' temp roots share this session's parent: the first worker builds, the
    # others wait on the lock and reuse it (a half-built directory never gets the final name).
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent
    out = root / "tiny-task"
    with FileLock(str(root / "tiny-task.lock")):
        if not (out / INFO_FILE).exists():
            part = root / "tiny-task.partial"
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir()
            build_tiny_task(part, seed=0, log=lambda *_: None)
            part.rename(out)
    return out


@pytest.fixture(scope="session")
def moe_task(tiny_task, tmp_path_factory):
    """The tiny task's tokenizer and data beside a random tiny Qwen3-MoE (transformers' own init and save)."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    out = tmp_path_factory.mktemp("moe-task")
    for f in tiny_task.iterdir():
        if f.suffix in (".jsonl", ".jinja") or f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)
    dense = json.loads((tiny_task / "config.json").read_text())
    cfg = Qwen3MoeConfig(vocab_size=dense["vocab_size"], hidden_size=dense["hidden_size"],
                         intermediate_size=dense["intermediate_size"], moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=dense["num_attention_heads"],
                         num_key_value_heads=dense["num_key_value_heads"],
                         head_dim=dense["hidden_size"] // dense["num_attention_heads"], num_experts=4,
                         num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                         max_position_embeddings=dense["max_position_embeddings"], bos_token_id=dense["bos_token_id"],
                         eos_token_id=dense["eos_token_id"], pad_token_id=dense["pad_token_id"],
                         architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out
