"""`m2po rehearse`: a paper recipe's real model at full size on fake tensors, one step per pipeline role, its traced
peak against models/memory.py's estimate. Two small runs always (Qwen3-1.7B at the recipe's TP2 and at PP2 with
virtual chunks); every recipe at two layouts under M2PO_REHEARSE_ALL=1 (benchmarks/rehearse_recipes.py makes
the docs' table the same way)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
Q17 = "recipes/paper/qwen3-1.7b-base.yaml"


def rehearse(*args: str, timeout: float = 280) -> tuple[int, dict | str]:
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "rehearse", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    if "--format" in args:
        try:
            return p.returncode, json.loads(p.stdout)
        except json.JSONDecodeError:
            pytest.fail(f"no JSON (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p.returncode, p.stdout + p.stderr


def _check_stage(s: dict, tp: int):
    assert "error" not in s, s.get("traceback")
    assert abs(s["error_pct"]) <= 10.0
    kinds = s["at_peak_gib"]
    for k in ("weights", "grads", "optimizer", "activations", "temporaries"):
        assert kinds.get(k, 0) > 0, k
    # the recipe's parameters on this rank: bf16 weights, fp32 grads
    assert kinds["weights"] * 2**30 >= 2 * s["params"] and kinds["grads"] * 2**30 >= 4 * s["params"]
    calls = {(c["call"], c["group"]) for c in s["collectives"]}
    if tp > 1:
        assert ("all_reduce", "tp") in calls  # row-parallel layers
    assert ("reduce_scatter_tensor", "dp_cp") in calls and ("all_gather_into_tensor", "dp_cp") in calls
    return calls


@pytest.mark.timeout(300)
def test_paper_recipe_rehearses_within_the_estimate():
    code, rep = rehearse(Q17, "--max-microbatches", "1", "--format", "json")
    assert code == 0, rep.get("problems")
    assert rep["world_size"] == 8 and rep["layout"] == dict(tp=2, pp=1, dp=4, vpp=None, ep=1, sp=True)
    (s,) = rep["stages"]
    _check_stage(s, tp=2)
    assert 0.8e9 < s["params"] < 0.9e9  # Qwen3-1.7B (1.72 B, tied embeddings) at TP2: about half on a rank
    assert s["microbatches"] >= 1 and s["tokens"] > 1000
    # sequence parallel as the recipe says (megatron's local layers run it): the row-parallel layers
    # reduce-scatter their outputs over TP, the column-parallel ones all-gather their inputs
    assert not any(c.startswith("sequence_parallel") for c in rep["changed"]) and rep["not_traced"]
    calls = {(c["call"], c["group"]) for c in s["collectives"]}
    assert {("reduce_scatter_tensor", "tp"), ("all_gather_into_tensor", "tp")} <= calls, calls
    # the verdict can fail: the same report against a tolerance its error exceeds
    from m2po_megatron.rehearse.plan import verdict

    ok, problems = verdict(rep, abs(s["error_pct"]) / 2 or 1e-9)
    assert not ok and "off the traced" in problems[0]


@pytest.mark.timeout(300)
def test_pipeline_stages():
    code, rep = rehearse(Q17, "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
                         "parallel.sequence_parallel=false", "--max-microbatches", "2", "--format", "json")
    assert code == 0, rep.get("problems")
    first, last = rep["stages"]
    assert (first["role"], last["role"]) == ("first", "last") and first["chunks"] == last["chunks"] == 1
    for s in (first, last):
        calls = _check_stage(s, tp=1)
        assert ("isend", "pp") in calls and ("irecv", "pp") in calls
    # Qwen3-1.7B ties its embeddings: at PP > 1 the last stage keeps its own copy as the output layer, and the
    # final norm
    assert last["params"] - first["params"] == 2048


def test_bad_input_exits_2_before_any_work(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {REPO / Q17}\nmodel:\n  hf_config: null\n  hf_path: {tmp_path / 'nowhere'}\n")
    code, out = rehearse(str(recipe), timeout=120)
    assert code == 2 and "model.hf_config" in out
    code, out = rehearse(Q17, "--max-microbatches", "0", timeout=120)
    assert code == 2 and "--max-microbatches" in out
    code, out = rehearse(Q17, "--no-fake-cache", "--fake-cache-crosscheck", "4", timeout=120)
    assert code == 2 and "--fake-cache-crosscheck 4" in out and "no cache to check" in out


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("M2PO_REHEARSE_ALL") != "1", reason="every recipe: set M2PO_REHEARSE_ALL=1")
@pytest.mark.parametrize("recipe", [
    p.name for p in sorted((REPO / "recipes" / "paper").glob("*.yaml")) if p.name != "base.yaml"])
def test_every_paper_recipe(recipe):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from rehearse_recipes import OTHER

    for ov in ([], OTHER[recipe[:-5]].split()):
        code, rep = rehearse(f"recipes/paper/{recipe}", *ov, "--max-microbatches", "2", "--format", "json",
                             timeout=1800)
        assert code == 0, rep.get("problems")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,dp,ep", [(1, 8, 8), (1, 2, 2), (2, 2, 2)])
def test_moe_recipe_rehearses_within_the_estimate(tmp_path, tp, dp, ep):
    """Qwen3-30B-A3B's recipe with 2 of its 48 layers, at TP1 x DP8 with EP8 (8 ranks), DP2 x EP2, and TP2 x DP2
    with EP2 and sequence parallelism (4 ranks): the step runs on fake tensors with balanced routing, the trace agrees
    with the MoE estimate, the tokens go to the experts by all-to-all in the expert-parallel group, and the
    report names what it did not trace. At TP1 x EP2 the tokens do not split evenly over this rank's experts, so
    a chunk order read as zeros (the dispatcher's index tensors made fake) gives them more rows than their
    counts, and the step fails."""
    import json as _json

    cfg = _json.loads((REPO / "m2po_megatron/assets/configs/Qwen__Qwen3-30B-A3B-Base/config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(_json.dumps(cfg))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes/paper/qwen3-30b-a3b.yaml'}\nmodel:\n  hf_config: {tmp_path}\n"
                      f"parallel:\n  tensor_model_parallel_size: {tp}\n  pipeline_model_parallel_size: 1\n"
                      f"  data_parallel_size: {dp}\n  expert_model_parallel_size: {ep}\n"
                      f"  sequence_parallel: {str(tp > 1).lower()}\n"
                      + ("cluster:\n  trainer_nodes: 1\n" if dp == 8 else
                         f"rollout:\n  num_servers: 2\ncluster:\n  trainer_nodes: 1\n  gpus_per_node: {tp * dp}\n"))
    code, rep = rehearse(str(recipe), "--max-microbatches", "1", "--format", "json")
    assert code == 0, rep.get("problems") if isinstance(rep, dict) else rep
    (s,) = rep["stages"]
    assert "error" not in s and abs(s["error_pct"]) <= 10.0, s
    calls = {(c["call"], c["group"]) for c in s["collectives"]}
    assert ("all_to_all_single", "ep") in calls, calls  # the dispatch, in the expert-parallel group
    if tp > 1:  # sequence parallel: row-parallel outputs reduce-scattered over TP
        assert ("reduce_scatter_tensor", "tp") in calls, calls
    assert any("MoE routing" in n for n in rep["not_traced"])
