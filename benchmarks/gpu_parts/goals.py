"""Issue 20's goals, judged from the parts' numbers: each goal is {"goal", "value", "pass"}, "pass" None
where the numbers are missing (the part failed, ran out of time, or this machine has no GPU)."""
from __future__ import annotations

from typing import Optional

RATIO_GOAL, RATIO_AIM = 1.2, 1.5
PEAK_MARGIN = 0.15  # models.memory.MARGIN
PARITY_FACTOR = 1.5  # the gpu tests' bound: the actor's bf16 error at most 1.5x HF bf16's own
PAIRS = {"qwen3_1p7b": "hf_1p7b", "qwen3_4b": "hf_4b", "qwen3_1p7b_4k": "hf_1p7b_4k"}
GPU_TESTS = {  # goal -> test function (any parametrisation) in tests/actor/test_actor_gpu.py
    "resume": "test_resume_next_step_equals_an_uninterrupted_run",
    "gradient_parity_vs_hf_bf16": "test_gradients_no_worse_than_hf_bf16",
    "logprob_parity_test": "test_bf16_log_probs_no_worse_than_hf_bf16",
    "peak_memory_test_recipe_rows": "test_peak_memory_within_the_estimate_at_the_recipe_rows",
}


def ratios(parts: dict) -> dict:
    """Actor / HF train_step tokens/s for each pair of parts that both have numbers."""
    out = {}
    for actor, hf in PAIRS.items():
        a, h = parts.get(actor, {}), parts.get(hf, {})
        if "tokens_per_s" in a and "tokens_per_s" in h:
            out[actor] = round(a["tokens_per_s"] / h["tokens_per_s"], 3)
    return out


def _goal(text: str, value, ok: Optional[bool], **extra) -> dict:
    return {"goal": text, "value": value, "pass": ok, **extra}


def _tests(gpu_tests: dict, fn: str) -> tuple[Optional[bool], dict]:
    got = {k: v for k, v in (gpu_tests.get("tests") or {}).items() if k.split("::")[-1].split("[")[0] == fn}
    ran = {k: v for k, v in got.items() if v != "skipped"}
    if not ran:
        return None, got
    return all(v == "passed" for v in ran.values()), got


def judge(parts: dict) -> dict:
    r = ratios(parts)
    goals: dict = {}
    for actor, label in (("qwen3_1p7b", "Qwen3-1.7B"), ("qwen3_4b", "Qwen3-4B")):
        v = r.get(actor)
        goals[f"tokens_per_s_vs_hf_{actor}"] = _goal(
            f"{label} actor train_step tokens/s >= {RATIO_GOAL}x the HF peer at 16,384-token rows (aim {RATIO_AIM}x)",
            v, None if v is None else v >= RATIO_GOAL)
        p = parts.get(actor, {}).get("peak_over_estimate")
        goals[f"peak_vs_estimate_{actor}"] = _goal(
            f"{label} peak allocated within +-{PEAK_MARGIN:.0%} of estimate_gpu_memory's tensor terms", p,
            None if p is None else abs(p - 1) <= PEAK_MARGIN)
    par = parts.get("qwen3_1p7b", {}).get("parity") or {}
    v = (round(par["actor_mean_abs"] / par["hf_bf16_mean_abs"], 3)
         if par.get("hf_bf16_mean_abs") else None)
    goals["logprob_parity_vs_hf_bf16"] = _goal(
        f"actor bf16 mean |log p - HF fp32| <= {PARITY_FACTOR}x HF bf16's own (Qwen3-1.7B, random init)", v,
        None if v is None else v <= PARITY_FACTOR)
    gt = parts.get("gpu_tests", {})
    for goal, fn in GPU_TESTS.items():
        ok, got = _tests(gt, fn)
        goals[goal] = _goal(f"gpu test {fn} passes", None if ok is None else ("passed" if ok else "failed"), ok,
                            tests=got)
    s = parts.get("qwen3_1p7b", {})
    many, one = s.get("syncs", {}).get("count"), s.get("syncs_one_microbatch", {}).get("count")
    goals["host_syncs_independent_of_microbatches"] = _goal(
        "host syncs of one train_step (torch.cuda.set_sync_debug_mode('warn')) the same at 1 and at N micro-batches",
        {"n_microbatches": s.get("syncs", {}).get("microbatches"), "at_n": many, "at_1": one},
        None if many is None or one is None else many <= one)
    judged = [g["pass"] for g in goals.values()]
    comparison = {"qwen3_1p7b_4096_rows_actor_over_hf": r.get("qwen3_1p7b_4k"),  # turn 2's figures beside it
                  "turn2": {"qwen3_1p7b_4096_rows": 0.42, "qwen3_4b_2048_rows": 0.54, "peak_over_estimate": 1.95}}
    return {"goals": goals, "comparison": comparison,
            "all_pass": all(judged) if judged and None not in judged else None,
            "unmeasured": [k for k, g in goals.items() if g["pass"] is None],
            "failed": [k for k, g in goals.items() if g["pass"] is False]}
