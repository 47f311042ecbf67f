"""Weight-sync names at real size (issue 33): what the trainer sends to an SGLang server for each bundled config is
what sglang 0.5.23's model class loads, through its own `load_weights` (the call update_weights_from_distributed
makes with each received bucket), on a meta-device model of the real config.

Two sources of what is sent, one sglang process for every layout (tests/contract/weight_names_worker.py):
- the real export at each paper recipe's trainer layout (tensor x pipeline parallel, its TP all-gathers on fake
  tensors; tests/contract/trainer_export_names.py, run by the project's python), fed to sglang at the recipe's
  rollout.tp_size, at its first and last TP rank;
- models.weights.expected_hf_shapes (which the export yields at every trainer layout: tests/convert/
  test_layout_check.py) for every bundled config at TP 1 and for each recipe's config at its rollout and
  trainer TP, first and last TP rank.
Every sent name must reach a parameter, every parameter must be loaded (qkv_proj and gate_up_proj from all their
shards), every whole shape must be the layer's, and no loader may refuse a tensor. The last test shows that a
dropped, misnamed or misshaped tensor is caught."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "m2po_megatron" / "assets" / "configs"
HERE = pathlib.Path(__file__).parent
Q17 = str(CONFIGS / "Qwen__Qwen3-1.7B-Base" / "config.json")
RECIPES = sorted(str(p) for p in (ROOT / "recipes" / "paper").glob("*.yaml") if p.name != "base.yaml")

# what the last test sends wrong, and what it must be told
NEGATIVE = [
    {"id": "wrong:1", "config": Q17, "tp": 2, "drop": ["model.layers.3.self_attn.k_proj.weight",
                                                       "model.layers.0.post_attention_layernorm.weight"],
     "reshape": ["model.layers.2.mlp.up_proj.weight"]},
    {"id": "wrong:2", "config": Q17, "tp": 2, "rank": 1, "rename": [["model.norm.weight", "model.final_norm.weight"],
                                                                    ["model.layers.5.mlp.gate_proj.weight",
                                                                     "model.layers.5.mlp.gate.weight"]]},
    {"id": "wrong:3", "config": Q17, "tp": 1, "reshape": ["model.embed_tokens.weight"]},
    # tied embeddings: an lm_head sent anyway reaches nothing; untied: a missing lm_head leaves it unloaded
    {"id": "wrong:4", "config": Q17, "tp": 1, "add": [["lm_head.weight", [151936, 2048]]]},
    {"id": "wrong:5", "config": str(CONFIGS / "Qwen__Qwen2.5-Math-7B" / "config.json"), "tp": 1,
     "drop": ["lm_head.weight"]},
    # Llama's loader (sglang's STANDARD_QKV_MAPPING / STANDARD_GATE_UP_MAPPING): a missing v_proj, an up_proj of
    # the wrong width
    {"id": "wrong:6", "config": str(CONFIGS / "meta-llama__Llama-3.2-3B-Instruct" / "config.json"), "tp": 1,
     "drop": ["model.layers.1.self_attn.v_proj.weight"], "reshape": ["model.layers.4.mlp.up_proj.weight"]},
]


def _recipe_layouts() -> list[tuple[str, str, int, int]]:
    """(recipe file name, config.json, rollout TP, trainer TP) of each paper recipe."""
    from m2po_megatron.config import load_config

    out = []
    for r in RECIPES:
        cfg = load_config(r, check_files=False)
        out.append((pathlib.Path(r).name, str(ROOT / cfg.model.hf_config), int(cfg.rollout.tp_size),
                    int(cfg.parallel.tensor_model_parallel_size)))
    return out


def _expected_jobs() -> list[dict]:
    """Every bundled config at TP 1; each recipe's config at its rollout TP and its trainer TP, first and last
    rank; sorted by layout (each change of layout rebuilds sglang's groups)."""
    layouts = {(str(p), 1, 0) for p in CONFIGS.glob("*/config.json")}
    for _, config, rollout_tp, trainer_tp in _recipe_layouts():
        for tp in (rollout_tp, trainer_tp):
            layouts |= {(config, tp, 0), (config, tp, tp - 1)}
    return [{"id": f"expected:{pathlib.Path(c).parent.name}@{tp}/{rank}", "config": c, "tp": tp, "rank": rank}
            for c, tp, rank in sorted(layouts, key=lambda x: (x[1], x[2], x[0]))]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{job id: the worker's answer}, plus "exports": the trainer_export_names output. The export (project's
    python) and sglang's import run at once; the export's lists go to the worker when they are ready."""
    python = os.environ.get("M2PO_PROJECT_PYTHON")
    if not python:
        pytest.fail("M2PO_PROJECT_PYTHON is not set: run the contract suite with `make test-sglang`")
    tmp = tmp_path_factory.mktemp("weight_names")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(tmp / "export.out", "w") as eo, open(tmp / "export.err", "w") as ee, \
            open(tmp / "worker.out", "w") as wo, open(tmp / "worker.err", "w") as we:
        export = subprocess.Popen([python, str(HERE / "trainer_export_names.py"), *RECIPES], cwd=ROOT, env=env,
                                  stdout=eo, stderr=ee)
        worker = subprocess.Popen([sys.executable, str(HERE / "weight_names_worker.py")], cwd=ROOT, env=env,
                                  stdin=subprocess.PIPE, stdout=wo, stderr=we, text=True)
        try:
            try:
                for job in _expected_jobs() + NEGATIVE:
                    worker.stdin.write(json.dumps(job) + "\n")
                worker.stdin.flush()
                assert export.wait(timeout=240) == 0, (tmp / "export.err").read_text()[-4000:]
                exports = json.loads((tmp / "export.out").read_text().strip().splitlines()[-1])
                for name, e in sorted(exports.items(), key=lambda x: x[1]["rollout_tp"]):
                    for rank in sorted({0, e["rollout_tp"] - 1}):
                        job = {"id": f"export:{name}/{rank}", "config": str(ROOT / e["hf_config"]),
                               "tp": e["rollout_tp"], "rank": rank, "sent": e["sent"]}
                        worker.stdin.write(json.dumps(job) + "\n")
                worker.stdin.close()
            except BrokenPipeError:  # the worker died: its stderr says why (below)
                pass
            rc = worker.wait(timeout=240)
        finally:
            for p in (export, worker):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    out = {r["id"]: r for r in map(json.loads, (tmp / "worker.out").read_text().splitlines())}
    assert rc == 0, (tmp / "worker.err").read_text()[-4000:]
    out["exports"] = exports
    return out


def _assert_loads(r: dict) -> None:
    where = f"{r['config']} at sglang TP {r['tp']} rank {r['rank']}"
    assert "error" not in r, f"{where}: {r['error']}"
    assert r["layer_tp"] == [[r["tp"], r["rank"]]], (where, r["layer_tp"])
    assert r["unconsumed"] == [], f"{where}: sglang's {r['arch']} has no parameter for {r['unconsumed'][:5]}"
    assert r["unloaded"] == [], f"{where}: nothing the trainer sends loads {r['unloaded'][:5]}"
    assert r["incomplete"] == [] and r["misshaped"] == [], (where, r["incomplete"][:3], r["misshaped"][:3])
    assert r["loaded"] == r["params"] > 0


@pytest.mark.parametrize("recipe", [pathlib.Path(r).name for r in RECIPES])
def test_sglang_loads_what_the_recipes_export_sends(results, recipe):
    """The real export at the recipe's trainer TP x PP, at its rollout TP, first and last rank; and the export
    sends each expected name once, with its expected shape."""
    from m2po_megatron.models.hf_config import read_hf_config
    from m2po_megatron.models.weights import expected_hf_shapes

    e = results["exports"][recipe]
    names = [n for n, _ in e["sent"]]
    assert len(names) == len(set(names)), f"{recipe}: the export sends a name twice"
    expected = {n: list(s) for n, s in expected_hf_shapes(read_hf_config(str(ROOT / e["hf_config"]))).items()}
    assert dict(e["sent"]) == expected
    for rank in sorted({0, e["rollout_tp"] - 1}):
        r = results[f"export:{recipe}/{rank}"]
        assert r["sent"] == len(names)
        _assert_loads(r)


def test_sglang_loads_every_expected_name(results):
    jobs = _expected_jobs()
    assert {j["tp"] for j in jobs} == {1, 2, 4, 8} and len({j["config"] for j in jobs}) == 7  # 6 dense, 1 MoE
    for job in jobs:
        _assert_loads(results[job["id"]])


def test_the_recipes_layouts_are_all_checked(results):
    # the 32B recipe: trainer TP 8 x PP 2 (its second stage's tensors relayed), SGLang at TP 4; the others
    # train at TP 2 (the 8B at 4) and serve at TP 1
    e = results["exports"]
    assert len(e) == 7
    assert (e["qwen2.5-32b.yaml"]["tp"], e["qwen2.5-32b.yaml"]["pp"], e["qwen2.5-32b.yaml"]["rollout_tp"]) == (8, 2, 4)
    # Qwen3-30B-A3B (MoE): trainer TP 2 x PP 8, SGLang at TP 2: its experts go to sglang's FusedMoE by name
    assert (e["qwen3-30b-a3b.yaml"]["tp"], e["qwen3-30b-a3b.yaml"]["pp"], e["qwen3-30b-a3b.yaml"]["rollout_tp"]) == (
        2, 8, 2)
    assert {r: (x["tp"], x["rollout_tp"]) for r, x in e.items() if r not in ("qwen2.5-32b.yaml", "qwen3-30b-a3b.yaml")
            } == {"llama-3.2-3b-instruct.yaml": (2, 1), "qwen2.5-math-7b.yaml": (2, 1),
                  "qwen3-1.7b-base.yaml": (2, 1), "qwen3-4b-base.yaml": (2, 1), "qwen3-8b-base.yaml": (4, 1)}
    assert {"export:qwen2.5-32b.yaml/0", "export:qwen2.5-32b.yaml/3"} <= set(results)


def test_a_wrong_name_or_shape_is_caught(results):
    """A missing k_proj (qkv_proj loses a shard), a missing norm (a parameter never loaded), an up_proj 8 rows too
    long (sglang's loader narrows it to its slice without complaint); two misnamed tensors (sglang only logs a
    warning for the final norm's; gate_up_proj loses its gate shard); an embedding too long (its loader's own
    assertion); an lm_head sent for tied embeddings, none for untied ones; Llama's loader missing a v_proj and
    given a wrong up_proj."""
    r = results["wrong:1"]
    assert "error" not in r
    assert r["incomplete"] == ["model.layers.3.self_attn.qkv_proj.weight: ['q', 'v']"]
    assert r["unloaded"] == ["model.layers.0.post_attention_layernorm.weight"]
    assert r["misshaped"] == ["model.layers.2.mlp.up_proj.weight: sent (6152, 2048), "
                              "model.layers.2.mlp.gate_up_proj.weight takes (6144, 2048)"]
    r = results["wrong:2"]
    assert "error" not in r and r["misshaped"] == []
    assert r["unconsumed"] == ["model.final_norm.weight", "model.layers.5.mlp.gate.weight"]
    assert r["unloaded"] == ["model.norm.weight"]
    assert r["incomplete"] == ["model.layers.5.mlp.gate_up_proj.weight: ['1']"]
    r = results["wrong:3"]
    assert "org_vocab_size" in r["error"] and "model.embed_tokens.weight" in r["error"]
    assert results["wrong:4"]["unconsumed"] == ["lm_head.weight"] and results["wrong:4"]["unloaded"] == []
    assert results["wrong:5"]["unloaded"] == ["lm_head.weight"] and results["wrong:5"]["unconsumed"] == []
    r = results["wrong:6"]
    assert r["incomplete"] == ["model.layers.1.self_attn.qkv_proj.weight: ['k', 'q']"]
    assert r["misshaped"] == ["model.layers.4.mlp.up_proj.weight: sent (8200, 3072), "
                              "model.layers.4.mlp.gate_up_proj.weight takes (8192, 3072)"]
    for r in (results[f"wrong:{i}"] for i in range(1, 7)):
        with pytest.raises(AssertionError):
            _assert_loads(r)
