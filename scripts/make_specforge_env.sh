#!/usr/bin/env bash
# A separate virtual environment holding SpecForge's wheel, for running its EAGLE-3 training step on this CPU beside
# the project's (benchmarks/bench_train_gpu.py --device cpu; tests/test_bench_train_gpu.py), as the GPU machine runs
# it (scripts/gpu_check.sh): SpecForge installed with --no-deps over torch, transformers and triton.
#
#   bash scripts/make_specforge_env.sh [VENV_DIR]     # default: outputs/specforge-env in the checkout
#   TRITON_INTERPRET=1 PYTHONPATH=. VENV_DIR/bin/python benchmarks/bench_train_gpu.py --device cpu --shape tiny ...
#
# SpecForge never goes into the project's own environment: its wheel pins torch==2.11.0, transformers==5.8.1 and
# sglang==0.5.14. As on the GPU machine it goes in with --no-deps; what its EAGLE-3 training imports (torch,
# transformers, triton) comes at the project's pinned versions (requirements.lock), torch==2.13.0 being the CPU
# wheel this machine keeps on local disk. Its loss is a triton kernel (specforge/core/loss.py): on a CPU it runs in
# triton's interpreter (TRITON_INTERPRET=1), which executes the kernel's own code on the host, block by block. The
# project itself (orchestrator/) is read from the checkout with PYTHONPATH, with omegaconf as on the GPU machine.
#
# Environment overrides:
#   SPECFORGE_VERSION   (default 0.2.0: the version scripts/gpu_wheels.py ships to the GPU machine)
#   TRITON_VERSION      (default 3.9.0)
#   PYTHON              interpreter that creates the venv (default python3; SpecForge needs 3.11+)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV_DIR="${1:-$ROOT/outputs/specforge-env}"
SPECFORGE_VERSION="${SPECFORGE_VERSION:-0.2.0}"
TRITON_VERSION="${TRITON_VERSION:-3.9.0}"
PYTHON="${PYTHON:-python3}"

log() { echo "[make_specforge_env] $*" >&2; }

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
  log "creating $VENV_DIR with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV_DIR"
fi
PY="$VENV_DIR/bin/python"

if ! "$PY" -c "import sys, importlib.metadata as m; sys.exit(m.version('specforge') != '$SPECFORGE_VERSION' or m.version('triton') != '$TRITON_VERSION')" 2>/dev/null; then
  log "installing specforge==$SPECFORGE_VERSION (--no-deps) over torch==2.13.0, triton==$TRITON_VERSION and the project's pins"
  "$PY" -m pip install --quiet -c "$ROOT/requirements.lock" torch==2.13.0 "triton==$TRITON_VERSION" transformers \
    safetensors numpy rich omegaconf antlr4-python3-runtime
  "$PY" -m pip install --quiet --no-deps "specforge==$SPECFORGE_VERSION"
fi
TRITON_INTERPRET=1 "$PY" - "$SPECFORGE_VERSION" <<'PYEOF'
import sys
from importlib.metadata import version

import specforge.algorithms.eagle3.model  # noqa: F401  (imports triton for the loss)
import specforge.modeling.draft.llama3_eagle  # noqa: F401
import specforge.optimizer  # noqa: F401

installed = version("specforge")
if installed != sys.argv[1]:
    sys.exit(f"specforge {installed} installed, expected {sys.argv[1]}")
print(f"specforge {installed} imports (triton {version('triton')}, torch {version('torch')})", file=sys.stderr)
PYEOF
log "done: export SPECFORGE_PYTHON=$(cd "$VENV_DIR" && pwd)/bin/python"
