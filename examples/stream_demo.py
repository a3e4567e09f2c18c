"""The tiny demo's draft trained online (train.states=stream) beside the one trained offline: the figures in
docs/streaming.md and the README.

    .venv/bin/python examples/stream_demo.py

Runs `+experiment=tiny_eagle3` with regeneration off (every run then trains on the same sequences: the data set's
responses) and `stages=[extract,train,eval]` in a fresh outputs folder (reusing a tiny target built before when
one is there):
- offline: HF's states stored by the extraction, read by training;
- stream, HF: the train split's states computed by a capture service running HF's capture as training asks;
- stream, vLLM: the same with vLLM's extractor as the service (from `$VLLM_PYTHON` or outputs/vllm-env; skipped
  where there is none).

Prints, for each: eval's acc_0 and expected accept length, the train split's bytes stored by the extraction, and
for the streamed runs the spool's peak against its bound, the trainer's wait and the capture rate.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUFFER = 16 * 2**20  # train.stream.buffer_bytes: 16 MiB, a few steps of the tiny target's states


def run(outputs: Path, name: str, *overrides: str) -> dict:
    run_dir = outputs / "runs" / name
    command = [
        sys.executable, "-m", "orchestrator", "+experiment=tiny_eagle3", f"outputs_dir={outputs}",
        f"hydra.run.dir={run_dir}", "data.regenerate.enabled=false", "stages=[extract,train,eval]",
        f"train.stream.buffer_bytes={BUFFER}", *overrides,
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return json.loads((run_dir / "summary.json").read_text())


def train_bytes_stored(summary: dict) -> int:
    manifest = json.loads((Path(summary["stages"]["extract"]["output"]) / "manifest.json").read_text())
    return sum(s["bytes"] for s in manifest["splits"]["train"]["shards"])


def main() -> None:
    outputs = Path(tempfile.mkdtemp(prefix="stream_demo_"))
    built = Path(os.environ.get("EAGLE_ORCH_OUTPUTS", ROOT / "outputs")) / "cache" / "targets"
    if built.exists():
        shutil.copytree(built, outputs / "cache" / "targets", ignore=shutil.ignore_patterns("*.lock"))
    vllm = os.environ.get("VLLM_PYTHON") or str(ROOT / "outputs" / "vllm-env" / "bin" / "python")
    runs = {
        "offline": ["train.states=offline"],
        "stream, HF": ["train.states=stream"],
    }
    if Path(vllm).is_file():
        runs["stream, vLLM"] = ["train.states=stream", "extract.engine=vllm", f"extract.python={vllm}"]
    else:
        print(f"no vLLM environment at {vllm}: the vLLM service is skipped (bash scripts/make_vllm_env.sh)")
    for name, overrides in runs.items():
        summary = run(outputs, name.replace(", ", "_"), *overrides)
        ev, stream = summary["stages"]["eval"], summary["stages"]["train"].get("stream")
        line = (
            f"{name:13s} eval acc_0 {ev['acc_0']:.4f}, expected accept length {ev['expected_accept_length']:.3f}; "
            f"train split stored by extract: {train_bytes_stored(summary):,} bytes"
        )
        if stream:
            line += (
                f"; spool peak {stream['peak_spool_bytes']:,} bytes (bound {stream['buffer_bytes']:,}); "
                f"trainer waited {stream['wait_s']:.1f} s; capture {stream['capture_tokens_per_s']:,.0f} tokens/s"
            )
        print(line, flush=True)
    shutil.rmtree(outputs)


if __name__ == "__main__":
    main()
