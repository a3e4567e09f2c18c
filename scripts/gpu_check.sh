#!/usr/bin/env bash
# The GPU check, as one prepared script: the tiny demo with every stage on CUDA, then the GPU training benchmark,
# then one JSON line with what ran where and what it measured.
#
#   bash scripts/gpu_check.sh          on a single-GPU Linux machine with PyTorch, transformers and triton and no
#                                      network: the project's other pure-Python dependencies travel as wheels in
#                                      .whl/ (made here by scripts/gpu_wheels.py) and are installed to /tmp/site
#   bash scripts/gpu_check.sh --cpu    the same steps, reduced, on the CPU (tests/test_gpu_check.py runs it in CI)
#   bash scripts/gpu_check.sh --dry-run  the GPU run's own arguments through the real parsers, with no GPU: the
#                                      demo's plan (dry_run=true) and the benchmark's (--dry-run); CI runs it too
#
# Results go to $GPU_CHECK_OUT (default: $OUT when it is set, else outputs/gpu_check). Exits
# non-zero when a stage did not run on the device asked for.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=cuda
dry=0
[ "${1:-}" = "--cpu" ] && mode=cpu
[ "${1:-}" = "--dry-run" ] && dry=1
out_dir="${GPU_CHECK_OUT:-${OUT:-outputs/gpu_check}}"
out="$(mkdir -p "$out_dir" && cd "$out_dir" && pwd)"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python

if [ "$mode" = cuda ] && [ "$dry" = 0 ] && compgen -G ".whl/*.whl" >/dev/null; then  # the GPU machine's missing packages
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true

if [ "$mode" = cuda ]; then
  gpus=1
  demo=()
  # --estimate-memory: the fake-tensor estimate beside the measured peak, so that this run calibrates it
  bench=(--device cuda --shape kimi --seqs 2048 8192 --steps 10 --warmup 3 --specforge-backends flex_attention sdpa
         --estimate-memory)
else
  gpus=0
  # the test suite's reduced tiny experiment (tests/conftest.py FAST)
  demo=(serve=reference target.tiny.train.steps=60 target.tiny.train.max_files=80 data.max_files=80 data.max_train_conversations=96
        data.max_val_conversations=16 data.max_seq_len=160 extract.shard_conversations=32 train.max_steps=16
        train.val_every=8 train.checkpoint_every=4 train.log_every=4 eval.max_conversations=8 serve.prompts=4
        serve.max_new_tokens=24 serve.concurrency=[1] serve.repeats=1 serve.accept_prompts=null)
  bench=(--device cpu --shape tiny --seqs 64 --steps 2 --warmup 1)
fi
if [ "$dry" = 1 ]; then
  demo+=(dry_run=true)
  bench+=(--dry-run)
fi

started=$(date +%s)
"$python" -m orchestrator +experiment=tiny_eagle3 cluster=local run_name=gpu_check \
  "outputs_dir=${GPU_CHECK_OUTPUTS:-$out/outputs}" "hydra.run.dir=$out/run" \
  extract.resources.gpus_per_node=$gpus train.resources.gpus_per_node=$gpus \
  eval.resources.gpus_per_node=$gpus serve.resources.gpus_per_node=$gpus "${demo[@]}" >"$out/demo.log" 2>&1 \
  || { tail -50 "$out/demo.log"; exit 1; }
demo_s=$(( $(date +%s) - started ))

"$python" benchmarks/bench_train_gpu.py "${bench[@]}" --json "$out/bench.json" >"$out/bench.log" 2>&1 \
  || { tail -50 "$out/bench.log"; exit 1; }

if [ "$dry" = 1 ]; then  # what the GPU run would do: each stage's planned GPUs and precision, the benchmark's plan
  "$python" - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
plan = json.loads((out / "run" / "plan.json").read_text())
line = {
    "mode": "cuda-dry-run",
    "stage_gpus": {s["stage"]: s["resources"]["gpus_per_node"] for s in plan["stages"]},
    "stage_precisions": {s["stage"]: s["precision"] for s in plan["stages"]},
    "bench": json.loads((out / "bench.json").read_text()),
}
print(json.dumps(line))
PY
  exit 0
fi

# the JSON line (scripts/gpu_check_line.py, which tests/test_gpu_check.py also runs on constructed results)
"$python" scripts/gpu_check_line.py "$out" "$mode" "$demo_s"
