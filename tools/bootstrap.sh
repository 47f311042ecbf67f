#!/usr/bin/env bash
# Create .venv with Python 3.12 and install the pinned stack; skipped when the stamp (a hash of the
# lock file and setup.py) says it is already done. Override the interpreter with PYTHON=/path/to/python3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
stamp="$VENV/.stamp-$(cat requirements/lock.txt setup.py | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  for c in python3.12 "$(command -v pyenv >/dev/null && echo "$(pyenv root)/versions/3.12*/bin/python3" || true)"; do
    for p in $c; do
      if [ -x "$(command -v "$p" 2>/dev/null || echo "$p")" ] && "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        echo "$p"; return
      fi
    done
  done
  if command -v pyenv >/dev/null && PYENV_VERSION=3.12.1 python3.12 -c '' 2>/dev/null; then
    PYENV_VERSION=3.12.1 python3.12 -c 'import sys; print(sys.executable)'; return
  fi
  echo "error: Python 3.12 not found (megatron-core 0.19 needs it). Install it, or set PYTHON=/path/to/python3.12" >&2
  exit 1
}

if [ ! -x "$VENV/bin/python" ]; then
  py=$(find_python)
  echo "[bootstrap] creating $VENV with $py"
  "$py" -m venv "$VENV"
fi
"$VENV/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || { echo "error: $VENV is not Python 3.12; remove it and re-run" >&2; exit 1; }
echo "[bootstrap] installing the pinned stack (requirements/lock.txt); ~2-3 min and ~6 GB the first time"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -c requirements/lock.txt -e '.[dev]' --config-settings editable_mode=compat
rm -f "$VENV"/.stamp-*
touch "$stamp"
echo "[bootstrap] done"
