"""The parts that are not the actor or its HF peer: the environment, the `gpu` tests, the M2PO mask."""
from __future__ import annotations

import importlib.util
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_parts.common import REPO, gib as _gib, sync as _sync
from gpu_parts.wheels import _installed

GPU_TEST_FILES = ["tests/actor/test_actor_gpu.py"]


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


def mask_part(sizes: list[int], reps: int) -> dict:
    """The M2PO mask (algo.m2po_keep_mask) against one torch.sort of the same tensor, on the GPU (CPU in a
    smoke run): median time and peak extra memory per size."""
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
            for what, fn in (("mask", lambda: m2po_keep_mask(lr, adv, mask, tau=TAU)),
                             ("sort", lambda: torch.sort(lr))):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                row[f"peak_extra_{what}_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        rows.append(row)
        del lr, adv, mask
    return {"device": dev, "rows": rows}


def verbose_results(text: str) -> dict:
    """{classname::name: passed|failed|skipped} from the lines of `pytest -v` (JUnit's names)."""
    got = re.finditer(r"^(\S+)\.py::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.M)
    return {f"{m.group(1).replace('/', '.')}::{m.group(2)}": "failed" if m.group(3) == "ERROR" else m.group(3).lower()
            for m in got}


def gpu_tests_part(budget_s: float, collect_only: bool) -> dict:
    """pytest -m gpu on GPU_TEST_FILES in its own process group (killed whole at the budget, ranks included;
    --collect-only in the smoke mode); the result of every test from JUnit XML."""
    from gpu_parts.runner import start_group, wait_group

    with tempfile.TemporaryDirectory() as tmp:
        xml, logp = Path(tmp) / "gpu.xml", Path(tmp) / "log.txt"
        cmd = [sys.executable, "-m", "pytest", "-q" if collect_only else "-v", "-m", "gpu", "-p", "no:cacheprovider",
               f"--junitxml={xml}",
               *(["--collect-only"] if collect_only else []), *GPU_TEST_FILES]
        env = dict(os.environ,
                   PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
        # no dynamo profile from earlier runs (gpu_check's job id): the tests count their own compiles
        env.pop("TORCH_COMPILE_JOB_ID", None)
        t0 = time.perf_counter()
        with open(logp, "wb") as logf:
            proc = start_group(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT)
            timed_out = wait_group(proc, budget_s)
        text = logp.read_text(errors="replace")
        out = {"returncode": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1),
               "output_tail": text[-3000:]}
        if timed_out:
            out["error"] = f"pytest ran past {budget_s:.0f} s; its process group was killed"
        if collect_only:
            out["collected"] = sum(1 for line in text.splitlines() if "::" in line)
            return out
        if not xml.exists():  # killed: the tests that finished are in pytest -v's log
            out["tests"] = verbose_results(text)
        else:
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            out["tests"] = {}
            for c in suite.findall("testcase"):
                status = ("failed" if c.find("failure") is not None or c.find("error") is not None
                          else "skipped" if c.find("skipped") is not None else "passed")
                out["tests"][f"{c.get('classname')}::{c.get('name')}"] = status
        for k in ("passed", "failed", "skipped"):
            out[k] = sum(1 for v in out.get("tests", {}).values() if v == k)
        return out
