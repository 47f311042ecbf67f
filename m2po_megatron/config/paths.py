"""Where recipes live, and how user paths in a recipe resolve."""
from __future__ import annotations

import os
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def resolve_path(ref: str) -> Path:
    """A user path: as given (absolute or relative to the working directory), else relative to the
    repository root (recipes name bundled files such as m2po_megatron/assets/configs/... that way)."""
    p = Path(os.path.expandvars(os.path.expanduser(ref)))
    if p.is_absolute() or p.exists():
        return p
    in_repo = RECIPES_DIR.parent / p
    return in_repo if in_repo.exists() else p
