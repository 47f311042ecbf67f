"""Issue 20's and issue 51's goals, judged from the parts' numbers: each goal is {"goal", "value", "pass"},
"pass" None where the numbers are missing (the part failed, ran out of time, or this machine has no GPU).
Issue 51's (prefixed `issue51_`) ask more of the same parts: MFU by the planner's count (gpu_parts/mfu.py),
1.7x the HF peer, peak memory within 10 %."""
from __future__ import annotations

from typing import Optional

RATIO_GOAL, RATIO_AIM = 1.2, 1.5
PEAK_MARGIN = 0.15  # models.memory.MARGIN
PARITY_FACTOR = 1.5  # the gpu tests' bound: the actor's bf16 error at most 1.5x HF bf16's own
MFU_GOAL, RATIO_GOAL_51, PEAK_MARGIN_51, GROUPED_GOAL = 0.35, 1.7, 0.10, 3.0  # issue 51, one H100 or H200
GROUPED_PART = "moe_grouped"
# the first GPU run (H200, 2026-12-04; docs/actor.md "Measured numbers"), MFU by gpu_parts/mfu.py's count
BEFORE_51 = {"qwen3_1p7b_mfu": 0.238, "qwen3_4b_mfu": 0.223, "qwen3_1p7b_vs_hf": 1.42, "qwen3_4b_vs_hf": 1.49}
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
    goals.update(judge_51(parts, r))
    judged = [g["pass"] for g in goals.values()]
    comparison = {"qwen3_1p7b_4096_rows_actor_over_hf": r.get("qwen3_1p7b_4k"),  # turn 2's figures beside it
                  "mfu": {k: p["mfu"] for k, p in parts.items() if p.get("mfu") is not None},
                  "issue51_before": BEFORE_51,
                  "turn2": {"qwen3_1p7b_4096_rows": 0.42, "qwen3_4b_2048_rows": 0.54, "peak_over_estimate": 1.95}}
    return {"goals": goals, "comparison": comparison,
            "all_pass": all(judged) if judged and None not in judged else None,
            "unmeasured": [k for k, g in goals.items() if g["pass"] is None],
            "failed": [k for k, g in goals.items() if g["pass"] is False]}


def judge_51(parts: dict, r: dict) -> dict:
    """Issue 51's goals (one H100 or H200): Qwen3-1.7B at 16,384-token rows at >= 35 % MFU and >= 1.7x the HF
    peer in one run, Qwen3-4B >= 1.7x, grouped experts >= 3x SequentialMLP (a `moe_grouped` part), every actor
    part's peak within 10 % of the estimate."""
    m = parts.get("qwen3_1p7b", {}).get("mfu")
    goals = {"issue51_mfu_qwen3_1p7b": _goal(
        f"Qwen3-1.7B actor MFU >= {MFU_GOAL:.0%} of the dense BF16 peak at 16,384-token rows (6 x matmul params "
        "+ causal attention per token, plan.flops)", m, None if m is None else m >= MFU_GOAL)}
    for actor, label in (("qwen3_1p7b", "Qwen3-1.7B"), ("qwen3_4b", "Qwen3-4B")):
        v = r.get(actor)
        goals[f"issue51_tokens_per_s_vs_hf_{actor}"] = _goal(
            f"{label} actor train_step tokens/s >= {RATIO_GOAL_51}x the HF peer at 16,384-token rows", v,
            None if v is None else v >= RATIO_GOAL_51)
    g = parts.get(GROUPED_PART, {})  # gpu_parts/grouped_part.py's numbers, when a part of that name ran
    v = g.get("speedup")
    goals["issue51_grouped_experts_qwen3_30b_a3b"] = _goal(
        f"2 layers of Qwen3-30B-A3B: grouped experts >= {GROUPED_GOAL}x SequentialMLP's tokens/s, equal within "
        "bf16's error", None if v is None else {"speedup": v, "within_bf16_error": g.get("within_bf16_error")},
        None if v is None or "within_bf16_error" not in g else v >= GROUPED_GOAL and bool(g["within_bf16_error"]))
    peaks = {k: parts.get(k, {}).get("peak_over_estimate") for k in PAIRS}
    peaks = {k: v for k, v in peaks.items() if v is not None}
    goals["issue51_peak_vs_estimate"] = _goal(
        f"every actor part's peak allocated within +-{PEAK_MARGIN_51:.0%} of estimate_gpu_memory's tensor terms",
        peaks or None, None if not peaks else all(abs(v - 1) <= PEAK_MARGIN_51 for v in peaks.values()))
    return goals
