#!/usr/bin/env python
"""Build the embedded default's task: a tiny Qwen2 model (HF format, warmed up on synthetic sums), its
tokenizer, and train/eval JSONL. Usage: tools/build_tiny_model.py OUT_DIR [--seed 0] [--disjoint-train]
[--uniform-splits] [--moe]. --moe builds a tiny Qwen3-MoE (4 experts, top-2) for `make demo-moe`."""

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-accuracy", type=float, default=0.25,
                    help="stop the warm-up once sampled accuracy (temperature 1) on calibration problems reaches this")
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
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
