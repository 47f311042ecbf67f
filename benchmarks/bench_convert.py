"""Peak memory and throughput of checkpoint conversion on a random model from a real config.

Default: Qwen2.5-0.5B architecture (494M parameters) in bf16, random weights, written tensor by tensor.
Each conversion runs in a fresh process; we report its peak RSS minus the RSS of the same process after
imports (the baseline measured in the same run), as a ratio to (largest layer + embeddings) and to the whole
model, plus GB/s of model bytes. Usage: python benchmarks/bench_convert.py [CONFIG_DIR] [--dtype bf16]"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import os, resource, sys, time, json
import torch
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
from m2po_megatron.convert import checkpoint as C
import megatron.core, transformers, safetensors  # import cost is part of the baseline
def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
if __name__ == "__main__":
    what, a, b = sys.argv[1:4]
    base = rss_mb()
    t = time.time()
    if what == "baseline":
        pass
    elif what == "h2m":
        C.hf_to_megatron(a, b)
    else:
        C.megatron_to_hf(a, b, max_shard_gb=0.5)
    dt = time.time() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"base_mb": base, "peak_mb": peak, "seconds": dt}))
"""


def write_random_hf(cfg_dir, out, dtype):
    import torch

    from m2po_megatron.convert.hf_writer import ShardedSafetensorsWriter
    from m2po_megatron.models import read_hf_config
    from m2po_megatron.models.weights import expected_hf_shapes

    spec = read_hf_config(cfg_dir)
    shapes = expected_hf_shapes(spec)
    size = torch.empty((), dtype=dtype).element_size()
    plan = [(n, size * torch.Size(s).numel()) for n, s in shapes.items()]
    os.makedirs(out)
    w = ShardedSafetensorsWriter(out, plan, 512 * 2**20)
    g = torch.Generator().manual_seed(0)
    for n, s in shapes.items():
        w.add(n, (torch.randn(s, generator=g) * 0.02).to(dtype))
    w.close()
    cfg = json.load(open(os.path.join(cfg_dir, "config.json")))
    cfg["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    total = sum(b for _, b in plan)
    layer0 = sum(b for n, b in plan if n.startswith("model.layers.0."))
    emb = sum(b for n, b in plan if n in ("model.embed_tokens.weight", "lm_head.weight"))
    return spec, total, layer0, emb


def run_child(script, *args):
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                                                "data", "configs", "Qwen__Qwen2.5-0.5B"))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    work = tempfile.mkdtemp(prefix="m2po_bench_convert_")
    try:
        script = os.path.join(work, "child.py")
        open(script, "w").write(CHILD)
        hf = os.path.join(work, "hf")
        spec, total, layer, emb = write_random_hf(args.config, hf, dtype)
        base = run_child(script, "baseline", "-", "-")
        h2m = run_child(script, "h2m", hf, os.path.join(work, "mc"))
        m2h = run_child(script, "m2h", os.path.join(work, "mc"), os.path.join(work, "back"))
        unit = layer + emb
        print(f"model: {spec.architecture} {args.dtype}, {total / 2**30:.3f} GiB; largest layer + embeddings "
              f"{unit / 2**20:.0f} MiB; import baseline RSS {base['peak_mb']:.0f} MiB")
        for name, r in (("hf-to-megatron", h2m), ("megatron-to-hf", m2h)):
            extra = (r["peak_mb"] - base["peak_mb"]) * 2**20
            print(f"{name}: peak RSS {r['peak_mb']:.0f} MiB, above baseline {extra / 2**20:.0f} MiB = "
                  f"{extra / unit:.2f}x (largest layer + embeddings), {extra / total:.2f}x (whole model); "
                  f"{r['seconds']:.1f} s, {total / 1e9 / r['seconds']:.3f} GB/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
