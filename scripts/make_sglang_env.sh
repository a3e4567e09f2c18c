#!/usr/bin/env bash
# A separate virtual environment holding sglang, for validating launch commands on a CPU machine
# (docs/engines.md#checking-a-launch-command-without-a-gpu)
# and for checking the draft's rope against sglang's own rotary embedding (tests/sglang_rope_probe.py).
#
#   bash scripts/make_sglang_env.sh [VENV_DIR]        # default: outputs/sglang-env
#   export SGLANG_PYTHON=VENV_DIR/bin/python          # then: pytest -m sglang
#
# sglang never goes into the project's own environment: its pins (torch, transformers, flashinfer, CUDA
# kernels) would fight ours. Here it is installed with --no-deps on top of the small set of packages that
# `import sglang.srt.server_args` needs, so `ServerArgs.add_cli_args` + `parse_args` run without a GPU, plus the
# few more that importing the EAGLE-3 draft model (`sglang.srt.models.llama_eagle3`) needs, so its decoder layer
# and rotary embedding can be built on a CPU (torchvision and vllm's kernels are stood in for by the probe; see
# tests/sglang_rope_probe.py). A GPU node serving for real needs sglang's full dependency set instead
# (`pip install sglang==VERSION`).
#
# Environment overrides:
#   SGLANG_VERSION   (default 0.5.23; the layer-id rules in orchestrator/layers.py are recorded per version)
#   PYTHON           interpreter that creates the venv (default python3)
set -euo pipefail

VENV_DIR="${1:-outputs/sglang-env}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
PYTHON="${PYTHON:-python3}"

# torch==2.13.0 is the CPU wheel on local disk; another spec may pull a multi-GB CUDA build.
BASE_PACKAGES=(
  torch==2.13.0
  transformers==5.19.0
  safetensors
  orjson
  psutil
  pybase64
  msgspec
  pyzmq
  ipython
  triton
  requests
  pillow
  starlette
  aiohttp
  # for `import sglang.srt.models.llama_eagle3` (versions: sglang 0.5.23's own pins where it has them)
  dill
  apache-tvm-ffi==0.1.11
  sentencepiece==0.2.1
  compressed-tensors==0.18.0
  gguf
)

log() { echo "[make_sglang_env] $*" >&2; }

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
  log "creating $VENV_DIR with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV_DIR"
fi
PY="$VENV_DIR/bin/python"

log "installing the packages sglang.srt.server_args and sglang.srt.models.llama_eagle3 import"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "${BASE_PACKAGES[@]}"
log "installing sglang==$SGLANG_VERSION --no-deps"
"$PY" -m pip install --quiet --no-deps "sglang==$SGLANG_VERSION"

"$PY" - "$SGLANG_VERSION" <<'EOF'
import argparse
import sys
from importlib.metadata import version

import sglang.srt.server_args as server_args

installed = version("sglang")
if installed != sys.argv[1]:
    sys.exit(f"sglang {installed} installed, expected {sys.argv[1]}")
parser = argparse.ArgumentParser()
server_args.ServerArgs.add_cli_args(parser)
parser.parse_args(["--model-path", "/nonexistent"])
print(f"sglang {installed}: ServerArgs.add_cli_args parses", file=sys.stderr)
EOF
log "importing the EAGLE-3 draft model as tests/sglang_rope_probe.py does"
"$PY" - "$(cd "$(dirname "$0")/../tests" && pwd)" <<'EOF'
import sys

sys.path.insert(0, sys.argv[1])
import sglang  # noqa: F401
import transformers.image_processing_utils  # noqa: F401
from sglang_rope_probe import install_stand_ins

install_stand_ins()
import torch
from sglang.srt.models import llama_eagle3  # noqa: F401

print(f"sglang.srt.models.llama_eagle3 imports (torch {torch.__version__})", file=sys.stderr)
EOF
log "done: export SGLANG_PYTHON=$(cd "$VENV_DIR" && pwd)/bin/python"
