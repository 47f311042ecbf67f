"""One command for a CUDA machine: the GPU checks of the actor and issue 20's goals, as one JSON summary.

    tools/gpu_check.sh                         # on the GPU machine (this script under a hard time limit)
    python benchmarks/gpu_check.py [--budget-s 510] [--out FILE] [--parts a,b]
    python benchmarks/gpu_check.py --dry-run   # any machine: print the plan, exit 2 if the budgets don't fit
    python benchmarks/gpu_check.py --smoke     # CPU: every part at toy size (how the script is tested)
    tools/gpu_check.sh --profile DIR           # also one profiled step per dense part, traces in DIR

Works on a bare offline machine with Python 3.12, torch, transformers, triton, numpy, pytest: when
megatron-core is not importable it is installed (pip, offline, --no-deps) from the git-ignored `.whl/`
folder of the checkout (`tools/gpu_check.sh --download-wheels` fills it on a machine with network, pinned to
requirements/lock.txt). Nothing here needs Ray, math-verify or omegaconf.

Each part runs in its own process group with a time budget (gpu_parts/runner.py): a failure or an overrun loses
only its own numbers, and a part past its budget is killed with everything it spawned. The budgets add up to no
more than the total (checked before anything runs), and the total with the shell's hard stop fits one device
command of 600 s. With --out the summary file is rewritten (atomically) after every part, so a stopped check
keeps what finished. Parts (`plan` below), in run order: a warm-up that compiles the actor parts' kernels on
their own rows into one inductor cache (gpu_parts/warmup.py); the actor and the HF peer (benchmarks/hf_peer.py)
on the same tokens for Qwen3-1.7B and Qwen3-4B at the recipes' 16,384-token rows drawn like the paper's rollouts
(gpu_parts/rows.py), and for Qwen3-1.7B on the earlier 4,096-token batch (turn 2's comparison); the M2PO mask vs
one torch.sort; with Transformer Engine, the FP8 actor on ragged rows; last, the `gpu` tests (resume, gradient
and log-prob parity, peak memory at the recipe rows, MoE at real size with R3) with what the parts before them
left of the total. The summary (stdout, one JSON object; progress and a table on stderr) has each part's numbers
or its error, the actor / HF ratios, and every goal of issues 20 and 51 with pass / fail / null (unmeasured).
Every actor and HF part reports its batch's model FLOPs by the planner's count (m2po_megatron.plan.flops) and
its MFU against the device's dense BF16 peak (gpu_parts/mfu.py). `--profile DIR` has the dense parts profile one
more step each (gpu_parts/profile_part.py): a table of where the time goes in the summary, traces in DIR.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from gpu_parts import goals as G  # noqa: E402
from gpu_parts import mfu  # noqa: E402
from gpu_parts.actor_part import actor_part  # noqa: E402
from gpu_parts.hf_part import hf_part  # noqa: E402
from gpu_parts.misc import GPU_TEST_FILES, env_part, gpu_tests_part, mask_part  # noqa: E402,F401
from gpu_parts.profile_part import format_profile  # noqa: E402
from gpu_parts.runner import log, run_part, stop_parts_on_signals  # noqa: E402,F401
from gpu_parts.warmup import warmup_part  # noqa: E402
from gpu_parts.wheels import WHEEL_DIR, ensure_wheels, locked_version, wheel_dir_problem  # noqa: E402,F401

DEFAULT_TOTAL_S = 510.0  # = MAX_TOTAL_S: the first GPU run's gpu tests needed the room (docs/actor.md)
RESERVE_S = 20.0  # wheel install, env probe, summary: outside the parts' budgets
HARD_STOP_MARGIN_S = 30.0  # tools/gpu_check.sh kills the whole run at total + this
COMMAND_LIMIT_S = 600.0  # one device command (/work/.library/device/README.md)
MAX_TOTAL_S = COMMAND_LIMIT_S - HARD_STOP_MARGIN_S - 60.0  # and a minute for the shell and the transfers
ROW = 16384  # recipes/paper/*.yaml train.micro_batch_tokens
# The two sides' AdamW kernels differ: megatron-core without TE or Apex falls back to torch's AdamW, which runs
# its foreach kernel; the HF peer asks torch for the fused one on CUDA. Said in the summary, beside the ratios.
OPTIMIZERS = {"actor": "torch.optim.AdamW, foreach kernel (megatron-core's fallback without TE/Apex)",
              "hf_peer": "torch.optim.AdamW(fused=True) on CUDA (foreach on CPU)"}
Q17, Q4 = "Qwen__Qwen3-1.7B-Base", "Qwen__Qwen3-4B-Base"
# --profile: the dense parts each profile one more step (about 1.1 steps under the profiler, then the table
# and the gzipped trace: a few seconds of parsing, unmeasured on a GPU so far); the seconds come from gpu_tests
PROFILED = ("qwen3_1p7b", "hf_1p7b", "qwen3_4b", "hf_4b")
PROFILE_S = 25.0


@dataclass(frozen=True)
class Part:
    name: str
    budget_s: float
    what: str
    fn: object = None  # a picklable callable taking budget_s=; None for gpu_tests (run in this process)
    rest: bool = False  # runs last and gets whatever the total has left (budget_s: what it is sure of)


def _actor(budget, **kw):
    return functools.partial(actor_part, budget_s=budget, **kw)


def _hf(budget, **kw):
    return functools.partial(hf_part, budget_s=budget, **kw)


def plan(smoke: bool, te: bool, extra: bool = False, profile_dir: str | None = None) -> list[Part]:
    """The parts in run order, with their budgets in seconds (the last, `rest`, also gets what is left);
    `extra` adds the parts that run only when --parts names them; `profile_dir` (--profile) has the dense parts
    profile one more step each (gpu_parts/profile_part.py), with PROFILE_S more each, from the gpu tests."""
    return _profiled(_plan(smoke, te, extra), profile_dir, 20 if smoke else PROFILE_S)


def _profiled(parts: list[Part], profile_dir: str | None, extra_s: float) -> list[Part]:
    if profile_dir is None:
        return parts
    out, added = [], 0.0
    for p in parts:
        if p.name in PROFILED:
            b = p.budget_s + extra_s
            added += extra_s
            p = Part(p.name, b, p.what + ", 1 profiled step", functools.partial(
                p.fn.func, *p.fn.args, **{**p.fn.keywords, "budget_s": b, "profile_dir": profile_dir,
                                          "profile_name": p.name}), p.rest)
        out.append(p)
    # the gpu tests (last, `rest`) give up what the profiles take: they still get whatever the parts leave
    return [Part(p.name, p.budget_s - added, p.what, p.fn, p.rest) if p.rest else p for p in out]


def _plan(smoke: bool, te: bool, extra: bool = False) -> list[Part]:
    if smoke:  # CPU, toy config, fp32: the same functions; budgets for a loaded 2-core machine
        a = dict(model_name=Q17, smoke=True, rows=2, row_tokens=1024, reps=1)
        return [
            Part("warmup", 90, "compile once, the actor parts' toy rows", functools.partial(
                warmup_part, [dict(a, parity=True), dict(a, recompute="full")], budget_s=90)),
            Part("qwen3_1p7b", 150, "actor, toy, 2 rows of 1024, parity", _actor(150, parity=True, **a)),
            Part("hf_1p7b", 90, "HF peer, same tokens", _hf(90, **a)),
            Part("qwen3_4b", 120, "actor, toy, full recompute", _actor(120, recompute="full", **a)),
            Part("hf_4b", 90, "HF peer, full recompute", _hf(90, recompute="full", **a)),
            Part("m2po_mask", 60, "mask vs sort, 1e4 and 1e5", functools.partial(mask_part, [10**4, 10**5], 2)),
            Part("gpu_tests", 120, "collect the gpu tests", rest=True),
        ]
    r17 = dict(model_name=Q17, smoke=False, rows=3, row_tokens=ROW, reps=2)
    r4 = dict(model_name=Q4, smoke=False, rows=2, row_tokens=ROW, reps=2, recompute="full")
    l17 = dict(model_name=Q17, smoke=False, rows=0, row_tokens=4096, reps=2, legacy_seqs=40)
    # Budgets from the first GPU run's part times (H200, 2026-12-04; docs/actor.md "Measured numbers") plus
    # about a quarter: warmup 53 s, qwen3_1p7b 41, hf_1p7b 37, qwen3_4b 31, hf_4b 28, m2po_mask 4. The five
    # sdpa gpu tests need about 250-270 s (two in the first 130 s, then 43, 51 and 42 s by hand), more than
    # is sure after the parts' budgets: they run last, with whatever the parts leave (about 300 s when the
    # parts take what they took). The TE plan is unmeasured: it has no warm-up, so its parts keep
    # cold-compile room, and its gpu tests (twice as many: te and FP8 variants) cannot all fit one command;
    # rerun them alone (`--parts gpu_tests --part-budget gpu_tests=480`).
    # The warm-up (gpu_parts/warmup.py) compiles the actor parts' graphs once into the shared cache; what it
    # does not finish the parts compile themselves, and whatever it finished stays there (a rerun starts
    # warm). On the H200 its compiles took 9.9 s (1.7B) and 15.6 s (4B), 53 s in all (guessed at 75-130 s
    # before; docs/actor.md "GPU check").
    parts: list[Part] = []
    if not te:  # the cold compiles of the parts below, once; the TE plan has no room left
        parts.append(Part("warmup", 65, "compile flex, SwiGLU and the step's graphs once, on the parts' own rows",
                          functools.partial(warmup_part, [dict(r17, parity=True), r4], budget_s=65)))
    b17, bhf17, b4, bhf4 = (60, 45, 65, 40) if te else (50, 45, 40, 35)
    parts += [
        Part("qwen3_1p7b", b17, "actor, 3 rows of 16,384, log-prob parity, syncs", _actor(b17, parity=True, **r17)),
        Part("hf_1p7b", bhf17, "HF peer, the same tokens padded", _hf(bhf17, **r17)),
        Part("qwen3_4b", b4, "actor, 2 rows of 16,384, full recompute (no fit without)", _actor(b4, **r4)),
        Part("hf_4b", bhf4, "HF peer, full recompute", _hf(bhf4, **r4)),
    ]
    if te:  # the H200 image has no TE; with TE the FP8 part takes the 4,096-token comparison's time
        parts.append(Part("te_fp8", 35, "actor, TE FP8 e4m3, 2 ragged rows of 16,384 (no row % 16 == 0)",
                          _actor(35, model_name=Q17, smoke=False, rows=2, row_tokens=ROW, reps=1,
                                 attention_backend="te", fp8="e4m3", ragged=True)))
    if extra:  # turn 2's 4,096-token comparison gave its 55 s to the warm-up: run only when named (--parts)
        parts += [Part("qwen3_1p7b_4k", 30, "actor, turn 2's 40 sequences in 4,096-token rows", _actor(30, **l17)),
                  Part("hf_1p7b_4k", 25, "HF peer, the same", _hf(25, **l17))]
    parts.append(Part("m2po_mask", 10, "mask vs one torch.sort, 1e6-1e8 tokens",
                      functools.partial(mask_part, [10**6, 10**7, 10**8], 5)))
    parts.append(Part("gpu_tests", 245 if not te else 235, "resume, gradient + log-prob parity, peak at the "
                      "recipe rows, MoE at real size with R3", rest=True))
    return parts


def with_budgets(parts: list[Part], overrides: dict[str, float]) -> list[Part]:
    """The parts with `overrides` ({name: seconds}) as their budgets (a rerun of one slow part, say)."""
    out = []
    for p in parts:
        if p.name in overrides:
            b = overrides[p.name]
            fn = p.fn
            if isinstance(fn, functools.partial) and "budget_s" in fn.keywords:
                fn = functools.partial(fn.func, *fn.args, **{**fn.keywords, "budget_s": b})
            p = Part(p.name, b, p.what, fn, rest=False)  # a budget given is the budget
        out.append(p)
    return out


def check_fit(parts: list[Part], total_s: float) -> list[str]:
    """Why these budgets do not fit `total_s` (empty when they do)."""
    errs = []
    need = sum(p.budget_s for p in parts) + RESERVE_S
    if need > total_s:
        errs.append(f"the parts' budgets ({' + '.join(f'{p.name} {p.budget_s:.0f}' for p in parts)}) plus "
                    f"{RESERVE_S:.0f} s reserve = {need:.0f} s exceed the total of {total_s:.0f} s: raise --budget-s "
                    f"or run fewer parts (--parts)")
    if total_s > MAX_TOTAL_S:
        errs.append(f"a total of {total_s:.0f} s + the {HARD_STOP_MARGIN_S:.0f} s hard stop does not fit one "
                    f"{COMMAND_LIMIT_S:.0f}-s device command with a minute to spare: "
                    f"use --budget-s <= {MAX_TOTAL_S:.0f}")
    return errs


def format_plan(parts: list[Part], total_s: float, te: bool) -> str:
    lines = [f"plan ({'with' if te else 'without'} Transformer Engine), total {total_s:.0f} s "
             f"(hard stop {total_s + HARD_STOP_MARGIN_S:.0f} s):"]
    lines += [f"  {p.name:<15} {p.budget_s:5.0f} s{'+' if p.rest else ' '} {p.what}" for p in parts]
    lines.append(f"  {'reserve':<15} {RESERVE_S:5.0f} s  wheels, env, summary")
    if any(p.rest for p in parts):
        lines.append("  (+: also gets what the parts before it leave of the total)")
    lines.append(f"  {'sum':<15} {sum(p.budget_s for p in parts) + RESERVE_S:5.0f} s")
    return "\n".join(lines)


def format_table(summary: dict) -> str:
    lines = ["goal                                         pass   value"]
    if "optimizers" in summary:
        lines.insert(0, "optimizer kernels: actor " + summary["optimizers"]["actor"] + "; HF peer "
                     + summary["optimizers"]["hf_peer"])
    if "peak" in summary:
        lines.insert(0, f"MFU: model FLOPs (m2po_megatron.plan.flops: 6 x matmul params + causal attention per token) "
                        f"/ step s / {summary['peak']['bf16_tflops']} TFLOP/s dense BF16 ({summary['peak']['source']})")
    for k, g in summary.get("goals", {}).get("goals", {}).items():
        mark = {True: "PASS", False: "FAIL", None: "n/a"}[g["pass"]]
        v = g["value"] if not isinstance(g["value"], dict) else json.dumps(g["value"])
        lines.append(f"{k:<44} {mark:<6} {v}")
    for name, p in summary.get("parts", {}).items():
        if "tokens_per_s" in p:
            m = "-" if p.get("mfu") is None else f"{p['mfu']:.1%}"
            lines.append(f"{name:<16} {p['tokens_per_s']:>10.0f} tok/s  step {p.get('step_s')} s  "
                         f"{p.get('model_flops_per_token', 0) / 1e9:.2f} GFLOP/token  {p.get('achieved_tflops', '-')} "
                         f"TFLOP/s  MFU {m}  peak {p.get('peak_allocated_gib', '-')} GiB  "
                         f"est {p.get('estimate_tensors_gib', '-')} GiB")
            if "profile" in p:
                lines.append(format_profile(name, p["profile"]))
        elif "error" in p or "skipped" in p:
            lines.append(f"{name:<16} {('ERROR ' + p['error'][-120:]) if 'error' in p else p['skipped']}")
    return "\n".join(lines)


def peak_of(env: dict, given: float | None) -> dict:
    """The dense BF16 peak MFU divides by: --peak-tflops, else plan.hardware's figure for the device."""
    if given:
        return {"device": env.get("gpu"), "bf16_tflops": given, "source": "--peak-tflops"}
    known = mfu.device_peak(env.get("gpu"))
    if known is None:
        return {"device": env.get("gpu"), "bf16_tflops": None,
                "source": "no CUDA device" if not env.get("cuda") else "not in plan.hardware.GPUS: give --peak-tflops"}
    return {"device": env.get("gpu"), "bf16_tflops": known[1],
            "source": f"plan.hardware.GPUS[{known[0]!r}] (datasheet)"}


def summarize(parts: dict) -> dict:
    """Actor / HF throughput ratios from the parts that have both numbers (kept for callers)."""
    return G.ratios(parts)


def write_summary(path: str | None, summary: dict) -> None:
    """The summary as it stands, to `path` atomically (a temporary file renamed over it): written after every
    part, so a hard stop or a killed device command still leaves every finished part's numbers."""
    if not path:
        return
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(summary, default=str) + "\n")
    os.replace(tmp, p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan and check that the budgets fit; run nothing")
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes: run every part's code")
    ap.add_argument("--budget-s", type=float, default=None, help=f"wall-clock budget of the whole check "
                    f"(default {DEFAULT_TOTAL_S:.0f}; 700 with --smoke)")
    ap.add_argument("--parts", default="", help="comma-separated subset of part names (default: all)")
    ap.add_argument("--part-budget", action="append", default=[], metavar="NAME=S",
                    help="another budget for one part (repeatable), e.g. qwen3_4b=120 in a rerun")
    ap.add_argument("--te", choices=("auto", "yes", "no"), default="auto",
                    help="plan with the TE parts (default: when TE is importable and CUDA is present)")
    ap.add_argument("--out", help="also write the JSON summary to this file")
    ap.add_argument("--profile", metavar="DIR", help="the dense parts profile one more step each: a table per "
                    f"part in the summary, gzipped chrome traces in DIR (+{PROFILE_S:.0f} s each, from gpu_tests)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense BF16 peak for MFU "
                    "(default: plan.hardware's datasheet figure for an H100/H200/A100 SXM; none for others)")
    a = ap.parse_args(argv)
    total = a.budget_s if a.budget_s is not None else (700.0 if a.smoke else DEFAULT_TOTAL_S)
    only = {p for p in a.parts.split(",") if p}
    known = {p.name for sm in (False, True) for te in (False, True) for p in plan(sm, te, extra=True)}
    try:
        overrides = {k: float(v) for k, _, v in (x.partition("=") for x in a.part_budget)}
    except ValueError:
        print(f"--part-budget {a.part_budget}: use NAME=SECONDS, e.g. qwen3_4b=120", file=sys.stderr)
        return 2
    if (only | overrides.keys()) - known:
        print(f"--parts / --part-budget: unknown part(s) {sorted((only | overrides.keys()) - known)}; the parts are "
              f"{sorted(known)}", file=sys.stderr)
        return 2

    def select(smoke: bool, te: bool) -> list[Part]:
        return with_budgets([p for p in plan(smoke, te, extra=bool(only), profile_dir=a.profile)
                             if not only or p.name in only], overrides)

    if a.dry_run:
        bad = False
        for te in (False, True):
            parts = select(a.smoke, te)
            errs = [] if a.smoke else check_fit(parts, total)
            print(format_plan(parts, total, te) + "".join(f"\n  DOES NOT FIT: {e}" for e in errs))
            bad |= bool(errs)
        whl = wheel_dir_problem()  # checked here, before a device call carries .whl/
        if whl:
            print(f"DOES NOT FIT: {whl}")
        return 2 if bad or whl else 0
    if a.profile:  # before any part runs: a folder that cannot be made would lose every trace at the end
        try:
            Path(a.profile).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"--profile {a.profile}: cannot make the folder ({e}); name a writable one, e.g. $OUT/profile",
                  file=sys.stderr)
            return 2
    stop_parts_on_signals()
    # one inductor cache for every part's process: what the warm-up compiles, the later parts load; a job id
    # makes dynamo keep its automatic-dynamic profile there too (local PGO), so the parts compile the
    # dynamic-shape graphs the warm-up ended with at once (gpu_parts/warmup.py)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "m2po-gpu-check-inductor"))
    os.environ.setdefault("TORCH_COMPILE_JOB_ID", "m2po-gpu-check")
    t_start = time.monotonic()
    deadline = t_start + total
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": "smoke" if a.smoke else "gpu",
                     "budget_s": total, "parts": {}}
    try:
        summary["wheels"] = ensure_wheels({"megatron.core": "megatron-core"})
    except Exception as e:  # noqa: BLE001 - reported; the parts that need megatron then fail on their own
        summary["wheels"] = {"error": str(e)}
        log(f"wheels: {e}")
    env = summary["parts"]["env"] = env_part()
    te = {"yes": True, "no": False}.get(a.te, bool(env["transformer_engine"] and env["cuda"]))
    summary["peak"] = peak_of(env, a.peak_tflops)
    parts = select(a.smoke, te)
    errs = [] if a.smoke else check_fit(parts, total)
    if errs:
        print(format_plan(parts, total, te) + "".join(f"\nDOES NOT FIT: {e}" for e in errs), file=sys.stderr)
        return 2
    if not a.smoke and not env["cuda"]:
        log("no CUDA here: the GPU plan runs anyway and its parts report their errors (use --smoke on CPU)")
    summary["plan"] = [{"name": p.name, "budget_s": p.budget_s, "what": p.what} for p in parts]
    summary["optimizers"] = OPTIMIZERS
    summary["complete"] = False
    for p in parts:
        summary["running"] = p.name
        write_summary(a.out, summary)
        left = deadline - time.monotonic() - RESERVE_S / 2
        if left < min(20.0, p.budget_s):
            summary["parts"][p.name] = {"skipped": f"no time left ({left:.0f} s of the {total:.0f} s budget)"}
            continue
        budget = left if p.rest else min(p.budget_s, left)
        if budget < p.budget_s:  # the part's own deadline (its timed repetitions) follows the shorter budget
            p = with_budgets([p], {p.name: budget})[0]
        if p.fn is None:
            res = gpu_tests_part(budget, collect_only=a.smoke)
            log(f"gpu_tests: { {k: res.get(k) for k in ('passed', 'failed', 'skipped', 'collected', 'error')} }")
        else:
            res = run_part(p.name, p.fn, (), budget)
        res = mfu.annotate({**res, "budget_s": round(budget, 1)}, summary["peak"]["bf16_tflops"])
        summary["parts"][p.name] = res
        summary["goals"] = G.judge(summary["parts"])
    summary.pop("running", None)
    summary["complete"] = True
    if not te and not a.smoke:
        summary["parts"]["te_fp8"] = {"skipped": "Transformer Engine not importable (or no GPU)"}
    summary["actor_over_hf_tokens_per_s"] = G.ratios(summary["parts"])
    summary["goals"] = G.judge(summary["parts"])
    summary["wall_s"] = round(time.monotonic() - t_start, 1)
    text = json.dumps(summary, default=str)
    write_summary(a.out, summary)
    print(format_table(summary), file=sys.stderr, flush=True)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - the summary line must still come out
        print(json.dumps({"error": traceback.format_exc()[-4000:]}), flush=True)
        sys.exit(1)
