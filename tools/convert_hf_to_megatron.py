#!/usr/bin/env python
"""Same as `m2po convert hf-to-megatron ...` (see `--help`)."""
import sys

from m2po_megatron.cli import main

if __name__ == "__main__":  # the dist-checkpoint writer spawns processes: keep this guard
    sys.exit(main(["convert", "hf-to-megatron", *sys.argv[1:]]))
