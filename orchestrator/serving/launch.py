"""The command that starts a serving engine on the target: `serve.engine`'s own (orchestrator/engines). The serve
stage launches its baseline and speculative servers with it, and the server engine of regeneration
(`orchestrator/regenerate.py`) its endpoint, without a draft."""

from __future__ import annotations

from pathlib import Path

from orchestrator import compute as compute_mod
from orchestrator import engines
from orchestrator.compute import Compute
from orchestrator.config import RootConfig


def server_command(
    cfg: RootConfig, target: Path, draft: Path | None, port: int, compute: Compute | None = None
) -> list[str]:
    """The engine's command line; an engine of the project's own (the reference engine) computes on `compute`'s
    devices and in its dtype (the CPU in float32 without one). SGLang and vLLM place themselves (serve.tp_size,
    serve.dtype)."""
    engine = engines.get(cfg.serve.engine, engines.SERVE)
    return engine.launch_command(cfg, Path(target), Path(draft) if draft else None, port, compute or compute_mod.cpu())
