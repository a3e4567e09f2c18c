"""EAGLE-3 drafts as other tools write them, read into the project's draft format (`orchestrator/draft/export.py`).

    format        written by                                  how it is told                 its ids
    orchestrator  this project's train stage                  `orchestrator.json` beside it  the provenance's
    sglang        SGLang / SpecForge (`LlamaForCausalLMEagle3`) `eagle_config` in config.json  nested
    vllm          an SGLang-format draft with vLLM's top-level  the top-level key              top-level
                  key (as this project exports for vLLM)
    speculators   vllm-project/speculators 0.9 (`Eagle3Speculator`, `speculators_model_type: eagle3`,
                  `transformer_layer_config`, `speculators_config`)                            top-level, or null

`read_draft` gives any of them as the project's draft model (`Eagle3Draft`), its config in the project's format,
and what the folder said of its layers; `import_draft` writes that as a draft directory the eval and serve stages
take like a trained one. A draft without `embed_tokens` takes the target's embedding, as SGLang and vLLM give it
one at load time when the hidden sizes agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from orchestrator import engines
from orchestrator.artifacts import ArtifactError
from orchestrator.draft import export as draft_export
from orchestrator.draft.model import Eagle3Draft

FORMATS = ("orchestrator", "sglang", "vllm", "speculators")

# speculators 0.9's Eagle3 weight names -> the project's (SGLang's): its decoder layer is `layers.0`, ours `midlayer`
# (speculators src/speculators/models/eagle3/core.py, Eagle3Speculator; convert/eagle3 maps the other way)
SPECULATORS_NAMES = (("layers.0.", "midlayer."),)


def draft_format(folder: Path) -> str:
    """Which tool's layout the folder holds (`FORMATS`), from its files alone."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.exists():
        raise ArtifactError(f"{path}: missing; a draft directory holds config.json and model.safetensors")
    conf = json.loads(path.read_text())
    if (folder / draft_export.PROVENANCE).exists():
        return "orchestrator"
    if conf.get("speculators_model_type") or "speculators_config" in conf:
        return "speculators"
    if conf.get(draft_export.TOP_LEVEL_IDS):
        return "vllm"
    return "sglang"


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ArtifactError(f"{folder}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights |= load_file(str(file))
    return weights


def project_config(conf: dict[str, Any], fmt: str) -> dict[str, Any]:
    """The draft's config in the project's (SGLang's) keys: speculators' decoder settings sit under
    `transformer_layer_config`, and its draft sizes at the top."""
    if fmt != "speculators":
        return dict(conf)
    layer = dict(conf.get("transformer_layer_config") or {})
    out = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    for key in ("draft_vocab_size", "target_hidden_size", "torch_dtype", "dtype"):
        if conf.get(key) is not None:
            out[key] = conf[key]
    out["torch_dtype"] = out.get("torch_dtype") or out.get("dtype") or "bfloat16"
    out["architectures"] = [draft_export.ARCHITECTURE]
    out["num_hidden_layers"] = 1
    out["tie_word_embeddings"] = False
    return out


def read_draft(folder: Path, target_path: Path) -> tuple[Eagle3Draft, dict[str, Any], str]:
    """(the draft model in float32 on the CPU, its config in the project's keys, its format). The number of aux
    states comes from the fc's width, which every format has, not from ids it may lack."""
    from orchestrator.targets import load_head_tensors, target_config_json

    folder = Path(folder)
    fmt = draft_format(folder)
    raw = json.loads((folder / "config.json").read_text())
    conf = project_config(raw, fmt)
    weights = _weights(folder)
    if fmt == "speculators":
        renamed = {}
        for name, tensor in weights.items():
            for old, new in SPECULATORS_NAMES:
                name = new + name[len(old) :] if name.startswith(old) else name
            renamed[name] = tensor
        weights = renamed
    target_hidden = conf.get("target_hidden_size") or target_config_json(target_path)["hidden_size"]
    conf["target_hidden_size"] = target_hidden
    if "fc.weight" not in weights:
        raise ArtifactError(f"{folder}: no fc.weight, so this is no EAGLE-3 draft (names: {sorted(weights)[:8]})")
    num_aux = weights["fc.weight"].shape[1] // target_hidden
    counted = {**conf, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0] * num_aux}}  # the fc's width
    shape = draft_export.shape_from_config(counted)
    model = Eagle3Draft(shape)
    if "embed_tokens.weight" not in weights:
        weights["embed_tokens.weight"] = load_head_tensors(target_path)["embed"]
    if "t2d" not in weights and "d2t" in weights:
        t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
        t2d[weights["d2t"].long() + torch.arange(weights["d2t"].numel())] = True
        weights["t2d"] = t2d
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ArtifactError(f"{folder} ({fmt} format): weights missing {missing}, not the draft's {unexpected}")
    return model.float().eval(), conf, fmt


def import_draft(
    src: Path, dst: Path, target_path: Path, layers: list[int], ids: list[int], convention: str,
    provenance: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """A draft trained elsewhere as a draft directory of the project's (SGLang's format, `ids` written where the
    runners of `convention`'s engine read them, weights in the dtype its config gives), with `provenance`: what
    the eval and serve stages take like a trained draft. `layers`: the canonical layers it is said to read, which
    must be as many as its fc takes."""
    from orchestrator.targets import target_config_json

    model, conf, fmt = read_draft(src, target_path)
    if len(layers) != model.shape.num_aux_layers:
        raise ArtifactError(
            f"aux_layers={list(layers)}: {len(layers)} layers, but the draft at {src} takes "
            f"{model.shape.num_aux_layers} states (its fc.weight is {tuple(model.fc.weight.shape)}); set aux_layers to "
            "the layers it was trained on (check=true check_draft=<dir> finds them)"
        )
    dtype = conf.get("torch_dtype") if conf.get("torch_dtype") in draft_export.DTYPES else "bfloat16"
    tconf = target_config_json(target_path)
    out = draft_export.draft_config(
        model.shape, ids, dtype, tconf, conf.get("max_position_embeddings") or tconf["max_position_embeddings"],
        convention,
    )  # fmt: skip
    draft_export.export(model, Path(dst), out, provenance | {"imported": {"from": str(src), "format": fmt}}, tconf)
    return out


def relabel(src: Path, dst: Path, engine: str, family: str, num_layers: int, version: str | None) -> list[int]:
    """The project's trained draft at `src` as another tool ships one: no provenance, its trained layers written as
    `engine`'s ids (at `version`, where every runner of that engine reads them), the weights as they are. Returns
    the ids. What `check_draft=`'s search is tested on (tests/test_readings.py, scripts/find_trained_layers.py)."""
    import shutil

    from orchestrator.artifacts import write_json

    src, dst = Path(src), Path(dst)
    trained = draft_export.provenance(src)["aux_layers"]
    ids = engines.to_engine_ids(engine, trained, num_layers, family, version)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "model.safetensors", dst / "model.safetensors")
    conf = json.loads((src / "config.json").read_text())
    write_json(dst / "config.json", draft_export.write_layer_ids(conf, ids, engines.id_convention(engine)))
    return ids
