"""../shared beside the checkout, or None (tests then use only the configs written in tiny.py)."""
import pathlib

SHARED = pathlib.Path(__file__).resolve().parents[2].parent / "shared"


def shared_path():
    return SHARED if (SHARED / "data" / "configs").is_dir() else None
