"""The layer-search demo, timed, and the figures docs/experiments.md quotes.

    .venv/bin/python examples/search_demo.py [hydra overrides...]

Runs `python -m orchestrator +experiment=tiny_layer_search` (a fresh study in a fresh outputs folder, reusing a
tiny target built before when one is there), then prints the wall time, the trials by state, the baseline's
value and the best point's, from the study's search.json.
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


def main(extra: list[str]) -> None:
    outputs = Path(tempfile.mkdtemp(prefix="search_demo_"))
    built = Path(os.environ.get("EAGLE_ORCH_OUTPUTS", "outputs")) / "cache" / "targets"
    if built.exists():  # the tiny target is the demo's, not the search's: reuse a built one
        shutil.copytree(built, outputs / "cache" / "targets", ignore=shutil.ignore_patterns("*.lock"))
    command = [sys.executable, "-m", "orchestrator", "+experiment=tiny_layer_search", f"outputs_dir={outputs}", *extra]
    started = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - started
    study = next((outputs / "search").iterdir())
    summary = json.loads((study / "search.json").read_text())
    trials = summary["trials"]
    # A trial either ran its point's jobs, or took a point's first outcome without a job (a re-proposal), or was
    # asked again because another trial was running its point, or was rejected before any job.
    ran = [t for t in trials if t["duplicate_of"] is None and t["in_flight_of"] is None and not t["rejected"]]
    again = [t for t in trials if t["duplicate_of"] is not None]
    in_flight = [t for t in trials if t["in_flight_of"] is not None]
    rejected = [t for t in trials if t["rejected"]]
    by_state = {s: sum(t["state"] == s for t in ran) for s in ("complete", "pruned", "fail")}
    distinct = len({tuple(t["aux_layers"]) for t in ran})
    print(f"command: {' '.join(command[1:])}")
    print(f"wall time: {seconds / 60:.1f} min for {len(trials)} trials, extraction included")
    print(
        f"points run: {len(ran)} trials ran jobs for {distinct} distinct points: {by_state['complete']} complete, "
        f"{by_state['pruned']} pruned, {by_state['fail']} failed"
    )
    print(
        f"re-proposals: {len(again)} trials proposed a point already ended and took its outcome without a job "
        f"({sum(t['state'] == 'complete' for t in again)} complete, {sum(t['state'] == 'pruned' for t in again)} "
        f"pruned); {len(in_flight)} asked again while their point ran; {len(rejected)} rejected before any job"
    )
    base, best = summary["baseline"], summary["best"]
    print(
        f"{summary['objective']}: baseline {base['aux_layers']} = {base['value']:.3f}; "
        f"best {best['aux_layers']} = {best['value']:.3f} (trial {best['number']})"
    )
    sampled = [
        t for t in trials if t["state"] == "complete" and not t["baseline"] and t["aux_layers"] != base["aux_layers"]
    ]
    if sampled:
        top = max(sampled, key=lambda t: t["value"])
        print(
            f"best point the sampler proposed: {top['aux_layers']} = {top['value']:.3f} (trial {top['number']}): "
            f"{'at least as good as' if top['value'] >= base['value'] else 'below'} the baseline"
        )
    pruned = [t for t in trials if t["state"] == "pruned"]
    for t in pruned:
        print(f"pruned: trial {t['number']} {t['aux_layers']} at training step {t['pruned_at_step']}")
    print(
        f"study: {summary['storage']}; MLflow parent run {summary['mlflow_parent_run_id']} ({summary['tracking_uri']})"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
