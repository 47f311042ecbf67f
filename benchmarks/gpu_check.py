"""One command for a CUDA machine: the GPU checks of the actor, as one JSON summary (not a test).

    tools/gpu_check.sh                      # on the GPU machine (wraps this script with a hard time limit)
    python benchmarks/gpu_check.py [--budget-s 450] [--out FILE] [--parts a,b]
    python benchmarks/gpu_check.py --dry-run   # CPU: every part at toy size (how the script is tested)

Works on a bare offline machine with Python 3.12, torch, transformers, triton, numpy, pytest: when
megatron-core is not importable it is installed (pip, offline, --no-deps) from the git-ignored `.whl/`
folder of the checkout into a temporary directory (`tools/gpu_check.sh --download-wheels` fills `.whl/`
on a machine with network, pinned to requirements/lock.txt). Nothing here needs Ray, math-verify or
omegaconf.

Parts, each in its own process with a time budget, so one failure or overrun loses only its own numbers:
  env          python, torch, GPU, megatron-core, Transformer Engine
  gpu_tests    the `gpu`-marked tests (tests/actor/test_actor_gpu.py): parity, finite loss, peak memory
  qwen3_1p7b   Qwen3-1.7B config, random init, bf16: log-prob parity vs HF fp32 next to HF bf16's own error;
               actor train_step tokens/s; peak memory vs estimate_gpu_memory for the backend that ran
  hf_1p7b      plain HF transformers doing the same work on the same batch (benchmarks/hf_peer.py)
  m2po_mask    the M2PO mask vs one torch.sort of the same tensor, 1e6-1e8 tokens
  qwen3_4b, hf_4b   the same for Qwen3-4B
  te_bf16, te_fp8   the actor with Transformer Engine layers (bf16, FP8 tensorwise) when TE is importable
The summary (stdout, one JSON object; logs go to stderr) has each part's numbers or its error, the
actor / HF throughput ratios and the wall time.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

CONFIGS = REPO / "m2po_megatron" / "assets" / "configs"
WHEEL_DIR = REPO / ".whl"
GPU_TEST_FILES = ["tests/actor/test_actor_gpu.py"]
DOWNLOAD = ("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
            "--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 "
            "--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl megatron-core=={version}")
# toy sizes for --dry-run (CPU, fp32)
TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
            max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
            hidden_act="silu", attention_bias=False)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- wheels
def locked_version(dist: str, lock: Path = REPO / "requirements" / "lock.txt") -> str | None:
    """The version requirements/lock.txt pins for `dist` (None if absent)."""
    norm = dist.lower().replace("_", "-")
    for line in lock.read_text().splitlines():
        name, _, ver = line.strip().partition("==")
        if name.lower().replace("_", "-") == norm:
            return ver
    return None


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_wheels(modules: dict[str, str], wheel_dir: Path = WHEEL_DIR, target: Path | None = None) -> dict:
    """Make every module of {module: distribution} importable: the missing ones are installed offline from
    the wheels of `wheel_dir` (pip --no-index --no-deps) into `target`, which goes on sys.path and
    PYTHONPATH (so child processes see it too). Returns what was installed from where; raises
    RuntimeError naming the download command when a wheel is missing."""
    missing = {m: d for m, d in modules.items() if importlib.util.find_spec(m.split(".")[0]) is None
               or _safe_find(m) is None}
    if not missing:
        return {"installed": [], "importable": sorted(modules)}
    norm = lambda s: s.lower().replace("-", "_")  # noqa: E731
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    have = {norm(w.name.split("-")[0]): w for w in wheels}
    absent = [d for d in missing.values() if norm(d) not in have]
    if absent:
        hints = "; ".join(DOWNLOAD.replace("megatron-core", d).format(version=locked_version(d) or "VERSION")
                          for d in absent)
        raise RuntimeError(f"{', '.join(absent)} not importable and no wheel in {wheel_dir}: on a machine with "
                           f"network run, in the checkout: {hints} (or tools/gpu_check.sh --download-wheels)")
    target = Path(target or tempfile.mkdtemp(prefix="m2po-wheels-"))
    chosen = [have[norm(d)] for d in missing.values()]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, chosen)]
    subprocess.run(cmd, check=True, timeout=300)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [os.environ.get("PYTHONPATH")])])
    importlib.invalidate_caches()
    still = [m for m in missing if _safe_find(m) is None]
    if still:
        raise RuntimeError(f"installed {[w.name for w in chosen]} into {target} but {still} still not importable")
    return {"installed": [w.name for w in chosen], "target": str(target)}


def _safe_find(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- parts
def run_part(name: str, fn, args: tuple, budget_s: float) -> dict:
    """fn(*args) in a fresh spawned process (torchrun-style env, one rank) with a time limit; returns its
    dict, or {"error": ...} when it raised or ran past the budget. The process is killed either way."""
    from m2po_megatron.actor.launch import run_multiprocess

    t0 = time.perf_counter()
    try:
        out = run_multiprocess(fn, 1, args=args, timeout=budget_s)[0]
    except BaseException as e:  # noqa: BLE001 - a part's failure is data for the summary
        msg = str(e)
        out = {"error": msg[-4000:]}
        if isinstance(e, KeyboardInterrupt):
            raise
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    log(f"{name}: {'ERROR ' + out['error'][-300:] if 'error' in out else 'ok'} ({out['wall_s']} s)")
    return out


def model_config(name: str, dry: bool) -> dict:
    if dry:
        return dict(TINY)
    return json.loads((CONFIGS / name / "config.json").read_text())


def rl_batch(n: int, vocab: int, max_len: int, seed: int = 0):
    """RL-like sequences: prompt 32-400 tokens + a lognormal response (median ~900), each at most max_len;
    behaviour log-probs near a uniform model's, +-1 advantages."""
    import random

    import torch

    from m2po_megatron.actor.batch import TrainBatch

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ids, plens, behav = [], [], []
    for _ in range(n):
        p = min(rng.randint(32, 400), max_len // 4)
        r = max(8, min(max_len - p, int(rng.lognormvariate(6.8, 0.8))))
        ids.append(torch.randint(0, vocab, (p + r,), generator=g))
        plens.append(p)
        behav.append(-math.log(vocab) + 0.05 * torch.randn(r, generator=g))
    adv = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return TrainBatch(ids, plens, behav, adv)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gib(x: float) -> float:
    return round(x / 1024**3, 2)


def actor_part(model_name: str, dry: bool, n_seqs: int, budget_tokens: int, reps: int, parity: bool,
               attention_backend: str = "auto", fp8: str | None = None) -> dict:
    """Actor train_step tokens/s and peak memory vs estimate_gpu_memory; optionally first the log-prob
    parity of the actor (bf16) and of HF bf16 against HF fp32 on the same weights."""
    import torch

    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.actor.packing import plan_microbatches
    from m2po_megatron.models.memory import estimate_gpu_memory

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = model_config(model_name, dry)
    batch = rl_batch(n_seqs, cfg["vocab_size"], budget_tokens)
    out: dict = {"model": model_name if not dry else "tiny", "tokens": sum(batch.lengths), "seqs": len(batch),
                 "micro_batch_tokens": budget_tokens}
    precision = "bf16" if cuda else "fp32"
    kw = dict(hf_config=cfg, params_dtype=precision, micro_batch_tokens=budget_tokens, lr=1e-6, loss_name="m2po",
              attention_backend=attention_backend, fp8=fp8, fp8_recipe="tensorwise" if fp8 else None, seed=0)
    if parity:
        out["parity"] = _parity(cfg, kw, dev)
        actor = out["parity"].pop("_actor")
    else:
        actor = MegatronActor(**kw)
    out["attention_backend"] = actor.attention_backend
    rows = plan_microbatches(batch, list(range(len(batch))), budget_tokens)
    out["microbatches"] = len(rows)
    longest = max(m.seq_len for m in rows)
    m = actor.train_step(batch)  # warm-up: compiles, allocates the optimizer state
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(reps):
        m = actor.train_step(batch)
    _sync()
    dt = (time.perf_counter() - t0) / reps
    out.update(step_s=round(dt, 3), tokens_per_s=round(out["tokens"] / dt, 1), loss=m["loss"],
               grad_norm=m["grad_norm"], finite=bool(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])))
    est = estimate_gpu_memory(cfg, micro_batch_tokens=longest, params_dtype=precision, fp8=bool(fp8),
                              attention_backend=actor.attention_backend)
    out["estimate_gib"] = {k: round(v, 2) for k, v in est.items()}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        tensors = (est["total"] - est["overhead"]) * 1024**3
        out.update(peak_allocated_gib=_gib(peak), peak_reserved_gib=_gib(torch.cuda.max_memory_reserved()),
                   estimate_tensors_gib=_gib(tensors), peak_over_estimate=round(peak / tensors, 3))
    actor.close()
    return out


def _parity(cfg: dict, actor_kw: dict, dev) -> dict:
    """Max and mean |log p - log p_HF fp32| of the response tokens for the actor (bf16 on GPU) and for HF
    in bf16, on the same random weights. Returns the actor too (built from the HF weights)."""
    import torch
    import transformers

    from m2po_megatron.actor.actor import MegatronActor

    torch.manual_seed(0)
    conf = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device(dev):
        hf = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa", dtype=torch.float32)
    hf.eval()
    batch = rl_batch(8, cfg["vocab_size"], min(1024, actor_kw["micro_batch_tokens"]), seed=1)

    @torch.no_grad()
    def hf_lp(model):
        res = []
        for ids, p in zip(batch.input_ids, batch.prompt_lens):
            ids = ids.to(dev)
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
            res.append(logp[p - 1:-1].gather(-1, ids[p:, None]).squeeze(-1).cpu())
        return torch.cat(res)

    ref = hf_lp(hf)
    actor = MegatronActor(load_from=hf, **actor_kw)
    lp, _ = actor.compute_log_probs(batch)
    hf.to(torch.bfloat16)
    hf16 = hf_lp(hf)
    del hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    d_actor, d_hf = (torch.cat(lp) - ref).abs(), (hf16 - ref).abs()
    return {"tokens": int(ref.numel()), "actor_max_abs": float(d_actor.max()), "actor_mean_abs": float(d_actor.mean()),
            "hf_bf16_max_abs": float(d_hf.max()), "hf_bf16_mean_abs": float(d_hf.mean()), "_actor": actor}


def hf_part(model_name: str, dry: bool, n_seqs: int, budget_tokens: int, reps: int) -> dict:
    """Plain HF transformers (sdpa attention, bf16 on GPU, fused AdamW) doing the actor's work on the same
    batch: see benchmarks/hf_peer.py."""
    import torch
    import transformers

    from hf_peer import HFPeer

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = model_config(model_name, dry)
    batch = rl_batch(n_seqs, cfg["vocab_size"], budget_tokens)
    torch.manual_seed(0)
    conf = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(
            conf, attn_implementation="sdpa", dtype=torch.bfloat16 if cuda else torch.float32)
    peer = HFPeer(model, batch, budget_tokens)
    m = peer.step()  # warm-up
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(reps):
        m = peer.step()
    _sync()
    dt = (time.perf_counter() - t0) / reps
    tokens = sum(batch.lengths)
    out = {"tokens": tokens, "microbatches": m["num_microbatches"], "step_s": round(dt, 3),
           "tokens_per_s": round(tokens / dt, 1), "loss": m["loss"], "grad_norm": m["grad_norm"]}
    if cuda:
        out["peak_allocated_gib"] = _gib(torch.cuda.max_memory_allocated())
    return out


def mask_part(sizes: list[int], reps: int) -> dict:
    """The M2PO mask (algo.m2po_keep_mask) against one torch.sort of the same tensor, on the GPU (CPU in a
    dry run): median time and peak extra memory per size."""
    import statistics

    import torch

    from bench_m2po_mask import TAU
    from m2po_megatron.algo import m2po_keep_mask

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n in sizes:
        # bench_m2po_mask's data, drawn on the device (1e8 Student-t draws on the host take too long): log-ratios
        # 0.13 x Student-t with 3 degrees of freedom (a normal over sqrt(chi2_3 / 3)), +-1 advantages, 90 % valid
        chi2 = sum(torch.randn(n, generator=g, device=dev).square() for _ in range(3))
        lr = 0.13 * torch.randn(n, generator=g, device=dev) / (chi2 / 3).sqrt()
        adv = torch.where(torch.rand(n, generator=g, device=dev) < 0.5, -1.0, 1.0)
        mask = torch.rand(n, generator=g, device=dev) < 0.9
        del chi2

        def timed(fn):
            fn()
            _sync()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                _sync()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        row = {"n": n, "dropped": int((mask & ~m2po_keep_mask(lr, adv, mask, tau=TAU)).sum()),
               "mask_ms": round(1e3 * timed(lambda: m2po_keep_mask(lr, adv, mask, tau=TAU)), 3),
               "sort_ms": round(1e3 * timed(lambda: torch.sort(lr)), 3)}
        row["mask_over_sort"] = round(row["mask_ms"] / row["sort_ms"], 2)
        if dev == "cuda":
            for what, fn in (("mask", lambda: m2po_keep_mask(lr, adv, mask, tau=TAU)), ("sort", lambda: torch.sort(lr))):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                row[f"peak_extra_{what}_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        rows.append(row)
        del lr, adv, mask
    return {"device": dev, "rows": rows}


def gpu_tests_part(budget_s: float, dry: bool) -> dict:
    """pytest -m gpu on GPU_TEST_FILES in a subprocess (collect-only in a dry run); counts from JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "gpu.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}",
               *GPU_TEST_FILES]
        if dry:
            cmd.insert(3, "--collect-only")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=budget_s)
        except subprocess.TimeoutExpired as e:
            return {"error": f"pytest ran past {budget_s:.0f} s", "output_tail": (e.stdout or "")[-2000:]
                    if isinstance(e.stdout, str) else ""}
        out = {"returncode": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1),
               "output_tail": (proc.stdout + proc.stderr)[-3000:]}
        if dry:
            out["collected"] = sum(1 for line in proc.stdout.splitlines() if "::" in line)
            return out
        if xml.exists():
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            cases = suite.findall("testcase")
            out["tests"] = {}
            for c in cases:
                status = ("failed" if c.find("failure") is not None or c.find("error") is not None
                          else "skipped" if c.find("skipped") is not None else "passed")
                out["tests"][f"{c.get('classname')}::{c.get('name')}"] = status
            for k in ("passed", "failed", "skipped"):
                out[k] = sum(1 for s in out["tests"].values() if s == k)
        return out


def env_part() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
           "megatron_core": _installed("megatron-core"), "transformers": _installed("transformers"),
           "transformer_engine": importlib.util.find_spec("transformer_engine") is not None}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        out["gpu_memory_gib"] = _gib(torch.cuda.get_device_properties(0).total_memory)
    return out


# ---------------------------------------------------------------------------------------------- plan
def plan(dry: bool, te: bool) -> list[tuple[str, object, tuple, float]]:
    """(name, function, args, budget seconds) in run order; the most important first."""
    if dry:
        return [
            ("qwen3_1p7b", actor_part, ("Qwen__Qwen3-1.7B-Base", True, 6, 512, 1, True), 240),
            ("hf_1p7b", hf_part, ("Qwen__Qwen3-1.7B-Base", True, 6, 512, 1), 120),
            ("m2po_mask", mask_part, ([10**4, 10**5], 2), 60),
        ]
    parts = [
        ("qwen3_1p7b", actor_part, ("Qwen__Qwen3-1.7B-Base", False, 40, 4096, 2, True), 110),
        ("hf_1p7b", hf_part, ("Qwen__Qwen3-1.7B-Base", False, 40, 4096, 2), 60),
        ("m2po_mask", mask_part, ([10**6, 10**7, 10**8], 5), 60),
        ("qwen3_4b", actor_part, ("Qwen__Qwen3-4B-Base", False, 24, 2048, 2, False), 90),
        ("hf_4b", hf_part, ("Qwen__Qwen3-4B-Base", False, 24, 2048, 2), 60),
    ]
    if te:
        parts += [("te_bf16", actor_part, ("Qwen__Qwen3-1.7B-Base", False, 40, 4096, 2, False, "te"), 70),
                  ("te_fp8", actor_part, ("Qwen__Qwen3-1.7B-Base", False, 40, 4096, 2, False, "te", "e4m3"), 70)]
    return parts


def summarize(parts: dict) -> dict:
    """Actor / HF throughput ratios from the parts that have both numbers."""
    ratios = {}
    for actor, hf in (("qwen3_1p7b", "hf_1p7b"), ("qwen3_4b", "hf_4b")):
        a, h = parts.get(actor, {}), parts.get(hf, {})
        if "tokens_per_s" in a and "tokens_per_s" in h:
            ratios[actor] = round(a["tokens_per_s"] / h["tokens_per_s"], 3)
    return ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: check that every part runs")
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of the whole check")
    ap.add_argument("--gpu-tests-budget-s", type=float, default=110.0)
    ap.add_argument("--parts", default="", help="comma-separated subset of part names (default: all)")
    ap.add_argument("--out", help="also write the JSON summary to this file")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + a.budget_s
    only = {p for p in a.parts.split(",") if p}
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": a.dry_run, "parts": {}}
    try:
        summary["wheels"] = ensure_wheels({"megatron.core": "megatron-core"})
    except Exception as e:  # noqa: BLE001 - reported; the parts that need megatron then fail on their own
        summary["wheels"] = {"error": str(e)}
        log(f"wheels: {e}")
    summary["parts"]["env"] = env_part()
    te = summary["parts"]["env"]["transformer_engine"] and summary["parts"]["env"]["cuda"]
    if not only or "gpu_tests" in only:
        budget = min(a.gpu_tests_budget_s, deadline - time.perf_counter() - 5)
        summary["parts"]["gpu_tests"] = gpu_tests_part(budget, a.dry_run) if budget > 10 else {"skipped": "no time left"}
        log(f"gpu_tests: {({k: summary['parts']['gpu_tests'].get(k) for k in ('passed', 'failed', 'skipped', 'collected', 'returncode')})}")
    for name, fn, args, budget in plan(a.dry_run, te):
        if only and name not in only:
            continue
        left = deadline - time.perf_counter() - 5
        if left < min(30.0, budget):
            summary["parts"][name] = {"skipped": f"no time left ({left:.0f} s of the {a.budget_s:.0f} s budget)"}
            continue
        summary["parts"][name] = run_part(name, fn, args, min(budget, left))
    if not te and not a.dry_run:
        for name in ("te_bf16", "te_fp8"):
            summary["parts"][name] = {"skipped": "Transformer Engine not importable (or no GPU)"}
    summary["actor_over_hf_tokens_per_s"] = summarize(summary["parts"])
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    text = json.dumps(summary, default=str)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - the summary line must still come out
        print(json.dumps({"error": traceback.format_exc()[-4000:]}), flush=True)
        sys.exit(1)
