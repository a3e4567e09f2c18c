"""Entry point: compose with Hydra, validate once, run the pipeline."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from orchestrator import conf_dir
from orchestrator.config import ConfigError, load


def main(cfg: DictConfig) -> None:
    if "search" in cfg:  # +search=<space>: an Optuna study over aux_layers (orchestrator/search.py)
        from orchestrator.search import main as search_main

        sys.exit(search_main(cfg))
    try:
        root = load(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from orchestrator.pipeline import run_pipeline
    from orchestrator.preflight import PreflightError
    from orchestrator.runner import StageFailed, SubmissionFailed
    from orchestrator.tracking import TrackingUnreachable

    hc = HydraConfig.get()
    sweep_dir = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    try:
        result = run_pipeline(root, Path(hc.runtime.output_dir), sweep_dir=sweep_dir)
    except ConfigError as exc:  # found while planning (a data file's malformed line): as a config error
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (PreflightError, TrackingUnreachable, SubmissionFailed) as exc:  # refused: said in full, no traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(3)
    except StageFailed as exc:  # the job's log, streamed above or at the path named, holds its traceback
        print(f"error: {exc.line}", file=sys.stderr)
        sys.exit(1)
    if result.get("check") and not result["ok"]:
        # each failure whole, one a line: the report's table above folds them to its width
        print("check failed:\n  - " + "\n  - ".join(result["failures"]), file=sys.stderr)
        sys.exit(1)


def cli() -> None:
    try:
        hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(main)()
    finally:
        from orchestrator.runner import exiting

        exiting()  # the command is done (or exits with its error): its exit skips collecting what it imported
