"""Offline install of the Python packages a bare GPU image lacks (megatron-core) from the checkout's
git-ignored `.whl/` folder (`tools/gpu_check.sh --download-wheels` fills it on a machine with network)."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEEL_DIR = REPO / ".whl"
# .whl/ travels to the device machine in `carry`, which takes 64 MiB in all (every carried path together):
# .whl/ may use 48 MiB of it (megatron-core 0.19.2's wheel: 2.3 MB)
CARRY_LIMIT_MIB = 64
WHEEL_DIR_LIMIT_MIB = 48
DOWNLOAD = ("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
            "--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 "
            "--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl megatron-core=={version}")


def locked_version(dist: str, lock: Path = REPO / "requirements" / "lock.txt") -> str | None:
    """The version requirements/lock.txt pins for `dist` (None if absent)."""
    norm = dist.lower().replace("_", "-")
    for line in lock.read_text().splitlines():
        name, _, ver = line.strip().partition("==")
        if name.lower().replace("_", "-") == norm:
            return ver
    return None


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_wheels(modules: dict[str, str], wheel_dir: Path = WHEEL_DIR, target: Path | None = None) -> dict:
    """Make every module of {module: distribution} importable: the missing ones are installed offline from
    the wheels of `wheel_dir` (pip --no-index --no-deps) into `target`, which goes on sys.path and
    PYTHONPATH (so child processes see it too). Returns what was installed from where; raises
    RuntimeError naming the download command when a wheel is missing."""
    missing = {m: d for m, d in modules.items() if importlib.util.find_spec(m.split(".")[0]) is None
               or _safe_find(m) is None}
    if not missing:
        return {"installed": [], "importable": sorted(modules)}
    norm = lambda s: s.lower().replace("-", "_")  # noqa: E731
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    have = {norm(w.name.split("-")[0]): w for w in wheels}
    absent = [d for d in missing.values() if norm(d) not in have]
    if absent:
        hints = "; ".join(DOWNLOAD.replace("megatron-core", d).format(version=locked_version(d) or "VERSION")
                          for d in absent)
        raise RuntimeError(f"{', '.join(absent)} not importable and no wheel in {wheel_dir}: on a machine with "
                           f"network run, in the checkout: {hints} (or tools/gpu_check.sh --download-wheels)")
    target = Path(target or tempfile.mkdtemp(prefix="m2po-wheels-"))
    chosen = [have[norm(d)] for d in missing.values()]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, chosen)]
    subprocess.run(cmd, check=True, timeout=300)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [os.environ.get("PYTHONPATH")])])
    importlib.invalidate_caches()
    still = [m for m in missing if _safe_find(m) is None]
    if still:
        raise RuntimeError(f"installed {[w.name for w in chosen]} into {target} but {still} still not importable")
    return {"installed": [w.name for w in chosen], "target": str(target)}


def _safe_find(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def wheel_dir_problem(wheel_dir: Path = WHEEL_DIR, limit_mib: float = WHEEL_DIR_LIMIT_MIB) -> str | None:
    """Why `wheel_dir` cannot travel with the checkout (None when it can): more than limit_mib MiB in files."""
    if not wheel_dir.is_dir():
        return None
    files = [f for f in wheel_dir.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files) / 2**20
    if size <= limit_mib:
        return None
    largest = sorted(files, key=lambda f: -f.stat().st_size)[:4]
    big = ", ".join(f"{f.name} {f.stat().st_size / 2**20:.1f}" for f in largest)
    return (f"{wheel_dir} holds {size:.1f} MiB (largest, MiB: {big}); it travels in `carry`, which takes "
            f"{CARRY_LIMIT_MIB} MiB in all, so it may hold {limit_mib:.0f} MiB: remove the wheels gpu_check does "
            f"not need (it needs megatron-core only) and run tools/gpu_check.sh --download-wheels again")
