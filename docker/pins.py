#!/usr/bin/env python3
"""The container's package pins, from the project's own files (requirements/lock.txt,
requirements/sglang-contract.txt, docker/requirements-*.txt). Standard library only: it runs in the NGC base
image before anything is installed, and in tests.

  python docker/pins.py base                 # the base image's torch stack, frozen at its installed versions
  python docker/pins.py constraints BASE     # lock.txt + sglang's closure minus the base's (pip -c)
  python docker/pins.py sglang-install BASE  # requirements-sglang.txt minus what the base image owns
  python docker/pins.py check [--base BASE] [--gpu]  # every pin the image installs is what is installed
  python docker/pins.py sglang-closure PY    # regenerate requirements-sglang.txt from the env of
                                             # tools/sglang_env.sh (PY = its python)

Why the base image "owns" packages: NGC's torch, Transformer Engine, Apex and their CUDA libraries are one
source build. pip must never replace them (a PyPI torch over NGC's would break TE's and Apex's extensions),
so the lock's torch/triton/nvidia-*/cuda-* pins become constraints on the versions NGC ships instead."""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
CONTRACT = ROOT / "requirements" / "sglang-contract.txt"
TRAINER = ROOT / "docker" / "requirements-trainer.txt"
SGLANG = ROOT / "docker" / "requirements-sglang.txt"

# Names the NGC PyTorch image builds from source (or that only make sense with its torch): never installed
# from PyPI over the base. Prefixes cover the CUDA wheels (nvidia-cublas, cuda-bindings, ...).
BASE_NAMES = {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "pytorch-triton",
              "transformer-engine", "transformer-engine-cu12", "transformer-engine-cu13",
              "transformer-engine-torch", "apex", "flash-attn"}
BASE_PREFIXES = ("nvidia-", "cuda-")
# sglang-closure leaves these out: multimodal packages that pin a PyPI torch ABI (NGC ships its own
# torchvision), and the test tools of the contract env.
SGLANG_SKIP = {"torchaudio", "torchcodec", "torchvision", "pytest", "pytest-timeout", "iniconfig", "pluggy"}
TE_FLOOR = (2, 0)  # setup.py's gpu extra: transformer-engine[pytorch]>=2.0


def norm(name: str) -> str:
    """PEP 503 name: Foo_Bar.baz -> foo-bar-baz."""
    return re.sub(r"[-_.]+", "-", name).lower()


def base_owned(name: str) -> bool:
    n = norm(name)
    return n in BASE_NAMES or n.startswith(BASE_PREFIXES)


def read_pins(path: Path) -> dict[str, tuple[str, str]]:
    """normalized name -> (the requirement as written, without version; version) of a `name==version` file.
    Any other requirement form is an error: the image installs only exact pins."""
    out: dict[str, tuple[str, str]] = {}
    for i, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9_,.-]+\])?==([A-Za-z0-9.+!_-]+)", line)
        if not m:
            raise ValueError(f"{path}:{i}: {raw.strip()!r} is not an exact pin `name==version`")
        name = norm(m.group(1))
        if name in out:
            raise ValueError(f"{path}:{i}: {m.group(1)} is pinned twice")
        out[name] = (m.group(1) + (m.group(2) or ""), m.group(3))
    return out


def installed() -> dict[str, str]:
    """name -> version of what is installed. A vendored copy's metadata (setuptools puts its _vendor folder, with
    packaging's and platformdirs' dist-info, on sys.path once imported) is not an installed package; of two
    copies the first on sys.path is the one imported."""
    out: dict[str, str] = {}
    for d in md.distributions():
        name = d.metadata["Name"]
        if name and "_vendor" not in str(d.locate_file("")):
            out.setdefault(norm(name), d.version)
    return out


def base_freeze(have: dict[str, str]) -> list[str]:
    """`name==version` of every base-owned package installed now (run before anything else is installed)."""
    return [f"{n}=={v}" for n, v in sorted(have.items()) if base_owned(n)]


def base_problems(have: dict[str, str], python: tuple[int, int]) -> list[str]:
    """Why this base image cannot carry the lock: wrong Python, or a torch release other than the lock's."""
    lock_torch = read_pins(LOCK)["torch"][1]
    out = []
    if python != (3, 12):
        out.append(f"the base has Python {python[0]}.{python[1]}; the lock and megatron-core 0.19 need 3.12: "
                   "pick another NGC_TAG (docs/container.md)")
    if "torch" not in have:
        out.append("the base has no torch: NGC_TAG must name an nvcr.io/nvidia/pytorch image")
    elif _release(have["torch"]) != _release(lock_torch):
        out.append(f"the base has torch {have['torch']}, the lock pins {lock_torch}: pick the NGC_TAG whose "
                   f"PyTorch is {'.'.join(map(str, _release(lock_torch)))} (docs/container.md)")
    return out


def lock_constraints(base: set[str]) -> list[str]:
    """pip -c for the trainer's install: the lock's pins and sglang's closure (so that packages both need,
    e.g. grpcio for ray[default], get one version), minus base-owned names: the base's versions stand."""
    pins = {**read_pins(SGLANG), **read_pins(LOCK)}
    return [f"{req.split('[')[0]}=={v}" for n, (req, v) in pins.items() if not base_owned(n) and n not in base]


def sglang_install(base: set[str]) -> list[str]:
    return [f"{req}=={v}" for n, (req, v) in read_pins(SGLANG).items() if n not in base]


def _release(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:2])


def check(have: dict[str, str], base: set[str] | None = None, gpu: bool = False,
          files: tuple[Path, ...] = (TRAINER, SGLANG)) -> list[str]:
    """Problems with the installed environment, [] when it is the pinned one. `base`: the names the base
    image provided (`pins.py base`), whose versions stand; without it, every base-owned name."""
    kept = base if base is not None else {n for n in have if base_owned(n)}
    problems = []
    lock = read_pins(LOCK)
    for path in files:
        for n, (req, v) in read_pins(path).items():
            if n in kept:
                continue
            if n not in have:
                problems.append(f"{req}=={v} ({path.name}) is not installed")
            elif have[n] != v:
                problems.append(f"{req} is {have[n]}, {path.name} pins {v}")
    for n, (req, v) in lock.items():  # transitive packages the lock knows must be at its versions too
        if n in have and have[n] != v and n not in kept:
            problems.append(f"{req} is {have[n]}, lock.txt pins {v}")
    # the base's torch must be the lock's torch release (NGC numbers it e.g. 2.14.0a0+<git>)
    problems += base_problems(have, sys.version_info[:2])
    te = next((have[n] for n in ("transformer-engine", "transformer-engine-torch") if n in have), None)
    if te is None or _release(te) < TE_FLOOR:
        problems.append(f"Transformer Engine is {te}; setup.py's gpu extra needs >= {'.'.join(map(str, TE_FLOOR))}")
    if gpu:
        for mod in ("torch", "transformer_engine.pytorch", "megatron.core", "sgl_kernel", "flashinfer", "sglang"):
            try:
                __import__(mod)
            except Exception as e:  # noqa: BLE001 - any import failure is a broken image
                problems.append(f"import {mod}: {type(e).__name__}: {e}")
        import torch
        if not torch.cuda.is_available():
            problems.append("torch.cuda.is_available() is False (run on a GPU node: --nv / pyxis)")
    return problems


def sglang_closure(python: str) -> str:
    """requirements-sglang.txt from the real resolution of the contract pins (tools/sglang_env.sh): every
    package of that env except the lock's (installed at the lock's versions) and the base's."""
    freeze = subprocess.run([python, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                            check=True).stdout
    contract = read_pins(CONTRACT)
    lock = read_pins(LOCK)
    lines = []
    for raw in freeze.splitlines():
        if "==" not in raw:
            continue
        name, v = raw.split("==", 1)
        n = norm(name)
        # sglang's own CUDA packages (nvidia-cutlass-dsl, cuda-python, ...) stay; the torch build does not
        if n in lock or n in BASE_NAMES or n in SGLANG_SKIP or n in {"pip", "setuptools", "wheel"}:
            continue
        if n in contract and contract[n][1] != v:
            raise SystemExit(f"{python}: {name} is {v}, the contract pins {contract[n][1]}; rebuild the env")
        lines.append(f"{name}=={v}")
    head = ("# sglang==0.5.23's closure for the image (docker/Dockerfile installs it with --no-deps), generated by\n"
            "# `python docker/pins.py sglang-closure $(tools/sglang_env.sh)` from the real resolution of\n"
            "# requirements/sglang-contract.txt, minus the lock's packages (installed at the lock's versions)\n"
            "# and the NGC base's torch stack. Do not edit by hand.\n")
    return head + "\n".join(sorted(lines, key=str.lower)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("base")
    for c in ("constraints", "sglang-install"):
        sub.add_parser(c).add_argument("base_file", type=Path, help="the output of `pins.py base`")
    c = sub.add_parser("check")
    c.add_argument("--base", type=Path, help="the output of `pins.py base` (default: the base-owned names)")
    c.add_argument("--gpu", action="store_true", help="also import the CUDA extensions and see a GPU")
    sub.add_parser("sglang-closure").add_argument("python", help="python of tools/sglang_env.sh's env")
    a = p.parse_args(argv)
    if a.cmd == "base":
        have = installed()
        bad = base_problems(have, sys.version_info[:2])
        if bad:
            print("\n".join(f"pins: {b}" for b in bad), file=sys.stderr)
            return 2
        print("\n".join(base_freeze(have)))
    elif a.cmd in ("constraints", "sglang-install"):
        base = set(read_pins(a.base_file))
        print("\n".join(lock_constraints(base) if a.cmd == "constraints" else sglang_install(base)))
    elif a.cmd == "check":
        base = set(read_pins(a.base)) if a.base else None
        problems = check(installed(), base=base, gpu=a.gpu)
        for line in problems:
            print(f"pins: {line}", file=sys.stderr)
        if problems:
            return 1
        print(f"pins: ok ({len(read_pins(TRAINER)) + len(read_pins(SGLANG))} pinned packages at their versions)")
    else:
        sys.stdout.write(sglang_closure(a.python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
