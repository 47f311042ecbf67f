"""What a rehearsal runs for a recipe (the roles, the actor's arguments) and its report against the estimate."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from m2po_megatron.models.memory import GiB


@dataclass(frozen=True)
class Role:
    pp_rank: int
    name: str  # "only", "first", "middle", "last"


def roles(pp: int) -> list[Role]:
    """One rank per distinct pipeline role, at tensor and data parallel rank 0."""
    if pp == 1:
        return [Role(0, "only")]
    out = [Role(0, "first")]
    if pp > 2:
        out.append(Role(1, "middle"))
    return out + [Role(pp - 1, "last")]


def traced_kwargs(cfg) -> tuple[dict, list[str]]:
    """MegatronActor's arguments for the recipe as `m2po train` builds them (actor.options.actor_kwargs), less
    what a CPU cannot build, and what was changed: (kwargs, ["key: recipe -> traced", ...])."""
    from m2po_megatron.actor.options import actor_kwargs
    from m2po_megatron.config.validation import model_hf_config

    kw = actor_kwargs(cfg)
    changed = []
    hf = model_hf_config(cfg)
    if hf is None:
        raise ValueError("m2po rehearse needs the model's config.json: set model.hf_config (or model.hf_path "
                         "to a directory holding it)")
    for key, traced in (("attention_backend", "sdpa"), ("fp8", None),
                        ("fp8_recipe", None), ("params_dtype", "bf16" if kw["params_dtype"] == "bf16" else "fp32")):
        if kw[key] != traced and not (key == "attention_backend" and kw[key] == "auto"):
            changed.append(f"{key}: {kw[key]} -> {traced}")
        kw[key] = traced
    kw.update(hf_path=None, hf_config=hf, load_from=None)  # the architecture only: weights are fake
    return kw, changed


def minibatch_seqs(cfg, max_microbatches: Optional[int] = None, seed: int = 0) -> int:
    """Sequences of one optimizer mini-batch; with max_microbatches, at most about that many micro-batches'
    worth per data-parallel rank (from the mean drawn length)."""
    from .stage import draw_lengths

    t = cfg.train
    n = max(1, t.prompts_per_step * cfg.rollout.n_samples_per_prompt // t.updates_per_step)
    if max_microbatches is None:
        return n
    lens = draw_lengths(n, cfg.rollout.max_new_tokens, t.micro_batch_tokens, seed)
    mean = sum(p + r for p, r in lens) / n
    dp = cfg.parallel.data_parallel_size
    return max(dp, min(n, int(max_microbatches * t.micro_batch_tokens * 0.95 * dp / mean)))


def run_roles(kw: dict, *, world_size: int, tp: int, dp: int, pp: int, seqs: int, max_new_tokens: int,
              jobs: int, timeout_s: float, seed: int = 0, fast_cache: bool = True,
              crosscheck: int = 0, held_back_bytes: int = 0) -> list[dict]:
    """Each role in a spawned process (up to `jobs` at once); [{role, ok, result | error}] in role order.
    fast_cache, crosscheck: the fake mode's dispatch cache and its check; held_back_bytes: a colocated engine's
    resident share, held through the step (stage.rehearse_rank)."""
    from m2po_megatron.infra.fake_world import fake_world_rank
    from .stage import child_main

    ctx = mp.get_context("spawn")
    todo = roles(pp)
    out: list[Optional[dict]] = [None] * len(todo)
    with tempfile.TemporaryDirectory(prefix="m2po-rehearse-") as tmp:
        running: list[tuple[int, object, str, float]] = []
        nxt = 0
        while nxt < len(todo) or running:
            while nxt < len(todo) and len(running) < max(1, jobs):
                r = todo[nxt]
                path = os.path.join(tmp, f"{nxt}.json")
                args = dict(kwargs=kw, rank=fake_world_rank(r.pp_rank, tp, dp), world_size=world_size,
                            minibatch_seqs=seqs, max_new_tokens=max_new_tokens, seed=seed,
                            fast_cache=fast_cache, crosscheck=crosscheck, held_back_bytes=held_back_bytes)
                p = ctx.Process(target=child_main, args=(args, path), daemon=True)
                p.start()
                running.append((nxt, p, path, time.monotonic()))
                nxt += 1
            time.sleep(0.2)
            for item in list(running):
                i, p, path, t0 = item
                late = time.monotonic() - t0 > timeout_s
                if p.is_alive() and not late:
                    continue
                if late:
                    p.kill()
                p.join()
                running.remove(item)
                if os.path.exists(path):
                    with open(path) as f:
                        res = json.load(f)
                else:
                    why = f"timed out after {timeout_s:.0f} s" if late else f"exit code {p.exitcode}"
                    res = {"ok": False, "error": f"the rehearsal process died ({why})"}
                out[i] = dict(role=todo[i].name, pp_rank=todo[i].pp_rank, **res)
    return [o for o in out if o is not None]


def estimates(cfg, hf, stage: int, traced: dict) -> tuple[dict, dict]:
    """(models/memory.py's estimate at the traced settings and this stage, the estimate of the recipe as
    written at this stage), GiB."""
    from m2po_megatron.config.validation import _gpu_attention_backend
    from m2po_megatron.models.memory import estimate_gpu_memory
    from m2po_megatron.models.reference_memory import recipe_reference

    p = cfg.parallel
    common = dict(tensor_model_parallel_size=p.tensor_model_parallel_size,
                  pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                  data_parallel_size=p.data_parallel_size, micro_batch_tokens=cfg.train.micro_batch_tokens,
                  use_distributed_optimizer=p.use_distributed_optimizer, recompute=p.recompute_granularity,
                  context_parallel_size=p.context_parallel_size, pipeline_stage=stage,
                  microbatches_in_flight=traced.get("microbatches"),
                  expert_model_parallel_size=p.expert_model_parallel_size,
                  expert_tensor_parallel_size=p.expert_tensor_parallel_size,
                  moe_aux_loss=cfg.model.moe_aux_loss_coeff > 0, routing_replay=cfg.algo.routing_replay,
                  **recipe_reference(cfg))
    dtype = traced["params_dtype"]
    est_traced = estimate_gpu_memory(hf, params_dtype=dtype, fp8=False, sequence_parallel=traced["sequence_parallel"],
                                     attention_backend="sdpa", cuda_kernels=False, foreach_adam=False,
                                     overhead_gb=0.0, **common)
    est_recipe = estimate_gpu_memory(hf, params_dtype=dtype, fp8=bool(cfg.model.fp8),
                                     sequence_parallel=p.sequence_parallel,
                                     attention_backend=_gpu_attention_backend(cfg.model.attention_backend),
                                     **common)
    return est_traced, est_recipe


def report(cfg, hf, results: list[dict], traced_kw: dict, gpu_gb: float) -> dict:
    """Per stage: parameters, traced peak and its parts, the estimate at the traced settings and its error, the
    recipe's estimate against the GPU's memory; plus the collectives. A colocated recipe (cluster.colocate)
    traces its training phase with the released engine's share held on the GPU (held_back_bytes): both the
    traced peak and the estimate at the traced settings include it, and the recipe's estimate is the training
    phase's (models/colocated_memory.py)."""
    rows = []
    for r in results:
        if not r.get("ok"):
            rows.append(dict(role=r["role"], pp_rank=r["pp_rank"], error=r.get("error"),
                             traceback=r.get("traceback")))
            continue
        res = r["result"]
        est_t, est_r = estimates(cfg, hf, r["pp_rank"], dict(traced_kw, microbatches=res["microbatches"]))
        traced_gib = res["peak_bytes"] / GiB
        held = res.get("held_back_bytes", 0) / GiB
        tensor_terms = est_t["total"] - est_t["overhead"] + held
        recipe_gib = est_r["total"] + held
        rows.append(dict(
            role=r["role"], pp_rank=r["pp_rank"], params=res["params"], chunks=res["chunks"],
            microbatches=res["microbatches"], sequences=res["sequences"], tokens=res["tokens"],
            traced_gib=traced_gib, at_peak_gib={k: v / GiB for k, v in res["at_peak"].items()},
            peak_phase=res["peak_phase"], estimate_traced_gib=tensor_terms,
            error_pct=100.0 * (tensor_terms - traced_gib) / traced_gib,
            estimate_recipe_gib=recipe_gib, gpu_gib=gpu_gb, headroom_gib=gpu_gb - recipe_gib, held_back_gib=held,
            reference=_reference_row(res, est_t, held),
            collectives=res["collectives"], build_s=res["build_s"], step_s=res["step_s"],
            dispatch_cache=res["dispatch_cache"]))
    return {"stages": rows}


def _reference_row(res: dict, est_t: dict, held: float) -> Optional[dict]:
    """The reference model's share of a stage (None without one), GiB: its weights and where they live, the
    traced "reference" blocks at the step's peak, the traced peak of its pass against the estimate's
    reference-pass phase at the traced settings (tensor terms, plus a colocated engine's held share), and the
    estimate's training phase."""
    ref = res.get("reference")
    if not ref:
        return None
    traced = ref["pass_peak_bytes"] / GiB
    est_pass = est_t["reference_pass"] - est_t["overhead"] + held
    return dict(offload=ref["offload"], weights_gib=ref["bytes"] / GiB,
                at_peak_gib=res["at_peak"].get("reference", 0) / GiB, build_peak_gib=res["build_peak_bytes"] / GiB,
                pass_traced_gib=traced, pass_at_peak_gib={k: v / GiB for k, v in ref["pass_at_peak"].items()},
                estimate_pass_gib=est_pass, pass_error_pct=100.0 * (est_pass - traced) / traced if traced else 0.0,
                estimate_training_gib=est_t["training"] - est_t["overhead"] + held)


def format_reference(rep: dict) -> list[str]:
    """The report's lines on the reference model's share of each stage (none without one)."""
    out = []
    for s in rep["stages"]:
        r = s.get("reference")
        if not r or "error" in s:
            continue
        where = ("offloaded: on the host between passes, on the GPU only in its pass" if r["offload"] else
                 "resident on the GPU")
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["pass_at_peak_gib"].items()))
        out.append(f"reference model, {s['role']} stage: {r['weights_gib']:.2f} GiB of weights ({where}), "
                   f"{r['at_peak_gib']:.2f} GiB of it at the step's traced peak; its pass traced "
                   f"{r['pass_traced_gib']:.2f} GiB ({kinds}) against the estimate's {r['estimate_pass_gib']:.2f} "
                   f"({r['pass_error_pct']:+.1f} %); the training phase's estimate {r['estimate_training_gib']:.2f}")
    return out


def verdict(rep: dict, tolerance_pct: float) -> tuple[bool, list[str]]:
    """(every stage ran and its estimate is within tolerance_pct of its traced peak, the problems)."""
    problems = []
    for s in rep["stages"]:
        name = f"{s['role']} stage (pipeline rank {s['pp_rank']})"
        if "error" in s:
            problems.append(f"{name} failed: {s['error']}")
        elif abs(s["error_pct"]) > tolerance_pct:
            problems.append(f"{name}: models/memory.py's estimate {s['estimate_traced_gib']:.2f} GiB is "
                            f"{s['error_pct']:+.1f} % off the traced {s['traced_gib']:.2f} GiB (tolerance "
                            f"{tolerance_pct:g} %)")
        r = s.get("reference")
        if r and "error" not in s and not r["pass_traced_gib"]:  # the actor's reference_log_probs was not called
            problems.append(f"{name}: the reference model's pass was not traced")
        elif r and "error" not in s and abs(r["pass_error_pct"]) > tolerance_pct:
            problems.append(f"{name}: the reference pass's estimate {r['estimate_pass_gib']:.2f} GiB is "
                            f"{r['pass_error_pct']:+.1f} % off its traced {r['pass_traced_gib']:.2f} GiB (tolerance "
                            f"{tolerance_pct:g} %)")
    if not rep["stages"]:
        problems.append("no stage was rehearsed")
    return not problems, problems
