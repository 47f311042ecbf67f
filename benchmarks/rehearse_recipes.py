"""Every paper recipe rehearsed (m2po rehearse) at its own layout and at one other valid layout: the table of
docs/rehearse.md (recipe, layout, stage, traced peak, estimate at the traced settings, error, the recipe's
estimate, GPU memory, headroom, seconds).

    python benchmarks/rehearse_recipes.py [--max-microbatches 4] [--out table.md] [--only qwen3-1.7b-base]
        [--skip qwen3-30b-a3b]

--max-microbatches 0 rehearses the whole optimizer mini-batch (m2po rehearse's default).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# one other valid layout per model (heads and KV heads divide by TP, layers by PP; the recipe's GPU count)
OTHER = {
    "llama-3.2-3b-instruct": "parallel.tensor_model_parallel_size=4 parallel.data_parallel_size=2",
    "qwen2.5-32b": "parallel.pipeline_model_parallel_size=4 cluster.trainer_nodes=4",
    "qwen2.5-math-7b": "parallel.tensor_model_parallel_size=4 parallel.pipeline_model_parallel_size=2 "
                       "parallel.data_parallel_size=1",
    "qwen3-1.7b-base": "parallel.tensor_model_parallel_size=1 parallel.pipeline_model_parallel_size=2 "
                       "parallel.data_parallel_size=4 parallel.sequence_parallel=false",
    "qwen3-4b-base": "parallel.tensor_model_parallel_size=4 parallel.data_parallel_size=2",
    "qwen3-8b-base": "parallel.tensor_model_parallel_size=2 parallel.pipeline_model_parallel_size=2 "
                     "parallel.data_parallel_size=2",
    "qwen3-30b-a3b": "parallel.data_parallel_size=2 parallel.expert_model_parallel_size=2 cluster.trainer_nodes=4",
}


def rehearse(recipe: Path, overrides: str, max_mbs: int | None) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "m2po_megatron.cli", "rehearse", str(recipe), *overrides.split(), "--format", "json"]
    if max_mbs:
        cmd += ["--max-microbatches", str(max_mbs)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    try:
        return json.loads(p.stdout), wall
    except json.JSONDecodeError:
        return {"error": (p.stderr or p.stdout)[-2000:]}, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-microbatches", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None)
    ap.add_argument("--skip", default="", help="recipe names to leave out, comma-separated")
    a = ap.parse_args()
    lines = ["| recipe | layout | stage | params/GPU | micro-batches | traced GiB | estimate GiB (traced settings) | "
             "error | recipe estimate GiB | GPU GiB | headroom GiB | wall s |", "|" + "---|" * 12]
    for recipe in sorted((REPO / "recipes" / "paper").glob("*.yaml")):
        name = recipe.stem
        if name == "base" or (a.only and a.only != name) or name in a.skip.split(","):
            continue
        for ov in ("", OTHER[name]):
            rep, wall = rehearse(recipe, ov, a.max_microbatches)
            if "stages" not in rep:
                lines.append(f"| {name} | {ov or 'recipe'} | FAILED: {rep.get('error', '')[-200:]!r} |")
                continue
            lay = rep["layout"]
            lay_s = f"TP{lay['tp']} PP{lay['pp']} DP{lay['dp']}" + (f" VPP{lay['vpp']}" if lay.get("vpp") else "")
            lay_s += f" EP{lay['ep']}" if lay.get("ep", 1) > 1 else ""
            lay_s += "" if ov else " (recipe)"
            for s in rep["stages"]:
                if "error" in s:
                    lines.append(f"| {name} | {lay_s} | {s['role']} | FAILED: {s['error'][:200]} |")
                    continue
                lines.append(
                    f"| {name} | {lay_s} | {s['role']} | {s['params'] / 1e9:.2f} B | {s['microbatches']} | "
                    f"{s['traced_gib']:.1f} | {s['estimate_traced_gib']:.1f} | {s['error_pct']:+.1f} % | "
                    f"{s['estimate_recipe_gib']:.1f} | {s['gpu_gib']:.0f} | {s['headroom_gib']:.1f} | {wall:.0f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
