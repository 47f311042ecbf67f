"""plan/search.py on a paper recipe: every recommended layout passes the config's own validation."""
from m2po_megatron.config import load_config
from m2po_megatron.plan.search import plan


def test_recommended_layouts_pass_m2po_config():
    cfg = load_config("recipes/paper/qwen3-8b-base.yaml", [], check_files=False)
    res = plan(cfg, 16, top=3)
    assert res["ranked"] and res["layouts"] >= len(res["ranked"])
    tps = [c.predicted["tokens_per_s"] for c in res["ranked"]]
    assert tps == sorted(tps, reverse=True) and all(t > 0 for t in tps)
    for c in res["ranked"]:
        assert c.layout.trainer_gpus + c.layout.rollout_gpus == 16
        assert c.memory_gb <= c.overrides["cluster.gpu_memory_gb"]
        load_config("recipes/paper/qwen3-8b-base.yaml", c.dotted(), check_files=False)  # raises if invalid
        assert c.predicted["staleness_mean"] == 256  # fixed_lag 64 x 4
