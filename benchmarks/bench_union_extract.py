"""Time saved by extracting a layer sweep's union once (extract.extra_layers) instead of once per point.

    .venv/bin/python benchmarks/bench_union_extract.py [hydra overrides...]

Runs, in one process and on the same tiny target: (a) one extraction per sweep point, (b) one extraction of
the union with every point's training reading its subset. Prints both wall times and the ratio.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestrator import conf_dir
from orchestrator.config import load
from orchestrator.pipeline import run_pipeline
from orchestrator.targets import ensure_target

POINTS = ["[1,4,6]", "[0,3,6]", "[2,4,5]"]
UNION = "[0,1,2,3,4,5,6]"


def config(outputs: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return load(
            compose(
                "config",
                overrides=[
                    "+experiment=tiny_eagle3",
                    f"outputs_dir={outputs}",
                    "stages=[extract]",
                    "cluster=debug",
                    *overrides,
                ],
            )
        )


def main(extra: list[str]) -> None:
    outputs = Path(tempfile.mkdtemp(prefix="bench_union_"))
    built = Path(os.environ.get("EAGLE_ORCH_OUTPUTS", "outputs")) / "cache" / "targets"
    if built.exists():  # reuse a tiny target built before (the demo's); extraction itself starts from nothing
        shutil.copytree(built, outputs / "cache" / "targets", ignore=shutil.ignore_patterns("*.lock"))
    ensure_target(config(outputs, *extra))  # the target is shared by both ways; build it outside the timing
    started = time.perf_counter()
    for i, layers in enumerate(POINTS):
        run_pipeline(config(outputs, f"aux_layers={layers}", *extra), outputs / "per_point" / str(i))
    per_point = time.perf_counter() - started
    started = time.perf_counter()
    for i, layers in enumerate(POINTS):  # the first point extracts the union, the others find it cached
        run_pipeline(
            config(outputs, f"aux_layers={layers}", f"extract.extra_layers={UNION}", *extra), outputs / "union" / str(i)
        )
    union = time.perf_counter() - started
    print(f"per-point extraction: {per_point:.1f} s for {len(POINTS)} points")
    print(f"union extraction:     {union:.1f} s (one extraction of {UNION})")
    print(f"time saved: {per_point - union:.1f} s ({per_point / union:.2f}x)")


if __name__ == "__main__":
    main(sys.argv[1:])
