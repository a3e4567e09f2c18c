"""One spec per target family, torchtitan's `ModelSpec` way: what the project needs to know of a family, in one
entry. Adding a family is one entry here (and its rules in each engine, if its capture loop is a new one).

    text_architecture  the transformers class of its text model (a tiny target of the family is built as one)
    decoder_loop       whose capture loop the serving engines run for it: "llama" (SGLang's llama.py, vLLM's
                       llama.py) or "deepseek" (their deepseek_v2.py); each engine's id rule is the loop's
                       (orchestrator/engines/sglang, orchestrator/engines/vllm/ids.py)
    wrapper            the multimodal architecture its checkpoint is saved in (orchestrator/wrappers.py), whose
                       text model's weights carry a prefix; None for a plain causal LM
    head_tensors       the names (suffixes, after a wrapper's prefix) of the input embedding, final norm and lm_head
                       in its checkpoint: what training's teacher head and an imported draft's embedding read
    mla                its attention is DeepSeek's multi-head latent attention: an engine runs it with MLA kernels
                       (on a CPU, vLLM's are chosen by name: orchestrator/engines/vllm/cli.py, cpu_flags)
    embedding_lookup   its embedding output (canonical layer -1) is `embed_tokens(input_ids)`, the checkpoint's
                       table rows as stored, nothing scaled or added (transformers 5.24: LlamaModel.forward and
                       DeepseekV3Model.forward, `inputs_embeds = self.embed_tokens(input_ids)`; Gemma's, which
                       multiplies by sqrt(hidden), would not be): where an engine cannot capture it, the project
                       computes it from the table (orchestrator/engines/vllm/ids.py, `engine_layers`)
    sampling           the family's documented sampling as served (temperature, top_p), where its maker documents
                       one and the checkpoint's generation_config.json names none: what data.regenerate.temperature
                       and top_p null take after the checkpoint's own (`served_sampling`)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LOOPS = ("llama", "deepseek")
# HF's names in a Llama or DeepSeek-V3 checkpoint (and in Kimi-K2.5's text model, under `language_model.`)
HF_HEAD_TENSORS = (("embed", "embed_tokens.weight"), ("norm", "model.norm.weight"), ("lm_head", "lm_head.weight"))


@dataclass(frozen=True)
class Family:
    name: str
    text_architecture: str
    decoder_loop: str
    wrapper: str | None = None
    head_tensors: tuple[tuple[str, str], ...] = HF_HEAD_TENSORS
    mla: bool = False
    embedding_lookup: bool = True
    sampling: tuple[float, float] | None = None  # (temperature, top_p)
    sampling_source: str = ""

    def __post_init__(self) -> None:  # an entry whose loop no engine has a rule for fails where it is written
        if self.decoder_loop not in LOOPS:
            raise ValueError(f"family {self.name!r}: decoder_loop={self.decoder_loop!r}, expected one of {LOOPS}")


FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama"),
        Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek", mla=True),
        # Kimi-K2.5: a DeepSeek-V3 text model under `language_model.` in KimiK25ForConditionalGeneration
        # Moonshot's settings for Kimi K2.5 in thinking mode: temperature 1.0, top_p 0.95
        # (platform.kimi.ai/docs/guide/benchmark-best-practice; its API fixes top_p at 0.95 for kimi-k2.5,
        # platform.kimi.ai/docs/api/models-overview)
        Family(
            "kimi_k25",
            "DeepseekV3ForCausalLM",
            "deepseek",
            wrapper="KimiK25ForConditionalGeneration",
            mla=True,
            sampling=(1.0, 0.95),
            sampling_source="Moonshot's settings for Kimi K2.5's thinking mode "
            "(platform.kimi.ai/docs/guide/benchmark-best-practice)",
        ),  # fmt: skip
    )
}


def names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def served_sampling(target) -> tuple[float, float, str]:
    """(temperature, top_p, where they come from) of `target` (a TargetConfig) as its serving engines sample it by
    default: the checkpoint's generation_config.json where it names them (vLLM 0.32 applies them as the default
    sampling parameters, `--generation-config auto`; SGLang likewise), else its family's documented settings
    (`Family.sampling`), else greedy. A tiny target (`target.tiny`, even at a target.path) is no model its family's
    maker documents, and its build's generation_config.json names none: greedy."""
    config = Path(target.path) / "generation_config.json" if target.path else None
    named = json.loads(config.read_text()) if config is not None and config.is_file() else {}
    if "temperature" in named or "top_p" in named:
        return float(named.get("temperature", 1.0)), float(named.get("top_p", 1.0)), f"{config}"
    family = FAMILIES.get(target.family)
    if family is not None and family.sampling is not None and target.tiny is None:
        return (*family.sampling, family.sampling_source)
    return 0.0, 1.0, "greedy: neither the checkpoint's generation_config.json nor its family names a sampling"
