#!/usr/bin/env bash
# Build, once per machine, the virtual environment of `make test-sglang` (requirements/sglang-contract.txt:
# the pinned sglang, sglang-router and pytest) and print its python. It lives OUTSIDE the checkout, under
# ${M2PO_CACHE_DIR:-~/.cache/m2po}/sglang-env-<hash of the pins and the interpreter>, so every clone on the
# machine shares it; about 11 GB and 3-4 minutes the first time. SGLANG_PYTHON picks the interpreter
# (default python3; 3.10-3.12). A build that was interrupted is redone: the stamp is written last.
set -euo pipefail
cd "$(dirname "$0")/.."
PINS=requirements/sglang-contract.txt
PY=${SGLANG_PYTHON:-python3}
ver=$("$PY" -c 'import sys; v = sys.version_info[:2]; assert (3, 10) <= v <= (3, 12); print("%d.%d" % v)') \
  || { echo "error: $PY is not Python 3.10-3.12; set SGLANG_PYTHON" >&2; exit 2; }
key=$( { cat "$PINS"; echo "$ver"; } | sha256sum | cut -c1-16)
root=${M2PO_CACHE_DIR:-$HOME/.cache/m2po}
env="$root/sglang-env-$key"
mkdir -p "$root"
exec 9>"$env.lock"
flock 9  # two builds at once would share one directory
if [ ! -f "$env/.complete" ]; then
  echo "[sglang-env] building $env with $PY (pins: $PINS); ~11 GB, 3-4 min" >&2
  rm -rf "$env"
  "$PY" -m venv "$env"
  # (pip's notes about absent local index folders of some machines are filtered out)
  "$env/bin/python" -m pip install -q --upgrade pip 2> >(grep -v '^WARNING: Location' >&2) >&2
  "$env/bin/python" -m pip install -q -r "$PINS" 2> >(grep -v '^WARNING: Location' >&2) >&2
  touch "$env/.complete"
fi
echo "$env/bin/python"
