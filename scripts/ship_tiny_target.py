"""Build a tiny target on this machine and keep it in the repository (orchestrator/tiny/shipped/<name>), where the
demo and the tests take it from instead of building it (`target.tiny.rebuild=false`, the default).

    .venv/bin/python scripts/ship_tiny_target.py [--experiment tiny_eagle3] [hydra overrides...]

The build is the one `target.tiny.rebuild=true` runs (orchestrator/tiny/build.py), from the experiment's recipe;
its report names the processor it ran on. A folder kept for the same recipe is replaced. Commit the folder.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestrator import conf_dir
from orchestrator.config import load
from orchestrator.tiny.build import REPORT_NAME, SHIPPED, build_tiny_target, load_build_report, shipped_build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="tiny_eagle3")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = load(compose("config", overrides=[f"+experiment={args.experiment}", *args.overrides]))
    t = cfg.target
    if t.tiny is None:
        raise SystemExit(f"+experiment={args.experiment}: target {t.name} is a checkpoint, not a tiny target")
    recipe = (t.tiny.arch, dict(t.tiny.model), dict(t.tiny.train), cfg.seed)
    with tempfile.TemporaryDirectory(prefix="ship_tiny_") as scratch:
        built = build_tiny_target(Path(scratch) / "target", *recipe, rebuild=True)
        old = shipped_build(*recipe)
        dest = old or SHIPPED / t.name
        if dest.exists() and old is None:
            raise SystemExit(f"{dest} holds another recipe's build: name this one otherwise (target.name)")
        part = dest.with_name(dest.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        shutil.copytree(built, part, ignore=shutil.ignore_patterns("*.lock"))
        shutil.rmtree(dest, ignore_errors=True)
        part.rename(dest)
    report = load_build_report(dest)
    size_mb = sum(f.stat().st_size for f in dest.iterdir()) / 1e6
    print(f"kept {dest}, {size_mb:.1f} MB ({REPORT_NAME}: {report['environment']['cpu']}, "
          f"heldout loss {report['heldout_loss']:.4f})")  # fmt: skip


if __name__ == "__main__":
    main()
