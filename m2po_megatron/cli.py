"""`m2po`: the command line. Subcommands live in m2po_megatron/commands/ (one module each, with
`register(subparsers)`) and are discovered here, so the CLI itself never changes when one is added."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from m2po_megatron import __version__, commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="m2po",
        description="M2PO off-policy RL on stale rollouts: megatron-core trainer, SGLang rollouts, Ray.",
    )
    parser.add_argument("--version", action="version", version=f"m2po-megatron {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{mod.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from m2po_megatron.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"m2po {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
