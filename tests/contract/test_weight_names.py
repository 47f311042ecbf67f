"""Weight-sync names at real size: what the trainer sends for each bundled config (HF names, whole tensors: the
export gathers TP shards, and tests/convert/test_layout_check.py shows it yields exactly expected_hf_shapes at
every trainer layout) is what sglang 0.5.23's model class loads, through its own `load_weights` (the call
update_weights_from_distributed makes), on a meta-device model of the real config at TP 1, at each paper
recipe's rollout TP (rollout.tp_size) and at its trainer TP. Every sent name must reach a parameter, every
parameter must be loaded (stacked qkv_proj and gate_up_proj from all their shards), every whole shape must be
the layer's, and no loader may refuse a tensor (tests/contract/weight_names_worker.py)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)
ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "m2po_megatron" / "assets" / "configs"
WORKER = pathlib.Path(__file__).with_name("weight_names_worker.py")


def _run(tp: int, configs: list, *extra: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(WORKER), str(tp), *map(str, configs), *extra], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=500)
    out = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert p.returncode == 0 and len(out) == len(configs), p.stderr[-4000:]
    return out


def _layouts() -> dict[int, set]:
    """{TP: the configs to check at it}: every bundled config at TP 1; each paper recipe's config at its
    rollout.tp_size and at its trainer's tensor_model_parallel_size."""
    from m2po_megatron.config import load_config

    out: dict[int, set] = {1: {p.parent.name for p in CONFIGS.glob("*/config.json")}}
    for recipe in sorted((ROOT / "recipes" / "paper").glob("*.yaml")):
        if recipe.name == "base.yaml":
            continue
        cfg = load_config(recipe, check_files=False)
        name = pathlib.Path(cfg.model.hf_config).parent.name
        for tp in (cfg.rollout.tp_size, cfg.parallel.tensor_model_parallel_size):
            out.setdefault(int(tp), set()).add(name)
    return out


LAYOUTS = _layouts()


@pytest.mark.parametrize("tp", sorted(LAYOUTS))
def test_sglang_loads_every_name_the_trainer_sends(tp):
    names = sorted(LAYOUTS[tp])
    for r in _run(tp, [CONFIGS / n / "config.json" for n in names]):
        where = f"{r['config']} at TP {tp}"
        assert "error" not in r, f"{where}: {r['error']}"
        assert r["unconsumed"] == [], f"{where}: sglang's {r['arch']} has no parameter for {r['unconsumed'][:5]}"
        assert r["unloaded"] == [], f"{where}: nothing the trainer sends loads {r['unloaded'][:5]}"
        assert r["incomplete"] == [] and r["misshaped"] == [], (where, r["incomplete"][:3], r["misshaped"][:3])
        assert r["loaded"] == r["params"] > 0


def test_the_recipes_layouts_are_all_checked():
    # the 32B recipe: SGLang at TP 4 and the trainer at TP 8; the others train at TP 2 (the 8B at 4), serve at 1
    assert {4, 8} <= set(LAYOUTS) and "Qwen__Qwen2.5-32B" in LAYOUTS[4] and "Qwen__Qwen2.5-32B" in LAYOUTS[8]
    assert len(LAYOUTS[1]) == 6


def test_a_wrong_name_or_shape_is_caught():
    """A missing k_proj (qkv_proj loses a shard), a missing norm (a parameter never loaded), an up_proj 8 rows too
    long (sglang's loader narrows it to its slice without complaint) and an embedding too long (its loader's
    own assertion)."""
    q17 = CONFIGS / "Qwen__Qwen3-1.7B-Base" / "config.json"
    (r,) = _run(2, [q17], "--drop", "model.layers.3.self_attn.k_proj.weight",
                "--drop", "model.layers.0.post_attention_layernorm.weight",
                "--reshape", "model.layers.2.mlp.up_proj.weight")
    assert "error" not in r
    assert r["incomplete"] == ["model.layers.3.self_attn.qkv_proj.weight: ['q', 'v']"]
    assert r["unloaded"] == ["model.layers.0.post_attention_layernorm.weight"]
    assert r["misshaped"] == ["model.layers.2.mlp.up_proj.weight: sent (6152, 2048), "
                              "model.layers.2.mlp.gate_up_proj.weight takes (6144, 2048)"]
    (r,) = _run(1, [q17], "--reshape", "model.embed_tokens.weight")
    assert "org_vocab_size" in r["error"] and "model.embed_tokens.weight" in r["error"]
