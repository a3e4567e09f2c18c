#!/usr/bin/env bash
# A separate virtual environment holding vllm-project/speculators, for converting the project's SGLang-format
# EAGLE-3 draft into speculators' own format with speculators' own code (scripts/speculators_export.py) and for
# making the speculators fixtures under tests/data/drafts/speculators_<version>/.
#
#   bash scripts/make_speculators_env.sh [VENV_DIR]   # default: outputs/speculators-env in the checkout
#   VENV_DIR/bin/python scripts/speculators_export.py DRAFT_DIR TARGET_DIR OUT_DIR [--layer-ids 2,5,7]
#
# speculators never goes into the project's own environment: it pins transformers<=5.19.0 and its own set of packages.
# Unpinned, its torch requirement pulls PyPI's CUDA torch (about 6 GB), so torch==2.13.0 (the CPU wheel this
# machine keeps on local disk) goes into the same pip command. speculators requires torchvision and torchaudio,
# but PyPI's torchvision does not load beside that torch ("operator torchvision::nms does not exist") and then
# breaks transformers' PreTrainedModel import; speculators' code never imports them, so torchvision, torchaudio
# and torchcodec are removed.
#
# Environment overrides:
#   SPECULATORS_VERSION   (default 0.9.0; the fixtures in tests/data/drafts/ are recorded per version)
#   PYTHON                interpreter that creates the venv (default python3)
set -euo pipefail

VENV_DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/outputs/speculators-env}"
SPECULATORS_VERSION="${SPECULATORS_VERSION:-0.9.0}"
PYTHON="${PYTHON:-python3}"

log() { echo "[make_speculators_env] $*" >&2; }

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
  log "creating $VENV_DIR with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV_DIR"
fi
PY="$VENV_DIR/bin/python"

if ! "$PY" -c "import sys, importlib.metadata as m; sys.exit(m.version('speculators') != '$SPECULATORS_VERSION')" 2>/dev/null; then
  log "installing speculators==$SPECULATORS_VERSION (torch==2.13.0 from local disk)"
  "$PY" -m pip install --quiet torch==2.13.0 "speculators==$SPECULATORS_VERSION"
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$PY" - "$SPECULATORS_VERSION" <<'PYEOF'
import sys
from importlib.metadata import version

import speculators
import torch

installed = version("speculators")
if installed != sys.argv[1]:
    sys.exit(f"speculators {installed} installed, expected {sys.argv[1]}")
print(f"speculators {getattr(speculators, '__version__', installed)} imports (torch {torch.__version__})", file=sys.stderr)
PYEOF
log "done: $(cd "$VENV_DIR" && pwd)/bin/python scripts/speculators_export.py DRAFT_DIR TARGET_DIR OUT_DIR"
