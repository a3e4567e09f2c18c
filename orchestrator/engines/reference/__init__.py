"""The project's reference engine (its server: orchestrator/engines/reference/server.py): serves the target, with
or without an EAGLE-3 draft, from the project's own environment, on the job's devices (the CPU in float32 without
GPUs). It reads draft configs in SGLang's id convention, and shares eval's draft code, so its accept length agreeing
with eval's says less than a real engine's (vLLM's) does."""

from __future__ import annotations

import sys

from orchestrator.compute import resolve_precision
from orchestrator.config.schema import ConfigError
from orchestrator.engines import Serving
from orchestrator.engines.sglang import SGLang, sglang_rule


class Reference(Serving):
    name = "reference"
    convention = "sglang"

    def version(self, serve):
        return serve.sglang_version

    def id_rule(self, family, version):
        return sglang_rule(family, version)

    def measuring(self, installed):
        """The project's own code (its version; CODE_VERSION keys its serving changes) on this environment's torch
        and transformers, which compute every pass."""
        import torch
        import transformers

        from orchestrator import __version__

        return f"orchestrator {__version__}, torch {torch.__version__}, transformers {transformers.__version__}"

    def check_config(self, cfg):
        if cfg.serve.eagle_topk != 1:
            raise ConfigError(f"serve.eagle_topk={cfg.serve.eagle_topk}: the reference engine drafts a chain (topk 1)")

    def check_endpoint(self, cfg):
        r = cfg.data.regenerate
        if r.temperature > 0:
            raise ConfigError(
                f"data.regenerate.temperature={r.temperature} with data.regenerate.engine=server and "
                "serve.engine=reference: the reference engine decodes greedily only; "
                "set data.regenerate.temperature=0 or data.regenerate.engine=hf"
            )

    def launch_command(self, cfg, target, draft, port, compute):
        """Computes on `compute`'s devices and in its dtype, with the job's CPUs as torch threads unless
        serve.threads says otherwise (see pipeline.run_stage)."""
        s = cfg.serve
        cmd = [
            sys.executable, "-m", "orchestrator.engines.reference.server", "--target", str(target), "--port", str(port),
            "--num-steps", str(s.num_steps), "--family", cfg.target.family, "--sglang-version", s.sglang_version,
        ]  # fmt: skip
        if draft:
            cmd += ["--draft", str(draft)]
        cmd += ["--device", ",".join(str(d) for d in compute.devices)]
        cmd += ["--dtype", str(compute.dtype).removeprefix("torch.")]
        return cmd + ["--threads", str(s.threads or s.resources.cpus_per_task)]

    # the same /generate API, cache flush, benchmark and /server_info (with its phase profile) as SGLang's
    request, reset, benchmark, server_info = SGLang.request, SGLang.reset, SGLang.benchmark, SGLang.server_info

    def exact(self, cfg):
        """In float32 (on the CPU: one request at a time, the same kernels for a verify pass and a decode step) the
        reference engine computes greedy outputs exactly, with and without the draft."""
        s = cfg.serve
        return resolve_precision(s.precision, s.resources.gpus_per_node) == "float32"


ENGINE = Reference()
