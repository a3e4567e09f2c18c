"""The README's demo timed cold and warm in one run: where a user's first and second `python -m orchestrator
+experiment=tiny_eagle3` spend their time.

    .venv/bin/python benchmarks/bench_demo.py [hydra overrides...]

Cold: a fresh outputs folder (no cache, no MLflow store; the tiny target copied in from the repository's build,
orchestrator/tiny/shipped), with the environments already built (the README's first command installs them first;
their time is pip's). Warm: the same command again on that folder,
every stage's result cached. Each is the whole command as a process, timed from outside; the breakdown is the
run's own summary.json (each stage in its job and as a job, each server serve started). Prints one JSON line last.
Run it alone: a second CPU-bound process on 2 cores slows both.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.tiny.build import cpu_identity

ROOT = Path(__file__).resolve().parents[1]
# what the demo aims for on 2 cores, cold and warm
COLD_TARGET_S, WARM_TARGET_S = 120, 10


def timed_demo(outputs: Path, overrides: list[str]) -> dict:
    """The demo command on `outputs`: its wall time and its run's summary.json."""
    command = [sys.executable, "-m", "orchestrator", "+experiment=tiny_eagle3", f"outputs_dir={outputs}", *overrides]
    before = set(outputs.glob("runs/*/*/summary.json"))
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (summary,) = set(outputs.glob("runs/*/*/summary.json")) - before
    return {"seconds": round(seconds, 1), "summary": json.loads(summary.read_text())}


def breakdown(summary: dict) -> dict:
    serve = summary["stages"].get("serve", {})
    return {
        "stages_s": summary.get("seconds", {}),
        "jobs_s": summary.get("job_seconds", {}),
        "servers_s": serve.get("server_seconds", {}),
        "run_s": summary.get("total_seconds"),
    }


def workload(summary: dict) -> dict:
    ex, serve = summary["stages"]["extract"], summary["stages"]["serve"]
    return {
        "extracted_tokens": ex.get("tokens"),
        "answer_tokens_per_sequence": ex.get("loss_tokens_per_sequence"),
        "counted_requests": serve.get("accept_length_requests"),
    }


def main() -> None:
    overrides = sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="bench_demo_") as scratch:
        outputs = Path(scratch) / "outputs"
        cold = timed_demo(outputs, overrides)
        warm = timed_demo(outputs, overrides)
    serve = cold["summary"]["stages"]["serve"]
    line = {
        "cold_s": cold["seconds"],
        "warm_s": warm["seconds"],
        "warm_over_cold": round(warm["seconds"] / cold["seconds"], 3),
        "cold_target_s": COLD_TARGET_S,
        "warm_target_s": WARM_TARGET_S,
        "cold_within_target": cold["seconds"] < COLD_TARGET_S,
        "warm_within_target": warm["seconds"] < WARM_TARGET_S,
        "engine": f"{serve.get('engine')} {serve.get('engine_version')}",
        **cpu_identity(),  # the figures below hold on this processor (orchestrator/tiny/build.py: cpu_identity)
        "cold": breakdown(cold["summary"]),
        "warm": breakdown(warm["summary"]),
        # the figures the README and docs/measurements.md quote, the same cold and warm (warm takes them from the cache)
        "figures": {
            run: {
                k: s["summary"]["stages"][st].get(k)
                for st, k in (
                    ("eval", "expected_accept_length"),
                    ("serve", "accept_length"),
                    ("serve", "accept_length_counted"),
                    ("serve", "accept_length_ci95"),
                    ("serve", "accept_length_eval_prompts"),
                    ("serve", "speedup"),
                )
            }
            for run, s in (("cold", cold), ("warm", warm))
        },  # fmt: skip
        # the work the demo does, which its configuration bounds: tokens extracted (prompts and the target's answers)
        # and trained on, answered by the servers (timed passes and the per-request count)
        "workload": workload(cold["summary"]),
    }
    for run in ("cold", "warm"):
        b = line[run]
        stages = ", ".join(f"{k} {v}" + ("" if v == "cached" else " s") for k, v in b["stages_s"].items())
        servers = ", ".join(
            f"{k}: start {t['startup_s']} s, passes {t['measure_s']} s"
            + (f", count {t['count_s']} s" if "count_s" in t else "")
            for k, t in b["servers_s"].items()
        )
        print(f"{run}: {line[f'{run}_s']} s (target < {line[f'{run}_target_s']} s); stages in their jobs: {stages}")
        if servers:
            print(f"  servers: {servers}")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
