"""scripts/gpu_check.sh's last line: what ran where and what it measured, as one JSON line, from the demo's
summary.json and the training benchmark's bench.json under OUT. Exits non-zero when a stage did not run on the
device asked for, or, on a CUDA device, when SpecForge's rows of the benchmark were not measured.

    python scripts/gpu_check_line.py OUT MODE DEMO_SECONDS      (MODE: cuda or cpu)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path, mode: str, demo_s: int) -> int:
    summary = json.loads((out / "run" / "summary.json").read_text())
    stages = summary["stages"]
    devices = {s: r.get("compute", {}).get("device") for s, r in stages.items()}
    bench = json.loads((out / "bench.json").read_text())
    line = {
        "mode": mode,
        "stage_devices": devices,
        "stage_dtypes": {s: r.get("compute", {}).get("dtype") for s, r in stages.items()},
        "all_on_device": all(d == mode for d in devices.values()),
        "demo_s": demo_s,
        "train_val_acc_0": stages["train"].get("val_acc_0"),
        "eval_expected_accept_length": stages["eval"].get("expected_accept_length"),
        # the states eval's live target serves against those extracted for training (bf16 on the GPU: the rounding
        # that a tolerance on this distance would have to allow)
        "eval_served_states_rel_diff": stages["eval"].get("served_states_rel_diff"),
        "served_accept_length": stages["serve"].get("accept_length"),
        "speedup": stages["serve"].get("speedup"),
        # the engine that served and measured the speedup: on a GPU machine without CUDA vLLM the demo falls back to
        # the project's reference engine (serve.fallback), and says why here
        "engine": stages["serve"].get("engine"),
        "engine_version": stages["serve"].get("engine_version"),
        "engine_fallback": stages["serve"].get("engine_fallback"),
        # the machine the serve job recorded with its passes (orchestrator/compute.py hardware): on a GPU, nvidia-smi's
        # names of the node's GPUs after the processor's
        "serve_hardware": stages["serve"]["measured_by"]["baseline"][-1].get("hardware"),
        # bf16 on the GPU: the measured rate that serve.greedy_token_tolerance should be set from
        "greedy_differing_token_rate": stages["serve"].get("greedy_differing_token_rate"),
        "mismatch_flags": summary["mismatch_flags"],
        "bench": bench,
    }
    # SpecForge's rows: measured on a CUDA device, or the check failed (on the CPU they are skipped: its loss is a
    # triton GPU kernel)
    rows = [r for r in bench.get("results", []) if r["implementation"].startswith("specforge:")]
    line["specforge_measured"] = sum(r["status"] == "measured" for r in rows)
    line["specforge_missing"] = sorted({r.get("reason") or r["status"] for r in rows if r["status"] != "measured"})
    if mode == "cuda" and (not rows or line["specforge_missing"]):
        line["failed"] = f"SpecForge's rows were not measured on {mode}: {line['specforge_missing'] or 'none ran'}"
    # what those rows time is the project's training: SpecForge's loss on the project's draft, per TTT step
    same_loss = bench.get("targets", {}).get("same_loss", {})
    line["specforge_same_loss"] = same_loss.get("status")
    line["specforge_loss_rel_diff"] = (bench.get("agreement") or {}).get("ce_sum_rel_diff")
    if same_loss.get("status") == "FAIL":
        line["failed"] = f"{same_loss['target']}: FAIL ({bench.get('agreement')})"
    print(json.dumps(line))
    print(
        f"[gpu_check] served by {line['engine']} {line['engine_version'] or ''}"
        + (f", in place of the engine asked for: {line['engine_fallback']}" if line["engine_fallback"] else "")
        + f"; speedup {line['speedup']}; SpecForge rows measured: {line['specforge_measured']}"
        + f"; SpecForge's loss on the project's draft: {line['specforge_same_loss'] or 'not measured'}",
        file=sys.stderr,
    )
    return 0 if line["all_on_device"] and "failed" not in line else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
