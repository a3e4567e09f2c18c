#!/usr/bin/env bash
# A separate virtual environment holding sglang: it serves the demo's target with and without an EAGLE-3 draft on
# this CPU (docs/engines.md#sglang-on-a-cpu), parses launch commands without a GPU
# (docs/engines.md#checking-a-launch-command-without-a-gpu) and checks the draft's rope against sglang's own rotary
# embedding (tests/sglang_rope_probe.py).
#
#   bash scripts/make_sglang_env.sh [VENV_DIR]        # default: outputs/sglang-env
#   export SGLANG_PYTHON=VENV_DIR/bin/python          # then: pytest -m sglang
#
# sglang never goes into the project's own environment: its pins (torch, transformers, flashinfer, CUDA
# kernels) would fight ours. Here it is installed with --no-deps on top of the packages its CPU server imports,
# with the CPU torch pinned in the same command: sglang's own pins ask for torch 2.14.1 with CUDA (11 GB), its
# CUDA kernel packages (sglang-kernel, flashinfer, ...) do not load on a CPU, and PyPI's torchvision is built
# against CUDA torch. What stands in for sgl_kernel and torchvision on a CPU is the project's own
# (orchestrator/engines/sglang/cpu_kernels/, put on the path by its launch.py only where no sgl_kernel loads).
# A GPU node serving for real needs sglang's full dependency set instead (`pip install sglang==VERSION`).
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
  # for `sglang.launch_server` on a CPU (sglang 0.5.23's own pins where it has them)
  tokenizers==0.23.2
  fastapi
  "uvicorn>=0.51"
  uvloop
  setproctitle
  "prometheus-client>=0.20.0"
  python-multipart
  partial_json_parser
  interegular
  xgrammar==0.2.7
  "llguidance>=1.7.6,<2"
  openai==2.8.0
  openai-harmony==0.0.4
  tiktoken
  einops
  scipy
  pydantic
  regex
  watchfiles
  xxhash
  zstandard
  blobfile==3.0.0
  distro
  easydict
  nvidia-ml-py
  jsonschema
  soundfile==0.13.1
)

log() { echo "[make_sglang_env] $*" >&2; }

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
  log "creating $VENV_DIR with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV_DIR"
fi
PY="$VENV_DIR/bin/python"

log "installing the packages sglang's CPU server imports, with torch==2.13.0 (CPU) pinned"
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
log "importing SGLang's server, scheduler and CPU attention backend as the CPU launcher starts them"
"$PY" - "$(cd "$(dirname "$0")/../orchestrator/engines/sglang/cpu_kernels" && pwd)/launch.py" <<'EOF'
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("launch", sys.argv[1])  # by path: its folder stays off sys.path
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)

if not launch._loads("sgl_kernel"):  # what launch.main does where no sgl_kernel build loads
    launch.use_stand_in()
import sgl_kernel
import sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.srt.layers.attention.intel_amx_backend  # noqa: F401
import sglang.srt.managers.scheduler  # noqa: F401

where = "the project's stand-in" if getattr(sgl_kernel, "STAND_IN", False) else sgl_kernel.__file__
print(f"sglang's server imports, sgl_kernel from {where}", file=sys.stderr)
EOF
log "done: export SGLANG_PYTHON=$(cd "$VENV_DIR" && pwd)/bin/python"
