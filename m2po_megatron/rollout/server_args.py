"""The CPU server's command line (rollout/local_server.py): SGLang's flag names, and the cheap checks made before
the model loads."""
from __future__ import annotations

import argparse
import os
import pathlib
import socket
import sys

LISTEN_FD_ENV = "M2PO_LISTEN_FD"  # an inherited, bound socket to serve on (rollout/launcher.py)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m m2po_megatron.rollout.local_server",
                                description="CPU server speaking SGLang's HTTP protocol (subset).")
    p.add_argument("--model-path", required=True, help="HF model directory (config.json + weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (health exempt)")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="accepted; this server has no tokenizer")
    p.add_argument("--dtype", default="auto", help="auto | float | float32 | bfloat16 (auto: float32, the "
                   "trainer's CPU precision; bfloat16 samples and scores in bf16, a real engine mismatch)")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--log-level", default="info")
    p.add_argument("--tp-size", type=int, default=1, help="must be 1 on CPU")
    p.add_argument("--dp-size", type=int, default=1, help="must be 1 on CPU (start several servers instead)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted, unused (no static pool)")
    p.add_argument("--quantization", default=None, help="must be unset on CPU")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="as SGLang: only then does sampling_seed choose a request's samples (default seed 42)")
    p.add_argument("--allow-auto-truncate", action="store_true",
                   help="as SGLang: truncate over-length requests instead of answering 400")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="as SGLang: answer return_routed_experts (a MoE model's top-k experts per token and layer)")
    return p


def check_args(args) -> None:
    """Cheap checks before the model loads; SystemExit(2) with a message naming the flag."""
    if args.tp_size != 1 or args.dp_size != 1:
        sys.exit(f"--tp-size/--dp-size must be 1 on the CPU server (got {args.tp_size}/{args.dp_size}); "
                 "start one server per replica")
    if args.quantization:
        sys.exit(f"--quantization {args.quantization}: quantized serving needs SGLang on a GPU")
    if args.dtype not in ("auto", "float", "float32", "bfloat16"):
        sys.exit(f"--dtype {args.dtype}: the CPU server runs auto | float | float32 | bfloat16")
    mp = pathlib.Path(args.model_path)
    if not (mp / "config.json").is_file():
        sys.exit(f"--model-path {args.model_path}: no config.json there (a local HF model directory is needed)")
    if os.environ.get(LISTEN_FD_ENV):
        return  # the launcher bound the socket and handed it over
    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # like aiohttp: only a live listener conflicts
        try:
            s.bind((args.host, args.port))
        except OSError as e:
            sys.exit(f"--host {args.host} --port {args.port}: cannot bind ({e.strerror}); pick a free port")
