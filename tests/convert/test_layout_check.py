"""HF <-> Megatron mapping at real size (convert/layout_check.py): every bundled config at every TP in {1, 2, 4, 8}
and PP in {1, 2, 4}, on the real megatron-core model built on fake tensors. The configs bring what the tiny test
models do not: real GQA ratios (Qwen2.5 7:1 and 5:1, Qwen3 2:1 and 4:1, Llama 3:1), tied (Qwen3-1.7B/4B, Llama-3.2)
and untied embeddings, QKV bias (Qwen2.5), q/k norms (Qwen3) and llama3 RoPE scaling (Llama-3.2)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUNDLED = sorted(str(p) for p in (REPO / "m2po_megatron" / "assets" / "configs").glob("*/config.json"))
# The mixture-of-experts config (Qwen3-30B-A3B-Base: 48 x 128 experts) passes layout_check too (TP2 x PP2 in about
# 60 s here, 2026-12-04) but is left out of this sweep for CI's time: its mapping at real size is
# tests/convert/test_real_size_mapping.py's, its export names the contract suite's (test_weight_names.py).
# Neither covers EP > 1 at real size; the conversion at EP2 does at toy size (tests/convert/test_convert.py).
MOE = [c for c in BUNDLED if "Qwen3MoeForCausalLM" in Path(c).read_text()]
CONFIGS = [c for c in BUNDLED if c not in MOE]


def _run(code: str, timeout: float) -> list[dict]:
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    lines = [x for x in p.stdout.splitlines() if x.startswith("[")]
    assert lines, p.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.timeout(600)
def test_every_bundled_config_at_every_layout():
    assert len(CONFIGS) == 6
    res = _run("import sys; from m2po_megatron.convert.layout_check import main; "
               f"sys.exit(main({CONFIGS!r}))", timeout=580)
    assert len(res) == 6 * 4 * 3
    by = {(Path(r["config"]).parent.name, r["tp"], r["pp"]): r for r in res}
    for key, r in by.items():
        if r["valid"]:
            assert r["problems"] == [], (key, r["problems"][:5])
    rejected = sorted(k for k, r in by.items() if not r["valid"])
    # Qwen2.5-Math-7B: 28 heads, 4 KV heads; TP8 divides neither, and the message names both fields
    assert rejected == [("Qwen__Qwen2.5-Math-7B", 8, pp) for pp in (1, 2, 4)]
    msg = by[("Qwen__Qwen2.5-Math-7B", 8, 1)]["rejected"]
    assert "num_key_value_heads = 4" in msg and "tensor_model_parallel_size = 8" in msg and "divisor" in msg
    # the stages' parameters add up to the model's (a tied embedding counted twice at PP > 1: the last stage's
    # output-layer copy) at TP1
    q17 = by[("Qwen__Qwen3-1.7B-Base", 1, 4)]["params"]
    assert sum(q17.values()) == by[("Qwen__Qwen3-1.7B-Base", 1, 1)]["params"]["0"] + 151936 * 2048


@pytest.mark.timeout(300)
def test_a_wrong_mapping_is_caught():
    """The same check with the QKV rule's grouping broken (q, k, v concatenated whole, then split across TP
    ranks, instead of by KV group) and with the fc1 rule's halves swapped: shapes still agree, the check
    must still fail."""
    code = f"""
import json, torch
import m2po_megatron.convert.layout_check as lc
from m2po_megatron.models import weights

real = weights.to_megatron_shard
def ungrouped(spec, rule, hf, tp_rank=0, tp_size=1):
    if rule.kind == "qkv":
        return torch.cat(list(hf), 0).chunk(tp_size, 0)[tp_rank]
    return real(spec, rule, hf, tp_rank, tp_size)
def swapped(spec, rule, hf, tp_rank=0, tp_size=1):
    if rule.kind == "fc1":
        hf = hf[::-1]
    return real(spec, rule, hf, tp_rank, tp_size)
out = []
for fn in (ungrouped, swapped):
    lc.to_megatron_shard = fn
    out.append(lc.check_layout({CONFIGS[3]!r}, 2, 2))
print(json.dumps(out))
"""
    ungrouped, swapped = _run(code, timeout=280)
    assert any("qkv" in p and "give back" in p for p in ungrouped["problems"]), ungrouped["problems"][:3]
    assert any("gate_proj" in p or "fc1" in p for p in swapped["problems"]), swapped["problems"][:3]
