"""What a Kimi-K2.5 checkpoint holds beside its text model, at a tiny size: the vision tower and projector, the
media tokens and the image processor's settings. EAGLE-3 capture never runs them, but vLLM's
`KimiK25ForConditionalGeneration` (vllm 0.32.0, vllm/model_executor/models/kimi_k25.py) builds the tower, loads
its weights strictly (a parameter no checkpoint tensor sets is an error) and reads the image processor before it
runs a word of text, so the tiny Kimi ships them as the real one does.

Names and keys, as vLLM 0.32.0 reads them (the published index, huggingface.co/moonshotai/Kimi-K2.5
`model.safetensors.index.json`, was not readable from here; docs/kimi_k25.md#the-tiny-target):
  * weights: `vision_tower.patch_embed.{proj,pos_emb}`, `vision_tower.encoder.blocks.<b>.{norm0,norm1,wqkv,wo,
    mlp.fc0,mlp.fc1}`, `vision_tower.encoder.final_layernorm`, `mm_projector.{pre_norm,proj.0,proj.2}`
    (`MoonViT3dPretrainedModel` and `KimiK25MultiModalProjector` in kimi_k25_vit.py, whose `proj.0`/`proj.2` vLLM
    renames `linear_1`/`linear_2`; transformers 5.24 `conversion_mapping.py` "kimi_k25" maps the same names);
  * `vision_config`: the field names of transformers' `Kimi_K25VisionConfig`, the class vLLM parses the config
    with (vllm/transformers_utils/config.py);
  * `preprocessor_config.json`: the `media_proc_cfg` keys vLLM's fused image processor reads
    (vllm/transformers_utils/processors/kimi_k25_vision_fused.py), sized so that vLLM's start-up profile of the
    tower (a 3000 x 3000 dummy image) is a few patches;
  * the media tokens of vLLM's image placeholder (`KimiK25ForConditionalGeneration.get_placeholder_str`); the
    image token is `<|media_pad|>`, whose id vLLM resolves through the tokenizer, and which the config names
    `media_placeholder_token_id` as the real one does (vLLM's EAGLE-3 drafter reads it to serve a draft).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
MEDIA_PAD = "<|media_pad|>"

# A MoonViT of one block; the real one is 27 blocks of 1152 (transformers' Kimi_K25VisionConfig defaults).
VISION_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "patch_size": 14,
    "merge_kernel_size": [2, 2],
    "pos_emb_height": 4,
    "pos_emb_width": 4,
    "pos_emb_time": 4,
}
MEDIA_PROC_CFG = {
    "patch_size": VISION_CONFIG["patch_size"],
    "merge_kernel_size": VISION_CONFIG["merge_kernel_size"][0],
    "temporal_merge_kernel_size": VISION_CONFIG["pos_emb_time"],
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "in_patch_limit": 16,
    "in_patch_limit_each_frame": 16,
    "in_patch_limit_video": None,
    "patch_limit_on_one_side": 4,
    "fixed_output_tokens": None,
}
# A trained Kimi's router selects experts on sigmoid scores plus a learned `e_score_correction_bias` (DeepSeek-V3's
# auxiliary-loss-free balancing sets it outside the gradient, so training here leaves it as initialised): this
# spread makes it steer the tiny router's choice, as a real one does, instead of adding zero.
ROUTER_BIAS_SPREAD = 0.05

# Everything above that decides the bytes a build writes (tiny/build.py keeps it in the build's spec).
SPEC = {
    "media_tokens": list(MEDIA_TOKENS),
    "media_placeholder_token_id": MEDIA_PAD,
    "vision_config": VISION_CONFIG,
    "media_proc_cfg": MEDIA_PROC_CFG,
    "router_bias_spread": ROUTER_BIAS_SPREAD,
}


def set_router_bias(model: torch.nn.Module, seed: int) -> None:
    """Each MoE layer's `e_score_correction_bias`, drawn uniformly from +-ROUTER_BIAS_SPREAD."""
    generator = torch.Generator().manual_seed(seed)
    for name, buffer in model.named_buffers():
        if name.endswith("mlp.gate.e_score_correction_bias"):
            bias = (torch.rand(buffer.shape, generator=generator) * 2 - 1) * ROUTER_BIAS_SPREAD
            buffer.copy_(bias.to(buffer.dtype))


def vision_tensors(text_hidden_size: int, seed: int) -> dict[str, torch.Tensor]:
    """The vision tower's and projector's weights under the checkpoint's names: norms at one and zero, the rest
    small random values (no test runs them; vLLM's loader only has to find each one)."""
    generator = torch.Generator().manual_seed(seed)
    v = VISION_CONFIG
    h, inner, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged = h * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]

    def linear(prefix: str, out: int, inp: int) -> dict[str, torch.Tensor]:
        weight = torch.randn(out, inp, generator=generator) * 0.02
        return {f"{prefix}.weight": weight, f"{prefix}.bias": torch.zeros(out)}

    def norm(prefix: str, size: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": torch.ones(size), f"{prefix}.bias": torch.zeros(size)}

    tensors = {
        "vision_tower.patch_embed.proj.weight": torch.randn(h, 3, patch, patch, generator=generator) * 0.02,
        "vision_tower.patch_embed.proj.bias": torch.zeros(h),
        "vision_tower.patch_embed.pos_emb.weight": torch.randn(
            v["pos_emb_height"], v["pos_emb_width"], h, generator=generator
        ),
        **norm("vision_tower.encoder.final_layernorm", h),
        **norm("mm_projector.pre_norm", h),
        **linear("mm_projector.proj.0", merged, merged),
        **linear("mm_projector.proj.2", text_hidden_size, merged),
    }
    for b in range(v["num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{b}"
        tensors |= {
            **norm(f"{block}.norm0", h),
            **norm(f"{block}.norm1", h),
            **linear(f"{block}.wqkv", 3 * h, h),
            **linear(f"{block}.wo", h, h),
            **linear(f"{block}.mlp.fc0", inner, h),
            **linear(f"{block}.mlp.fc1", h, inner),
        }
    return tensors


def wrapper_fields(tokenizer) -> dict[str, Any]:
    """The wrapper config.json's keys beside `text_config`: the vision tower's shape and the image token, under both
    names: `media_placeholder_token_id` is the real config's (163605, `<|media_pad|>`), and vLLM's EAGLE-3 drafter
    reads it from a KimiK25ForConditionalGeneration target when it loads a draft (vllm 0.32.0,
    vllm/v1/spec_decode/llm_base_proposer.py `load_model`)."""
    pad = tokenizer.convert_tokens_to_ids(MEDIA_PAD)
    return {"vision_config": dict(VISION_CONFIG), "image_token_id": pad, "media_placeholder_token_id": pad}


def write_preprocessor_config(out: Path) -> None:
    (Path(out) / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2, sort_keys=True) + "\n"
    )
