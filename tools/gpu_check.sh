#!/usr/bin/env bash
# The GPU check in one command, for a CUDA machine (docs/actor.md, "GPU check"): prints one JSON summary on
# stdout (progress and a goal table on stderr) and ends within 9 minutes: the script's own budget is 510 s
# (the parts' budgets add up to no more; it checks that before it starts), the hard stop behind it 540 s, so one
# device command (600 s at most) holds it and a 15-minute device lease has room to rerun failed parts.
#   tools/gpu_check.sh [--out FILE] [--parts qwen3_1p7b,hf_1p7b,...]   # any benchmarks/gpu_check.py option
#   tools/gpu_check.sh --dry-run           # any machine: the plan and its budgets; exit 2 if they don't fit
#   tools/gpu_check.sh --profile DIR --out FILE   # issue 51's run: also one profiled step per dense part
#                                          # (a table in FILE, gzipped chrome traces in DIR), MFU as always
#   tools/gpu_check.sh --download-wheels   # on a machine with network: megatron-core's wheel into .whl/ (fails
#                                          # past 48 MiB: carry takes 64 MiB in all)
# The GPU machine may be bare and offline: benchmarks/gpu_check.py installs megatron-core from .whl/ (git-ignored)
# when it is not importable. PYTHON selects the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--download-wheels" ]; then
  ver=$(grep -i '^megatron[-_]core==' requirements/lock.txt | cut -d= -f3)
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "megatron-core==$ver"
  # .whl/ travels to the device machine with `carry`, which takes 64 MiB in all: at most 48 MiB of it here
  # (gpu_parts/wheels.py wheel_dir_problem; megatron-core 0.19.2: 2.3 MB). `--dry-run` checks it too.
  if ! "$PY" -c 'import sys; sys.path.insert(0, "benchmarks"); from gpu_parts.wheels import wheel_dir_problem as p
e = p(); print("gpu_check.sh: " + e, file=sys.stderr) if e else None; sys.exit(2 if e else 0)'; then
    exit 2
  fi
  echo ".whl/: $(du -sh .whl | cut -f1) ($(ls .whl | tr '\n' ' '))"
  exit 0
fi
export PYTHONUNBUFFERED=1
# the hard stop follows the script's budget (510 s, or the last --budget-s given): budget + 30 s
budget=510 margin=30 prev=
for a in "$@"; do
  if [ "$prev" = "--budget-s" ]; then budget=$a; fi
  case "$a" in --budget-s=*) budget=${a#--budget-s=} ;; esac
  prev=$a
done
stop=$(awk -v b="$budget" -v m="$margin" 'BEGIN { printf "%d", b + m + 0.5 }')
exec timeout -k 10 "$stop" "$PY" benchmarks/gpu_check.py --budget-s 510 "$@"
