#!/usr/bin/env python
"""Build the embedded default's task: a tiny Qwen2 model (HF format, warmed up on synthetic sums), its
tokenizer, and train/eval JSONL. Usage: tools/build_tiny_model.py OUT_DIR [--seed 0] [--disjoint-train]
[--uniform-splits] [--moe] [--agent]. --moe builds a tiny Qwen3-MoE (4 experts, top-2) for `make demo-moe`;
--agent builds the tool-use task of `make demo-agent` instead (two-digit products and a calculator to call,
m2po_megatron/demo/tiny_agent.py; --target-accuracy is then the sampled episodes' success)."""

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-accuracy", type=float, default=None,
                    help="stop the warm-up once sampled accuracy (temperature 1) on calibration problems reaches this "
                         "(default 0.25; with --agent, the success of sampled episodes, default 0.3)")
    ap.add_argument("--max-warmup-steps", type=int, default=600)
    ap.add_argument("--check-every", type=int, default=20,
                    help="warm-up steps between accuracy checks (fewer overshoot the target less)")
    ap.add_argument("--n-train", type=int, default=512)
    ap.add_argument("--n-eval", type=int, default=128)
    ap.add_argument("--n-calibration", type=int, default=128,
                    help="problems the warm-up's stopping rule is measured on (held out like eval)")
    ap.add_argument("--disjoint-train", action="store_true",
                    help="warm up only on problems outside train.jsonl, so RL trains on problems the warm-up "
                         "never saw (default: the warm-up may include them)")
    ap.add_argument("--uniform-splits", action="store_true",
                    help="cut every split from the whole problem space in a seeded random order, so all have the "
                         "same mix of 2- and 3-term sums (default: eval, drawn first, takes most 2-term sums)")
    ap.add_argument("--moe", action="store_true",
                    help="a tiny Qwen3-MoE (4 experts, top-2, every layer sparse) instead of the dense Qwen2")
    ap.add_argument("--agent", action="store_true",
                    help="the tool-use task of `make demo-agent` (a calculator the policy may call) instead of sums")
    ap.add_argument("--p-call", type=float, default=None,
                    help="with --agent: the fraction of warm-up traces that call the calculator (default 0.5; the "
                         "others answer directly)")
    args = ap.parse_args(argv)
    if args.agent:
        return _agent(ap, args)
    if args.p_call is not None:
        ap.error("--p-call applies to --agent only")
    if args.target_accuracy is None:
        args.target_accuracy = 0.25
    from m2po_megatron.demo.tiny_model import TinyMoeSpec, build_tiny_task

    try:  # the builder checks its arguments before writing anything; a wrong flag is exit code 2, not a traceback
        paths = build_tiny_task(args.out_dir, seed=args.seed, target_accuracy=args.target_accuracy,
                                max_warmup_steps=args.max_warmup_steps, check_every=args.check_every,
                                n_train=args.n_train, n_eval=args.n_eval, n_calibration=args.n_calibration,
                                disjoint_train=args.disjoint_train, uniform_splits=args.uniform_splits,
                                moe=TinyMoeSpec() if args.moe else None)
    except ValueError as e:
        print(f"build_tiny_model.py: {e}", file=sys.stderr)
        return 2
    info = json.loads(open(paths.info_json).read())
    print(json.dumps({"paths": paths.__dict__, **{k: info[k] for k in (
        "warmup_steps", "eval_sampled_accuracy", "disjoint_train", "uniform_splits", "n_warmup_problems",
        "build_seconds")}, **({k: info[k] for k in ("moe", "parameters")} if args.moe else {})},
        indent=2))
    return 0


def _agent(ap, args) -> int:
    if args.disjoint_train or args.uniform_splits or args.moe:
        ap.error("--agent builds its own splits (all disjoint) with a dense model: drop --disjoint-train, "
                 "--uniform-splits and --moe")
    from m2po_megatron.demo.tiny_agent import build_tiny_agent_task

    kw = {k: v for k, v in (("target_success", args.target_accuracy), ("p_call", args.p_call)) if v is not None}
    try:
        paths = build_tiny_agent_task(args.out_dir, seed=args.seed, max_warmup_steps=args.max_warmup_steps,
                                      check_every=args.check_every, n_train=args.n_train, n_eval=args.n_eval,
                                      n_calibration=args.n_calibration, **kw)
    except ValueError as e:
        print(f"build_tiny_model.py: {e}", file=sys.stderr)
        return 2
    info = json.loads(open(paths.info_json).read())
    print(json.dumps({"paths": paths.__dict__, **{k: info[k] for k in (
        "warmup_steps", "target_success", "p_call", "eval_sampled_success", "eval_episode", "n_warmup_problems",
        "build_seconds")}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
