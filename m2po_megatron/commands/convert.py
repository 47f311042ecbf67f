"""`m2po convert hf-to-megatron|megatron-to-hf`: checkpoint conversion with an optional logits check."""
from __future__ import annotations

import sys

DTYPE_CHOICES = ("fp32", "bf16", "fp16")


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert checkpoints between HF safetensors and Megatron dist checkpoints",
                       description="Convert HF <-> Megatron (torch_dist) checkpoints for Qwen2/2.5, Qwen3 and "
                                   "Llama 3.x. Output is written to a temp directory and renamed when complete.")
    s = p.add_subparsers(dest="direction", required=True)
    h = s.add_parser("hf-to-megatron", help="HF model directory -> Megatron dist checkpoint (any TP/PP on load)")
    h.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    h.add_argument("--out", required=True, help="output directory (the dist checkpoint; HF side files in OUT/hf)")
    h.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size of the conversion processes")
    h.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size of the conversion processes")
    h.add_argument("--ep", type=int, default=1,
                   help="expert_model_parallel_size of the conversion processes (MoE models; tp x pp x ep ranks)")
    h.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="stored dtype (default: the HF weights')")
    _common(h)
    h.set_defaults(func=run_hf_to_megatron)
    m = s.add_parser("megatron-to-hf", help="Megatron dist checkpoint -> HF safetensors directory")
    m.add_argument("--ckpt", required=True, help="Megatron dist checkpoint directory (from convert or the actor)")
    m.add_argument("--out", required=True, help="output HF model directory")
    m.add_argument("--hf-config", default=None,
                   help="HF model directory with config.json (default: CKPT/hf, written by hf-to-megatron)")
    m.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="output dtype (default: the checkpoint's)")
    m.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file (GiB)")
    _common(m)
    m.set_defaults(func=run_megatron_to_hf)


def _common(p) -> None:
    p.add_argument("--verify", action="store_true",
                   help="run the same token ids through HF and Megatron and fail above --tol")
    p.add_argument("--tol", type=float, default=None,
                   help="max |logits diff| for --verify (default 1e-4 for fp32, 5e-2 for bf16/fp16)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def _verify(hf_dir: str, ckpt_dir: str, tol: float | None, dtype_name: str | None) -> int:
    from m2po_megatron.convert.checkpoint import verify_logits

    if tol is None:
        tol = 1e-4 if dtype_name in (None, "fp32", "float32") else 5e-2
    diff = verify_logits(hf_dir, ckpt_dir)
    ok = diff <= tol
    print(f"verify: max |logits_HF - logits_Megatron| = {diff:.3e} (tolerance {tol:.1e}) "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def _stored_dtype(ckpt_dir: str) -> str:
    from m2po_megatron.convert.checkpoint import ckpt_tensor_meta

    d = ckpt_tensor_meta(ckpt_dir)["embedding.word_embeddings.weight"][1]
    return str(d).replace("torch.", "")


def run_hf_to_megatron(args) -> int:
    from m2po_megatron.convert.checkpoint import hf_to_megatron

    try:
        hf_to_megatron(args.hf, args.out, tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                       expert_model_parallel_size=args.ep,
                       dtype=args.dtype, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote Megatron dist checkpoint to {args.out}")
    return _verify(args.hf, args.out, args.tol, _stored_dtype(args.out)) if args.verify else 0


def run_megatron_to_hf(args) -> int:
    from m2po_megatron.convert.checkpoint import megatron_to_hf

    try:
        megatron_to_hf(args.ckpt, args.out, hf_config=args.hf_config, dtype=args.dtype,
                       max_shard_gb=args.max_shard_gb, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote HF model to {args.out}")
    return _verify(args.out, args.ckpt, args.tol, _stored_dtype(args.ckpt)) if args.verify else 0
