"""What the parts share: the model configs, the toy config of the smoke mode, timing and memory helpers, the
host-sync counter."""
from __future__ import annotations

import collections
import json
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "m2po_megatron" / "assets" / "configs"
# toy sizes for --smoke (CPU, fp32): the same code paths at a size two shared cores run in seconds
TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
            max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
            hidden_act="silu", attention_bias=False)
SYNC_WARNING = "synchronizing CUDA operation"  # torch's text for set_sync_debug_mode("warn")


def model_config(name: str, smoke: bool) -> dict:
    return dict(TINY) if smoke else json.loads((CONFIGS / name / "config.json").read_text())


def hf_model(cfg: dict, dev, dtype):
    """A transformers model of this config with its own random init (seed 0), sdpa attention."""
    import torch
    import transformers

    torch.manual_seed(0)
    conf = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device(dev):
        return transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa", dtype=dtype)


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gib(x: float) -> float:
    return round(x / 1024**3, 2)


def time_steps(step, reps: int, deadline: float) -> tuple[float, int, dict, float]:
    """Mean seconds of `step()` over up to `reps` calls after one warm-up call (compiles, optimizer state),
    fewer when the next call would pass `deadline` (time.monotonic); at least one. Resets the CUDA peak
    memory after the warm-up. Returns (seconds, calls timed, last result, seconds of the warm-up call)."""
    import torch

    t0 = time.monotonic()
    m = step()
    sync()
    warm = time.monotonic() - t0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    done, t0 = 0, time.monotonic()
    while done < max(1, reps):
        m = step()
        sync()
        done += 1
        per = (time.monotonic() - t0) / done
        if time.monotonic() + per > deadline - 0.1 * warm:
            break
    return (time.monotonic() - t0) / done, done, m, warm


def count_syncs(fn) -> dict:
    """Run fn() with torch.cuda.set_sync_debug_mode("warn") and count the synchronizing CUDA operations it
    warns about, by Python source line (the line that called the op). Without CUDA fn() still runs (so the
    smoke mode runs this code) and the count is None."""
    import torch

    if not torch.cuda.is_available():
        fn()
        return {"count": None, "why": "no CUDA: torch.cuda.set_sync_debug_mode needs a GPU"}
    sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync()  # after the mode is off: torch.cuda.synchronize() itself counts as a sync in "warn" mode
    hits = [w for w in caught if SYNC_WARNING in str(w.message)]
    where = collections.Counter(f"{'/'.join(Path(w.filename).parts[-2:])}:{w.lineno}" for w in hits)
    return {"count": len(hits), "by_line": dict(where.most_common(15))}
