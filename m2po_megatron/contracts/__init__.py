"""Frozen copies of external protocols the project speaks (see docs/SOURCES.md, section "contracts")."""
from __future__ import annotations

import functools
import json
import pathlib

SGLANG_HTTP = "sglang-http-0.5.23.json"


@functools.cache
def load(name: str = SGLANG_HTTP) -> dict:
    """The parsed contract file shipped inside the package (never read from ../shared at run time)."""
    return json.loads((pathlib.Path(__file__).parent / name).read_text())
