"""The extraction manifest's one check: what a training or eval reads is refused where it disagrees with the run's
config (the layers, the teacher's kind, the target)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.artifacts import ArtifactError, read_manifest, require_equal
from orchestrator.config import RootConfig


def load_manifest_checked(folder: Path, cfg: RootConfig) -> dict[str, Any]:
    """The extraction manifest, refused when it disagrees with this run's config."""
    manifest = read_manifest(folder, "extract")
    path = Path(folder) / "manifest.json"
    missing = [k for k in cfg.train.layers if k not in manifest["aux_layers"]]
    if missing:
        raise ArtifactError(
            f"{path}: aux_layers is {manifest['aux_layers']} but this run's config says {list(cfg.train.layers)} "
            f"({missing} not extracted). Re-extract with this aux_layers (the cache key differs, so a normal run does) "
            "or train with the extracted layers."
        )
    require_equal(
        path,
        "teacher.kind",
        manifest["teacher"]["kind"],
        cfg.extract.teacher,
        "The teacher state kind (pre/post final norm) must match how training computes teacher logits.",
    )
    require_equal(
        path, "target.name", manifest["target"]["name"], cfg.target.name, "Extract from the configured target."
    )
    require_equal(
        path,
        "target.hidden_size",
        manifest["hidden_size"],
        cfg.target.hidden_size,
        "Extract from the configured target.",
    )
    return manifest
