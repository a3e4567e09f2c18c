"""The tiny demo's states captured by vLLM beside HF's: docs/engines.md's figures for `extract.engine=vllm`.

    .venv/bin/python examples/vllm_extract_demo.py

Runs `+experiment=tiny_eagle3` with regeneration off (both engines then see the same sequences: the data set's
responses) and `stages=[extract,train,eval]` twice in a fresh outputs folder (reusing a tiny target built before
when one is there): with `extract.engine=hf` and with `extract.engine=vllm` (vLLM's own extractor, from
`$VLLM_PYTHON` or outputs/vllm-env). Prints the largest difference between the two extractions' states (relative
to each tensor's largest value), whether their token ids and masks are equal, each run's extraction rate, and
eval's acc_0 to acc_2 and expected accept length for the draft trained on each.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent


def run(outputs: Path, engine: str) -> dict:
    run_dir = outputs / "runs" / engine
    command = [
        sys.executable, "-m", "orchestrator", "+experiment=tiny_eagle3", f"outputs_dir={outputs}",
        f"hydra.run.dir={run_dir}", "data.regenerate.enabled=false", "stages=[extract,train,eval]",
        f"extract.engine={engine}",
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return json.loads((run_dir / "summary.json").read_text())


def compare(hf_dir: Path, vllm_dir: Path) -> tuple[dict[str, float], bool]:
    worst: dict[str, float] = {}
    same_tokens = True
    for shard in sorted(hf_dir.glob("*/shard_*.safetensors")):
        a, b = load_file(str(shard)), load_file(str(vllm_dir / shard.relative_to(hf_dir)))
        for key, x in a.items():
            if x.is_floating_point():
                rel = float((x.float() - b[key].float()).abs().max() / x.float().abs().max())
                worst[key] = max(worst.get(key, 0.0), rel)
            else:
                same_tokens &= torch.equal(x, b[key])
    return worst, same_tokens


def main() -> None:
    outputs = Path(tempfile.mkdtemp(prefix="vllm_extract_demo_"))
    built = Path(os.environ.get("EAGLE_ORCH_OUTPUTS", ROOT / "outputs")) / "cache" / "targets"
    if built.exists():
        shutil.copytree(built, outputs / "cache" / "targets", ignore=shutil.ignore_patterns("*.lock"))
    started = time.perf_counter()
    summaries = {engine: run(outputs, engine) for engine in ("hf", "vllm")}
    seconds = time.perf_counter() - started
    dirs = {e: Path(s["stages"]["extract"]["output"]) for e, s in summaries.items()}
    worst, same_tokens = compare(dirs["hf"], dirs["vllm"])
    print(f"tiny_eagle3, regeneration off, extract+train+eval per engine; {seconds / 60:.1f} min in all")
    print(f"states, largest difference relative to the tensor's largest value: {json.dumps(worst)}")
    print(f"token ids, loss masks and sequence lengths equal: {same_tokens}")
    print("| extract.engine | extract tok/s | eval acc_0 | acc_1 | acc_2 | expected accept length |")
    print("|---|---|---|---|---|---|")
    for engine, s in summaries.items():
        e, x = s["stages"]["eval"], s["stages"]["extract"]
        print(f"| {engine} | {x['tokens_per_s']:.0f} | {e['acc_0']:.3f} | {e['acc_1']:.3f} | {e['acc_2']:.3f} | "
              f"{e['expected_accept_length']:.3f} |")  # fmt: skip
    delta = abs(summaries["vllm"]["stages"]["eval"]["acc_0"] - summaries["hf"]["stages"]["eval"]["acc_0"])
    print(f"acc_0 difference: {delta:.4f}")


if __name__ == "__main__":
    main()
