"""Wheels for `scripts/gpu_check.sh` on the GPU machine: the project's runtime dependencies that its image lacks,
at the versions this environment pins, plus SpecForge (without its dependencies) for the benchmark.

    .venv/bin/python scripts/gpu_wheels.py            # writes .whl/ (git-ignored), prints what and how much

The image's packages are listed in scripts/device_image_packages.txt (as read on 2026-11-17); those are used as
they are there (torch, transformers, triton, ...). Copy .whl to the GPU machine with the checkout; gpu_check.sh
installs it with `pip install --no-deps --target /tmp/site`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
EXTRA = ["specforge==0.2.0"]  # the benchmark's comparison, imported with the image's torch and transformers
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure() -> dict[str, str]:
    """{name: installed version} of everything the project needs at run time (no extras), recursively."""
    env = {"extra": ""}
    todo, seen = [Requirement(r) for r in metadata.requires("eagle-orchestrator") or []], {}
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = norm(req.name)
        if name in seen:
            continue
        seen[name] = metadata.version(req.name)
        todo += [Requirement(r) for r in metadata.requires(req.name) or []]
    return seen


def main() -> None:
    image = {
        norm(line.strip())
        for line in (ROOT / "scripts" / "device_image_packages.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    wanted = [f"{n}=={v}" for n, v in sorted(runtime_closure().items()) if n not in image] + EXTRA
    folder = ROOT / ".whl"
    folder.mkdir(exist_ok=True)  # git-ignored (.gitignore): the wheels travel beside the checkout, never in git
    pip = [sys.executable, "-m", "pip"]
    for spec in wanted:
        binary = [
            *pip,
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *[a for p in PLATFORMS for a in ("--platform", p)],
            "-d",
            str(folder),
            spec,
        ]
        if subprocess.run(binary, capture_output=True).returncode != 0:  # pure-Python sdists (antlr4): build here
            subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(folder), spec], check=True)
    size = sum(p.stat().st_size for p in folder.glob("*.whl"))
    print(f"{len(wanted)} wheels in {folder}: {size / 2**20:.1f} MiB (at most 64 MiB travel to the GPU machine)")
    for spec in wanted:
        print(f"  {spec}")


if __name__ == "__main__":
    main()
