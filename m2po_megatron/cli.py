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
    # `m2po train RECIPE --resume auto train.steps=3`: overrides may follow options (argparse alone stops
    # the positional list at the first option and calls the rest unrecognized).
    args, extra = parser.parse_known_args(argv)
    if extra:
        bad = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
        if bad:
            parser.error(f"unrecognized arguments: {' '.join(bad)}")
        args.overrides = list(args.overrides) + extra
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from m2po_megatron.config import ConfigError
    from m2po_megatron.infra.errors import RunError
    from m2po_megatron.run.state import RunStateError, StopNow

    try:
        return int(args.func(args) or 0)
    except (ConfigError, RunStateError) as e:  # bad input: the message names the field or file and the fix
        print(f"m2po {args.command}: {e}", file=sys.stderr)
        return 2
    except RunError as e:  # the run stopped for a reason its message explains (a dead rank, a timeout)
        print(f"m2po {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"m2po {args.command}: interrupted (Ctrl-C); checkpoints written so far are intact", file=sys.stderr)
        return 130
    except BaseException as e:
        # a second SIGTERM/SIGUSR1 or the stop timeout; the latest checkpoint is intact. Raised from a signal
        # handler, it may arrive wrapped (Ray's ray.get turns it into the cause of a SystemError).
        stop = _in_chain(e, StopNow)
        if stop is not None:
            print(f"m2po {args.command}: {stop}", file=sys.stderr)
            return 128 + stop.signum
        if _in_chain(e, KeyboardInterrupt) is not None:
            print(f"m2po {args.command}: interrupted (Ctrl-C); checkpoints written so far are intact",
                  file=sys.stderr)
            return 130
        raise


def _in_chain(e: BaseException | None, kind: type) -> BaseException | None:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
