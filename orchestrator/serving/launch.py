"""The command that starts a serving engine on the target: SGLang or vLLM (`serving/sglang.py` and
`serving/vllm.py` own their command lines) or the project's reference engine. The serve stage launches its baseline
and speculative servers with it, and the server engine of regeneration (`orchestrator/regenerate.py`) its endpoint,
without a draft."""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator import compute as compute_mod
from orchestrator.compute import Compute
from orchestrator.config import RootConfig
from orchestrator.serving import sglang as sglang_engine
from orchestrator.serving import vllm as vllm_engine


def server_command(
    cfg: RootConfig, target: Path, draft: Path | None, port: int, compute: Compute | None = None
) -> list[str]:
    """The engine's command line; the reference engine computes on `compute`'s devices and in its dtype (the CPU in
    float32 without one). SGLang places itself (serve.tp_size, serve.dtype)."""
    s = cfg.serve
    compute = compute or compute_mod.cpu()
    if s.engine == "sglang":
        return sglang_engine.launch_command(cfg, str(target), str(draft) if draft else None, port)
    if s.engine == "vllm":
        return vllm_engine.launch_command(cfg, str(target), str(draft) if draft else None, port)
    cmd = [
        sys.executable,
        "-m",
        "orchestrator.serving.reference",
        "--target",
        str(target),
        "--port",
        str(port),
        "--num-steps",
        str(s.num_steps),
        "--family",
        cfg.target.family,
        "--sglang-version",
        s.sglang_version,
    ]
    if draft:
        cmd += ["--draft", str(draft)]
    cmd += ["--device", ",".join(str(d) for d in compute.devices), "--dtype", str(compute.dtype).removeprefix("torch.")]
    # the job's CPUs, unless serve.threads says otherwise (see pipeline.run_stage)
    return cmd + ["--threads", str(s.threads or s.resources.cpus_per_task)]
