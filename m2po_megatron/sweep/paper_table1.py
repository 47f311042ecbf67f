"""The paper's Table 1, for `m2po report` to set beside measured runs.

Source: Zheng, Zhao & Chen, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on
LLMs?", arXiv 2510.01161 v2 (ICLR 2026), Table 1: pass@1 % (avg@16 for AIME24/25, avg@4 for the others) at
the best checkpoint by the 8-benchmark average, evaluated every 50 steps; s = staleness in optimizer updates.
Models are named as the recipes' `model.hf_path` basenames (the paper writes "Qwen3-Base-1.7B" for
Qwen3-1.7B-Base); the paper trains no GSPO run for Qwen3-8B-Base and Qwen2.5-32B.
"""
from __future__ import annotations

SOURCE = "Zheng, Zhao & Chen, arXiv 2510.01161 v2, Table 1"
COLUMNS = ("aime24", "aime25", "amc23", "amc24", "math500", "gaokao2023en", "minerva_math", "olympiadbench", "avg")

# (model, method, staleness in updates): values in COLUMNS order, as printed in the paper
ROWS: dict[tuple[str, str, str], tuple[float, ...]] = {
    ("Llama-3.2-3B-Instruct", "grpo", "0"): (11.0, 2.3, 31.3, 17.2, 53.6, 42.99, 23.1, 20.3, 25.2),
    ("Llama-3.2-3B-Instruct", "grpo", "256"): (9.6, 0.4, 25.0, 13.9, 52.4, 42.08, 17.6, 18.8, 22.5),
    ("Llama-3.2-3B-Instruct", "gspo", "256"): (9.0, 0.2, 30.0, 14.4, 50.6, 40.65, 18.8, 17.3, 22.6),
    ("Llama-3.2-3B-Instruct", "m2po", "256"): (10.4, 4.4, 33.8, 17.8, 52.0, 44.48, 21.2, 18.1, 25.3),
    ("Qwen2.5-Math-7B", "grpo", "0"): (39.6, 17.5, 63.8, 46.7, 82.3, 64.1, 36.7, 43.6, 49.3),
    ("Qwen2.5-Math-7B", "grpo", "256"): (29.4, 12.9, 64.4, 39.4, 80.5, 63.2, 33.1, 43.1, 45.7),
    ("Qwen2.5-Math-7B", "gspo", "256"): (27.3, 13.1, 63.8, 36.7, 79.0, 62.2, 33.5, 41.9, 44.7),
    ("Qwen2.5-Math-7B", "m2po", "256"): (33.3, 17.5, 63.8, 40.6, 84.0, 66.4, 38.1, 47.1, 48.8),
    ("Qwen3-1.7B-Base", "grpo", "0"): (7.5, 7.5, 40.6, 26.1, 67.2, 55.9, 28.9, 30.5, 33.0),
    ("Qwen3-1.7B-Base", "grpo", "256"): (8.5, 4.8, 34.4, 25.0, 64.3, 52.7, 26.0, 27.6, 30.4),
    ("Qwen3-1.7B-Base", "gspo", "256"): (6.9, 4.0, 39.4, 18.9, 65.0, 53.1, 26.5, 27.5, 30.1),
    ("Qwen3-1.7B-Base", "m2po", "256"): (14.0, 6.5, 48.1, 27.8, 71.8, 59.5, 29.4, 35.6, 36.6),
    ("Qwen3-4B-Base", "grpo", "0"): (22.9, 20.2, 63.8, 53.9, 84.6, 69.8, 40.2, 50.5, 50.7),
    ("Qwen3-4B-Base", "grpo", "256"): (14.0, 9.6, 51.9, 32.8, 76.8, 61.7, 34.4, 39.8, 40.1),
    ("Qwen3-4B-Base", "gspo", "256"): (17.9, 15.4, 55.6, 38.3, 76.8, 62.3, 35.1, 44.3, 43.2),
    ("Qwen3-4B-Base", "m2po", "256"): (26.7, 21.0, 64.4, 49.4, 85.8, 70.3, 40.5, 52.3, 51.3),
    ("Qwen3-8B-Base", "grpo", "0"): (26.7, 19.4, 76.9, 52.8, 87.7, 71.6, 41.2, 52.8, 53.6),
    ("Qwen3-8B-Base", "grpo", "256"): (21.0, 13.1, 63.8, 40.0, 81.8, 67.8, 38.5, 47.4, 46.7),
    ("Qwen3-8B-Base", "m2po", "256"): (30.2, 23.1, 71.3, 56.7, 87.2, 75.1, 42.6, 54.8, 55.1),
    ("Qwen2.5-32B", "grpo", "0"): (24.4, 18.3, 71.9, 46.7, 85.4, 71.9, 41.4, 52.9, 51.6),
    ("Qwen2.5-32B", "grpo", "256"): (20.4, 9.6, 68.1, 41.1, 83.0, 67.3, 40.9, 45.9, 47.0),
    ("Qwen2.5-32B", "m2po", "256"): (24.8, 19.4, 76.3, 50.0, 85.7, 71.7, 41.5, 51.7, 52.6),
}


def reference(model: str, method: str, staleness: str) -> dict[str, float] | None:
    """The paper's numbers for a report group (benchmark -> pass@1 %, "avg" included), or None."""
    row = ROWS.get((model, method, str(staleness)))
    return dict(zip(COLUMNS, row)) if row else None


def markdown(groups) -> str:
    """A section setting each report group that the paper also ran beside the paper's row: the group's
    best-eval mean (the paper's checkpoint choice) / the paper's value, per benchmark, and Δ of the average.
    Variants (e.g. another tau) are not the paper's setting and are left out. '' when no group matches."""
    lines = []
    for g in groups:
        ref = reference(g.model, g.method, g.staleness)
        if ref is None or g.variant:
            continue
        cells = []
        for b in COLUMNS:
            c = g.best.get(b)
            got = f"{c.mean:.1f}" if c is not None and c.values else "-"
            cells.append(f"{got} / {ref[b]:g}")
        avg = g.best.get("avg")
        delta = f"{avg.mean - ref['avg']:+.1f}" if avg is not None and avg.values else "-"
        lines.append(f"| {g.model} | {g.method.upper()} | {g.staleness} | "
                     + " | ".join(cells) + f" | {delta} |")
    if not lines:
        return ""
    head = ["model", "method", "s", *[("Avg" if b == "avg" else b) for b in COLUMNS], "Δ Avg"]
    return "\n".join([
        f"## Against the paper's Table 1\n\nmeasured at the best eval (mean over runs) / the paper ({SOURCE}; "
        "best checkpoint by the 8-benchmark average). Δ Avg: measured minus paper.\n",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *lines, ""])
