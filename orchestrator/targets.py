"""Where a target model lives, how it is loaded, and its identity (content hash, tokenizer hash)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.artifacts import ArtifactError, dir_fingerprint, stable_hash
from orchestrator.config import RootConfig, TargetConfig


def tiny_target_dir(target: TargetConfig, outputs: Path, seed: int) -> Path:
    spec = {"arch": target.tiny.arch, "model": dict(target.tiny.model), "train": dict(target.tiny.train), "seed": seed}
    return Path(outputs) / "cache" / "targets" / f"{target.name}-{stable_hash(spec, 12)}"


def target_dir(cfg: RootConfig) -> Path:
    """The target's HF folder: the configured path, or the tiny target's cache folder (built or not)."""
    if cfg.target.path:
        return Path(cfg.target.path)
    return tiny_target_dir(cfg.target, cfg.outputs, cfg.seed)


def ensure_target(cfg: RootConfig, progress: bool = True) -> Path:
    """The target folder, building the tiny target first if it is not cached yet."""
    t = cfg.target
    if t.path:
        path = Path(t.path)
        if not (path / "config.json").exists():
            raise ArtifactError(f"target.path={t.path}: no config.json there; expected a local HF model folder")
        return path
    from orchestrator.tiny.build import build_tiny_target

    return build_tiny_target(
        tiny_target_dir(t, cfg.outputs, cfg.seed), t.tiny.arch, dict(t.tiny.model), dict(t.tiny.train), cfg.seed, progress=progress
    )


@dataclass
class TargetIdentity:
    name: str
    path: str
    content_hash: str
    tokenizer_hash: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def tokenizer_hash(path: Path) -> str:
    """Hash of what decides token ids and the chat rendering: tokenizer.json and the chat template."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "chat_template.jinja", "tokenizer_config.json"):
        f = Path(path) / name
        if not f.exists():
            continue
        data = f.read_bytes()
        if name == "tokenizer_config.json":
            conf = json.loads(data)
            data = json.dumps({k: conf.get(k) for k in ("chat_template", "eos_token", "bos_token")}, sort_keys=True).encode()
        h.update(name.encode() + data)
    return h.hexdigest()[:16]


def identity(cfg: RootConfig, path: Path) -> TargetIdentity:
    conf = json.loads((Path(path) / "config.json").read_text())
    conf = conf.get("text_config", conf)
    found = {k: conf.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    for key, value in found.items():
        expected = getattr(cfg.target, key)
        if value != expected:
            raise ArtifactError(
                f"{path}/config.json: {key}={value} but target.{key}={expected} in the config; fix conf/target/"
                f"{cfg.target.name}.yaml so layer ranges and draft shapes are checked against the real model"
            )
    return TargetIdentity(
        name=cfg.target.name,
        path=str(path),
        content_hash=dir_fingerprint(path),
        tokenizer_hash=tokenizer_hash(path),
        **found,
    )


def load_target(path: Path, trust_remote_code: bool = False):
    """(model, tokenizer) in float32, eval mode, on the CPU (the accelerators' placement is the engines' job).

    A multimodal wrapper checkpoint (Kimi-K2.5: `KimiK25ForConditionalGeneration`, the text model under
    `text_config`) loads as its text model under the wrapper's attribute (`orchestrator/wrappers.py`, which also
    lists what a real Kimi-K2.5 checkpoint needs beyond the tiny one); any other as HF's causal LM.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator import wrappers

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    config = wrappers.read_config(path)
    wrapper = wrappers.wrapper_of(config)
    if wrapper is not None:
        try:
            return wrappers.load_text_model(Path(path), config, wrapper), tokenizer
        except wrappers.WrapperError as err:
            raise ArtifactError(str(err)) from err
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model.eval()
    return model, tokenizer


def target_config_json(path: Path) -> dict[str, Any]:
    conf = json.loads((Path(path) / "config.json").read_text())
    return conf.get("text_config", conf)


def load_head_tensors(path: Path) -> dict[str, "torch.Tensor"]:
    """The target's input embedding, final norm and lm_head weights, read by name without loading the model.

    Returns keys `embed`, `norm`, `lm_head` (float32); `lm_head` falls back to `embed` for tied embeddings. In a
    wrapper checkpoint only the text model's weights (`language_model.*` for Kimi-K2.5) are candidates.
    """
    import torch
    from safetensors import safe_open

    from orchestrator import wrappers

    has_config = (Path(path) / "config.json").exists()
    wrapper = wrappers.wrapper_of(wrappers.read_config(path)) if has_config else None
    prefix = wrapper.prefix if wrapper else ""
    wanted = {"embed": "embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                for name, suffix in wanted.items():
                    if name not in found and key.startswith(prefix) and key.endswith(suffix) and "mtp" not in key:
                        found[name] = f.get_tensor(key).float()
    if "lm_head" not in found and "embed" in found:
        found["lm_head"] = found["embed"]
    missing = [n for n in wanted if n not in found]
    if missing:
        raise ArtifactError(f"{path}: no weights named *{[wanted[m] for m in missing]} in its safetensors files")
    return found
