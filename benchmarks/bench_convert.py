"""Peak memory and throughput of checkpoint conversion on a random model from a real config.

Default: Qwen2.5-0.5B architecture (494M parameters) in bf16, random weights, written tensor by tensor.
Each conversion runs in a fresh process that first imports everything the conversion uses, then resets its
peak RSS (/proc/self/clear_refs) and reports the peak during the conversion minus the RSS just before it, as
a ratio to (largest layer + embeddings) and to the whole model, plus GB/s of model bytes.
Usage: python benchmarks/bench_convert.py [CONFIG_DIR] [--dtype bf16]"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import os, sys, time, json
import torch
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
from m2po_megatron.convert import checkpoint as C
# everything the conversion imports, so that import memory is not counted as conversion memory
import megatron.core, transformers, safetensors
import megatron.core.models.gpt, megatron.core.dist_checkpointing, torch.distributed.checkpoint
import m2po_megatron.convert.streaming, m2po_megatron.convert.hf_writer, m2po_megatron.models.builder
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
if __name__ == "__main__":
    what, a, b = sys.argv[1:4]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS: the peak below is the conversion's
    base = status("VmRSS")
    import threading
    peaks, done = {"RssAnon": 0.0, "RssFile": 0.0}, threading.Event()
    def sample():  # anonymous memory vs mapped file pages (page cache, reclaimable), sampled every 20 ms
        while not done.is_set():
            for k in peaks:
                peaks[k] = max(peaks[k], status(k))
            time.sleep(0.02)
    base_anon = status("RssAnon")
    threading.Thread(target=sample, daemon=True).start()
    t = time.time()
    if what == "baseline":
        pass
    elif what == "h2m":
        C.hf_to_megatron(a, b)
    else:
        C.megatron_to_hf(a, b, max_shard_gb=0.5)
    dt = time.time() - t
    done.set()
    print(json.dumps({"base_mb": base, "peak_mb": status("VmHWM"), "seconds": dt, "anon_base_mb": base_anon,
                      "anon_peak_mb": peaks["RssAnon"], "file_peak_mb": peaks["RssFile"]}))
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
    w = ShardedSafetensorsWriter(out, [(n, tuple(s), dtype) for n, s in shapes.items()], 512 * 2**20)
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
              f"{unit / 2**20:.0f} MiB; RSS after imports {base['base_mb']:.0f} MiB")
        for name, r in (("hf-to-megatron", h2m), ("megatron-to-hf", m2h)):
            extra = (r["peak_mb"] - r["base_mb"]) * 2**20
            print(f"{name}: peak RSS {r['peak_mb']:.0f} MiB, {extra / 2**20:.0f} MiB above its start = "
                  f"{extra / unit:.2f}x (largest layer + embeddings), {extra / total:.2f}x (whole model); "
                  f"{r['seconds']:.1f} s, {total / 1e9 / r['seconds']:.3f} GB/s")
            anon = (r["anon_peak_mb"] - r["anon_base_mb"]) * 2**20
            print(f"  of which anonymous (sampled every 20 ms): {anon / 2**20:.0f} MiB = {anon / unit:.2f}x "
                  f"(largest layer + embeddings), {anon / total:.2f}x (whole model); mapped files peak "
                  f"{r['file_peak_mb']:.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
