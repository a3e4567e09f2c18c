"""Run in vLLM's environment (tests/test_vllm.py): the layer ids each of vLLM's runners reads from draft configs,
by vLLM's own functions, printed as one JSON line: {path: {"v1": ids or null, "mrv2": ids or null}}.

    python tests/vllm_ids_probe.py CONFIG.json [CONFIG.json ...]

A draft config is read as vLLM's loader leaves it for an SGLang-format draft: its keys as attributes of the
draft's hf_config (nested dicts stay dicts), which both functions read with getattr. Nothing of the project."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def main(paths: list[str]) -> dict:
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    out = {}
    for path in paths:
        with open(path) as f:
            hf_config = SimpleNamespace(**json.load(f))
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
        v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
        mrv2 = get_eagle3_aux_layers_from_config(spec)
        out[path] = {"v1": list(v1) if v1 else None, "mrv2": list(mrv2) if mrv2 else None}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
