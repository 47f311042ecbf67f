#!/usr/bin/env python
"""Same as `m2po convert megatron-to-hf ...` (see `--help`)."""
import sys

from m2po_megatron.cli import main

if __name__ == "__main__":  # the dist-checkpoint reader may spawn processes: keep this guard
    sys.exit(main(["convert", "megatron-to-hf", *sys.argv[1:]]))
