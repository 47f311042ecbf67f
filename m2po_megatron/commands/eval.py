"""`m2po eval`: pass@1 (avg@k) of an HF checkpoint on the prepared benchmarks, through the rollout engines."""

from __future__ import annotations

import json
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate an HF checkpoint (pass@1, avg@k) on prepared math benchmarks via the rollout engines",
        description="Starts local rollout servers on MODEL (or attaches to --server-url), samples n answers per "
                    "problem, scores them with math-verify, and writes RUN_DIR/eval/<step|eval>.{json,csv}.",
    )
    p.add_argument("--model-path", required=True,
                   help="HF checkpoint directory, or a Megatron dist checkpoint (converted to HF under OUT first)")
    p.add_argument("--hf-config", help="for a Megatron checkpoint: the HF model directory with its config and "
                                       "tokenizer (default: CKPT/hf, as written by `m2po convert hf-to-megatron`)")
    p.add_argument("--tokenizer", help="tokenizer directory or id (default: --model-path)")
    p.add_argument("--data-dir", required=True, help="prepared eval sets: <name>.jsonl files (`m2po prepare-data` OUT/eval)")
    p.add_argument("--eval-sets", help="comma-separated names (default: every set in --data-dir)")
    p.add_argument("--out", required=True, help="run directory; results go to OUT/eval/")
    p.add_argument("--step", type=int, help="training step this checkpoint belongs to (names the output files)")
    p.add_argument("--n-samples", default=None,
                   help="samples per problem: an integer for all sets, or name=k pairs (default: the paper's, 16 for "
                        "AIME and 4 for the others)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.7, help="default 0.7 as in the released evaluation")
    p.add_argument("--max-new-tokens", type=int, default=2560)
    p.add_argument("--limit", type=int, help="first N problems of each set (smoke tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=["rollout", "hf"], default="rollout",
                   help="rollout: the rollout servers (default); hf: transformers generate in this process")
    p.add_argument("--server-url", action="append", default=[],
                   help="attach to running SGLang/rollout server(s) serving MODEL (repeatable) instead of starting one")
    p.add_argument("--num-servers", type=int, default=1, help="local CPU servers to start (engine rollout)")
    p.add_argument("--api-key", help="API key of the servers")
    p.add_argument("--reward-workers", type=int, default=2)
    p.add_argument("--reward-timeout", type=float, default=10.0, help="seconds per answer before it scores 0")
    p.set_defaults(func=handler)


def _parse_n(spec: str | None):
    if spec is None:
        return None
    if spec.isdigit():
        return int(spec)
    out = {}
    for part in spec.split(","):
        name, _, k = part.partition("=")
        if not k.isdigit():
            raise ValueError(f"--n-samples: {part!r} is not name=k")
        out[name.strip()] = int(k)
    return out


def _model_kind(path: str) -> tuple[str | None, str | None]:
    """("hf" | "megatron", None) or (None, error message)."""
    from pathlib import Path

    p = Path(path)
    if (p / "config.json").is_file():
        return "hf", None
    if (p / "metadata.json").is_file():  # a Megatron dist checkpoint (torch_dist)
        return "megatron", None
    if p.is_dir() and ((p / "latest_checkpointed_iteration.txt").exists() or any(p.glob("iter_*"))):
        return None, (f"{path} looks like a Megatron checkpoint root; pass the dist checkpoint directory itself "
                      "(the one holding metadata.json), e.g. .../iter_0000100")
    return None, f"--model-path {path}: neither an HF checkpoint (config.json) nor a Megatron dist checkpoint"


def _to_hf(args) -> str:
    """Convert a Megatron dist checkpoint to HF under the run directory (m2po_megatron.convert)."""
    from pathlib import Path

    from m2po_megatron.convert.checkpoint import megatron_to_hf

    out = Path(args.out) / "eval_hf" / (f"step_{args.step:06d}" if args.step is not None else "model")
    print(f"m2po eval: converting Megatron checkpoint {args.model_path} -> {out}", file=sys.stderr)
    return megatron_to_hf(args.model_path, str(out), hf_config=args.hf_config, overwrite=True)


def handler(args) -> int:
    kind, err = _model_kind(args.model_path)
    if err:
        print(f"m2po eval: {err}", file=sys.stderr)
        return 2
    try:
        n_samples = _parse_n(args.n_samples)
    except ValueError as e:
        print(f"m2po eval: {e}", file=sys.stderr)
        return 2
    from m2po_megatron.eval.benchmarks import evaluate, load_eval_sets
    from m2po_megatron.reward import Rewards
    from m2po_megatron.reward.functions import terms_of

    names = [n for n in args.eval_sets.split(",") if n] if args.eval_sets else None
    try:
        sets = load_eval_sets(args.data_dir, names, n_samples, args.limit)
    except (FileNotFoundError, ValueError) as e:
        print(f"m2po eval: {e}", file=sys.stderr)
        return 2
    if kind == "megatron":
        try:
            args.model_path = _to_hf(args)
        except (FileNotFoundError, ValueError) as e:
            print(f"m2po eval: cannot convert {args.model_path}: {e}; give --hf-config (the HF model directory "
                  "it was trained from)", file=sys.stderr)
            return 2
    from transformers import AutoTokenizer

    from m2po_megatron.rollout.launcher import ServerStartError

    try:
        tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model_path)
    except (OSError, ValueError) as e:
        print(f"m2po eval: cannot load a tokenizer from {args.tokenizer or args.model_path} "
              f"({str(e).splitlines()[0]}); give --tokenizer DIR", file=sys.stderr)
        return 2
    cleanup = []
    try:
        if args.engine == "hf":
            import torch
            from transformers import AutoModelForCausalLM

            from m2po_megatron.eval.hf_generate import hf_generate_fn

            model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            gen = hf_generate_fn(model, pad, tok.eos_token_id, seed=args.seed)
        else:
            from m2po_megatron.eval.rollout_generate import rollout_generate_fn
            from m2po_megatron.rollout.client import SyncRolloutClient

            urls = list(args.server_url)
            if not urls:
                from m2po_megatron.rollout.launcher import EngineManager, ServerSpec

                mgr = EngineManager([ServerSpec(model_path=args.model_path, engine="local", api_key=args.api_key,
                                                enable_deterministic_inference=True)]  # --seed takes effect
                                    * args.num_servers, run_dir=args.out, use_ray=False)
                cleanup.append(mgr.shutdown)
                urls = mgr.start()
            client = SyncRolloutClient(urls, api_key=args.api_key)
            cleanup.append(client.close)
            gen = rollout_generate_fn(client, seed=args.seed)
        rewards = Rewards(terms_of({"function": "math_verify"}), num_workers=args.reward_workers,
                          timeout_s=args.reward_timeout)
        cleanup.append(rewards.close)
        res = evaluate(gen, tok, sets, temperature=args.temperature, top_p=args.top_p,
                       max_new_tokens=args.max_new_tokens, rewards=rewards, out_dir=args.out, step=args.step,
                       log=lambda m: print(m, file=sys.stderr))
    except (ServerStartError, OSError, ValueError) as e:  # a model it cannot load or serve: name it
        print(f"m2po eval: {args.model_path}: {e or type(e).__name__}", file=sys.stderr)
        return 1
    finally:
        for f in reversed(cleanup):
            try:
                f()
            except Exception as e:  # keep closing the rest
                print(f"m2po eval: cleanup: {e}", file=sys.stderr)
    for row in res.table():
        print(f"{row['benchmark']:>16}  {row['pass@1']:6.2f}  ({row['problems']} x {row['samples']})")
    print(json.dumps(res.files))
    return 0
