"""Runs under SGLANG_PYTHON (scripts/make_sglang_env.sh), never in the project's environment: applies SGLang's own
rotary embedding, built as SGLang 0.5.23 serves an EAGLE-3 draft, to fixed q/k (tests/test_rope.py compares).

    python sglang_rope_probe.py REQUEST.json

REQUEST.json: {"cases": {name: draft_dir}, "inputs": in.safetensors, "output": out.safetensors}. in.safetensors holds
per case `positions.NAME` (int64 [T]), `q.NAME` / `k.NAME` ([T, heads * head_dim], float32). For each case this
script:
  1. reads draft_dir/config.json with sglang's `get_config` (what `ModelConfig` calls for
     `--speculative-draft-model-path`: AutoConfig after sglang's transformers patches);
  2. builds `sglang.srt.models.llama_eagle3.LlamaDecoderLayer(config, 0)`, the draft's only layer, so that
     `LlamaDecoderLayer.__init__` reads the rope keys and `LlamaAttention.__init__` calls `get_rope`, as in serving;
  3. applies that layer's `self_attn.rotary_emb.forward_native` (sglang's PyTorch path; the CUDA kernels compute
     the same from the same `cos_sin_cache`) to q/k at the positions.
out.safetensors: `q.NAME`, `k.NAME` (rotated) and `cache.NAME` (the `cos_sin_cache` rows at the positions:
[cos·mscale | sin·mscale], [T, rotary_dim]); metadata `NAME` holds JSON describing the rotary module.

Two stand-ins, neither on the rope's path: `torchvision` (sglang.srt.configs imports it for multimodal
preprocessing; a CUDA torchvision wheel does not load against the CPU torch) and `vllm._custom_ops` (on a machine
that is neither CUDA nor sglang's CPU engine, `RotaryEmbedding.__init__` imports its rotary kernel as a fallback
for forward_cuda; calling it raises). The layer is built with tensor parallel size 1, default dtype float32 (on
CUDA sglang keeps `cos_sin_cache` in float32 whatever the model dtype).
"""

from __future__ import annotations

import enum
import json
import sys
import types


def install_stand_ins() -> None:
    """After `import sglang` (whose transformers patches import transformers' image utilities, which must see
    no torchvision), before sglang.srt.configs / the model modules are imported."""
    tv = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    functional.InterpolationMode = transforms.InterpolationMode = InterpolationMode
    transforms.functional, tv.transforms = functional, transforms

    vllm = types.ModuleType("vllm")
    custom_ops = types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*args, **kwargs):
        raise NotImplementedError("stand-in: the rope probe uses forward_native")

    custom_ops.rotary_embedding, vllm._custom_ops = rotary_embedding, custom_ops
    sys.modules.update(
        {
            "torchvision": tv,
            "torchvision.transforms": transforms,
            "torchvision.transforms.functional": functional,
            "vllm": vllm,
            "vllm._custom_ops": custom_ops,
        }
    )


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())

    import sglang  # noqa: F401  (applies sglang's transformers patches first)
    import transformers.image_processing_utils  # noqa: F401

    install_stand_ins()
    import torch
    from safetensors.torch import load_file, save_file
    from sglang.srt.models import llama_eagle3
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.hf_transformers_utils import get_config

    torch.set_default_dtype(torch.float32)
    inputs = load_file(request["inputs"])
    out, meta = {}, {}
    for name, folder in request["cases"].items():
        config = get_config(folder, trust_remote_code=False)
        with get_parallel().override(tp_size=1, tp_rank=0):
            layer = llama_eagle3.LlamaDecoderLayer(config, 0)
        rotary = layer.self_attn.rotary_emb
        positions = inputs[f"positions.{name}"]
        q, k = rotary.forward_native(positions, inputs[f"q.{name}"].clone(), inputs[f"k.{name}"].clone())
        out[f"q.{name}"], out[f"k.{name}"] = q.contiguous(), k.contiguous()
        out[f"cache.{name}"] = rotary.cos_sin_cache.index_select(0, positions).float().contiguous()
        meta[name] = json.dumps(
            {
                "class": type(rotary).__name__,
                "base": float(rotary.base),
                "head_size": rotary.head_size,
                "rotary_dim": rotary.rotary_dim,
                "max_position_embeddings": rotary.max_position_embeddings,
                "cache_rows": rotary.cos_sin_cache.shape[0],
                "cache_dtype": str(rotary.cos_sin_cache.dtype),
                "scaling_factor": getattr(rotary, "scaling_factor", None),
                "mscale": getattr(rotary, "mscale", None),
                "rope_parameters": getattr(config, "rope_parameters", None),
            }
        )
    save_file(out, request["output"], metadata=meta)


if __name__ == "__main__":
    main()
