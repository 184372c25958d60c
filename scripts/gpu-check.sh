#!/usr/bin/env bash
# Runs scripts/gpu_check.py (issue #48) on a bare GPU box: Python 3.12, PyTorch and numpy,
# no package registry. With `--wheels DIR` it first installs, from the local wheels in DIR
# only, what is missing of NIXL (nixl-cu13) and msgspec; every other argument goes to the
# check. PYTHON picks the interpreter (default python3).
#
#   scripts/gpu-check.sh --wheels /data/wheels            # the check on cuda:0
#   scripts/gpu-check.sh --wheels /data/wheels --check-args
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

wheels=""
if [ "${1:-}" = "--wheels" ]; then
  [ $# -ge 2 ] || { echo "gpu-check.sh: --wheels needs a directory" >&2; exit 2; }
  wheels=$2
  shift 2
  [ -d "$wheels" ] || { echo "gpu-check.sh: no wheel directory $wheels" >&2; exit 2; }
fi

has() { "$PY" -c "import importlib.util as u, sys; sys.exit(not any(u.find_spec(m) for m in sys.argv[1:]))" "$@"; }

if [ -n "$wheels" ]; then
  # Into a directory of its own, put first on PYTHONPATH: a system Python refuses pip
  # installs (PEP 668), and nothing else on the box changes. --no-deps: nixl-cu13 asks
  # only for torch and numpy, which are already there and are not in DIR.
  deps=${GPU_CHECK_DEPS:-${TMPDIR:-/tmp}/kvpush-gpu-check-deps}
  export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}"
  want=()
  has nixl nixl_cu13 nixl_cu12 || want+=(nixl-cu13)
  has msgspec || want+=(msgspec)
  if [ ${#want[@]} -gt 0 ]; then
    echo "gpu-check.sh: installing ${want[*]} from $wheels into $deps"
    "$PY" -m pip install --quiet --no-index --no-deps --find-links "$wheels" \
      --target "$deps" "${want[@]}"
  fi
fi
exec "$PY" scripts/gpu_check.py "$@"
