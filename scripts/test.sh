#!/usr/bin/env bash
# The whole test set-up on a fresh machine: the project's venv, a real single-node Slurm cluster for the
# Slurm tests, then pytest. `.ci/run` runs exactly this. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -c requirements.lock -e '.[dev]'

state_dir="$PWD/outputs/slurm-test"
cleanup() { bash scripts/slurm_cluster.sh stop "$state_dir" >/dev/null 2>&1 || true; }
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  bash scripts/slurm_cluster.sh install
  rm -rf "$state_dir"  # fresh Slurm state: job ids restart, no stale submitit results
  trap cleanup EXIT
  eval "$(bash scripts/slurm_cluster.sh start "$state_dir")"
  export SLURM_CONF
else
  echo "not root with apt-get: the Slurm tests will be skipped" >&2
fi

export MLFLOW_DISABLE_TELEMETRY=true
.venv/bin/python -m pytest "$@"
