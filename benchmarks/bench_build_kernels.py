"""Do a tiny target's weights depend on which CPU kernels torch and MKL pick, and what do subnormal floats cost it?
Builds the demo's tiny target for a few steps once per setting, each in a process of its own, and prints each
build's weights hash, step times and training time beside the default's.

    .venv/bin/python benchmarks/bench_build_kernels.py [--steps 10] [--only SETTING...] [hydra overrides...]

The settings are the switches that pin a kernel path: MKL's conditional numerical reproducibility (`MKL_CBWR`),
torch's own CPU dispatch (`ATEN_CPU_CAPABILITY`) and oneDNN's (`ONEDNN_MAX_CPU_ISA`); and the build's own
`flush_denormals` turned off ("subnormals kept": the build before it existed). Two default builds give the same
hash on one machine (the first line checks it); a setting whose hash equals the default's is the path this machine
takes anyway. `--only` builds the default and the settings named (with `--steps 300`, the demo's whole
build: minutes each). Run it alone.
docs/measurements.md#figures-and-the-processor has what it printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestrator import conf_dir
from orchestrator.config import load
from orchestrator.tiny.build import cpu_identity

# name -> the environment it sets; SPEC_SETTINGS: name -> the build spec's train keys it sets
SETTINGS = {
    "default": {},
    "default, again": {},
    "MKL_CBWR=AVX512": {"MKL_CBWR": "AVX512"},
    "MKL_CBWR=AVX2": {"MKL_CBWR": "AVX2"},
    "MKL_CBWR=AVX2,STRICT ATEN_CPU_CAPABILITY=avx2": {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2"},
    # and oneDNN's own dispatch, the third library torch computes with on a CPU: every path an AVX2 machine has
    "all three at AVX2": {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "subnormals kept": {},
}
SPEC_SETTINGS = {"subnormals kept": {"flush_denormals": False}}

BUILD = """
import json, sys
from orchestrator.tiny import build_tiny_target, load_build_report
a = json.loads(sys.argv[1])
build_tiny_target(a["out"], a["arch"], a["model"], a["train"], a["seed"], progress=False)
r = load_build_report(a["out"])
print(json.dumps({"sha": r["weights_sha256"]["combined"], "heldout_loss": r["heldout_loss"],
                  "step_p10_s": r["step_seconds"]["p10"], "step_median_s": r["step_seconds"]["median"],
                  "train_s": r["train_seconds"], "capability": r["environment"]["torch_cpu_capability"],
                  "subnormals": r["environment"]["subnormals"]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", nargs="+", choices=list(SETTINGS), metavar="SETTING",
                        help="build the default and these settings only (a long build per setting)")  # fmt: skip
    args, overrides = parser.parse_known_args()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = load(compose("config", overrides=["+experiment=tiny_eagle3", *overrides]))
    t = cfg.target
    spec = {"arch": t.tiny.arch, "model": dict(t.tiny.model), "train": dict(t.tiny.train, steps=args.steps)}
    spec["seed"] = cfg.seed
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_build_kernels_") as scratch:
        chosen = {k: v for k, v in SETTINGS.items() if not args.only or k == "default" or k in args.only}
        for i, (name, env) in enumerate(chosen.items()):
            train = spec["train"] | SPEC_SETTINGS.get(name, {})
            a = json.dumps(spec | {"train": train, "out": str(Path(scratch) / str(i))})
            done = subprocess.run(
                [sys.executable, "-c", BUILD, a], env=os.environ | env, capture_output=True, text=True, check=False
            )
            if done.returncode:
                sys.exit(f"{name}: the build failed:\n{done.stderr[-2000:]}")
            rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
    base = rows["default"]["sha"]
    for name, r in rows.items():
        same = "same weights as default" if r["sha"] == base else "OTHER weights"
        print(
            f"{name:50s} {same:24s} held-out loss {r['heldout_loss']:.6f}  torch {r['capability']:7s} "
            f"subnormals {r['subnormals']:7s}  step p10 {r['step_p10_s']:.3f} s, median {r['step_median_s']:.3f} s, "
            f"training {r['train_s']:.1f} s"
        )
    print(json.dumps({"steps": args.steps, **cpu_identity(), "builds": rows}))


if __name__ == "__main__":
    main()
