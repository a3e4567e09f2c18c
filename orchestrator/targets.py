"""Where a target model lives, how it is loaded, and its identity (content hash, tokenizer hash)."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator import compute as compute_mod
from orchestrator import families
from orchestrator.artifacts import ArtifactError, dir_fingerprint, file_sha256, stable_hash

if TYPE_CHECKING:
    import torch
from orchestrator.compute import Compute
from orchestrator.config import RootConfig, TargetConfig


def tiny_target_dir(target: TargetConfig, outputs: Path, seed: int) -> Path:
    """A tiny target's cache folder, keyed by its recipe and by where its weights come from: the repository's copy
    of the build (its weights' hash) or a build on this machine (`target.tiny.rebuild`, or no copy kept)."""
    spec = {"arch": target.tiny.arch, "model": dict(target.tiny.model), "train": dict(target.tiny.train), "seed": seed}
    spec |= tiny_weights_source(target, seed)
    return Path(outputs) / "cache" / "targets" / f"{target.name}-{stable_hash(spec, 12)}"


def tiny_weights_source(target: TargetConfig, seed: int) -> dict[str, Any]:
    """Where a tiny target's weights come from, for its folder's and the stages' cache keys: {"shipped": the kept
    build's weights hash} (orchestrator/tiny/shipped), or {"rebuild": True}; {} for a recipe no copy is kept of,
    built on this machine, as before copies were kept."""
    from orchestrator.tiny.build import shipped_weights

    if target.tiny.rebuild:
        return {"rebuild": True}
    sha = shipped_weights(target.tiny.arch, dict(target.tiny.model), dict(target.tiny.train), seed)
    return {} if sha is None else {"shipped": sha}


def target_dir(cfg: RootConfig) -> Path:
    """The target's HF folder: the configured path, or the tiny target's cache folder (built or not)."""
    if cfg.target.path:
        return Path(cfg.target.path)
    return tiny_target_dir(cfg.target, cfg.outputs, cfg.seed)


def weights_fingerprint(path: Path) -> dict[str, Any]:
    """A cheap fingerprint of a real checkpoint's weights, for the extraction's key, so that new weights at the same
    target.path are extracted again: the hub snapshot's revision where target.path is one
    (`.../models--org--name/snapshots/<commit>`), else the content of its config.json and safetensors index and each
    `*.safetensors` file's name, size and modification time, from the file system alone (not a byte of a 595 GB
    checkpoint is read). A copy that keeps the times (cp -p, rsync -a) keeps the key. Empty where the folder is not
    there; the dry run refuses that plan.

    A tiny target (target.path null) has none: the extract job builds it, so its weights are unknown when the plan
    is keyed; it is keyed by its build recipe (target.tiny and the seed), which decides those weights."""
    path = Path(path)
    snapshot = path.resolve()  # target.path may be a link to the hub's snapshot
    if snapshot.parent.name == "snapshots" and snapshot.parent.parent.name.startswith("models--"):
        return {"revision": snapshot.name}
    if not path.is_dir():
        return {}
    small = [path / "config.json", path / "model.safetensors.index.json"]
    return {
        "files": {f.name: file_sha256(f) for f in small if f.is_file()},
        "weights": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(path.glob("*.safetensors"))],
    }


def ensure_target(cfg: RootConfig, progress: bool = True) -> Path:
    """The target folder, the tiny target first copied from the repository's build or built, if not cached yet."""
    t = cfg.target
    if t.path:
        path = Path(t.path)
        if not (path / "config.json").exists():
            raise ArtifactError(f"target.path={t.path}: no config.json there; expected a local HF model folder")
        return path
    from orchestrator.tiny.build import build_tiny_target

    return build_tiny_target(
        tiny_target_dir(t, cfg.outputs, cfg.seed),
        t.tiny.arch,
        dict(t.tiny.model),
        dict(t.tiny.train),
        cfg.seed,
        progress=progress,
        rebuild=t.tiny.rebuild,
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


# The files that hold a tokenizer's vocabulary: HF's fast tokenizer, tiktoken's ranks (Kimi-K2.5 ships only this
# one, read by its remote-code tokenizer), sentencepiece's model.
TOKENIZER_VOCABULARIES = ("tokenizer.json", "tiktoken.model", "tokenizer.model")


def tokenizer_hash(path: Path) -> str:
    """Hash of what decides token ids and the chat rendering: the vocabulary (tokenizer.json, or Kimi-K2.5's
    tiktoken.model, or a sentencepiece tokenizer.model) and the chat template."""
    h = hashlib.sha256()
    for name in (*TOKENIZER_VOCABULARIES, "chat_template.jinja", "tokenizer_config.json"):
        f = Path(path) / name
        if not f.exists():
            continue
        data = f.read_bytes()
        if name == "tokenizer_config.json":
            conf = json.loads(data)
            data = json.dumps(
                {k: conf.get(k) for k in ("chat_template", "eos_token", "bos_token")}, sort_keys=True
            ).encode()
        h.update(name.encode() + data)
    return h.hexdigest()[:16]


# What the config says of the target's shape, as its checkpoint's config.json must say it too.
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "vocab_size")


def quantization_of(target_dir: Path) -> str | None:
    """The quantization a target checkpoint declares in its config.json (`quantization_config`, at the top or in
    a wrapper's `text_config`), as its quant_method; None when it declares none or has no config yet."""
    path = Path(target_dir) / "config.json"
    if not path.exists():
        return None
    conf = json.loads(path.read_text())
    q = conf.get("quantization_config") or (conf.get("text_config") or {}).get("quantization_config")
    return None if not q else str(q.get("quant_method", "quantization_config")) if isinstance(q, dict) else str(q)


def checkpoint_disagreements(target: TargetConfig, path: Path) -> list[str]:
    """Where the checkpoint's config.json (a wrapper's text model under `text_config`, as Kimi-K2.5 has it)
    disagrees with target.*: its layer count, hidden size, vocabulary and quantization, each naming both values.
    The dry run reads them before any job; the extract job again from the copy it loads."""
    conf = target_config_json(path)
    found = {k: conf.get(k) for k in SHAPE_KEYS} | {"quantization": quantization_of(path)}
    return [
        f"{path}/config.json: {key}={value} but target.{key}={getattr(target, key)} in the config"
        for key, value in found.items()
        if value != getattr(target, key)
    ]


def identity(cfg: RootConfig, path: Path) -> TargetIdentity:
    wrong = checkpoint_disagreements(cfg.target, path)
    if wrong:
        raise ArtifactError(
            "; ".join(wrong) + f"; fix conf/target/{cfg.target.name}.yaml so layer ranges and draft shapes are "
            "checked against the real model"
        )
    conf = target_config_json(path)
    found = {k: conf.get(k) for k in SHAPE_KEYS}
    return TargetIdentity(
        name=cfg.target.name,
        path=str(path),
        content_hash=dir_fingerprint(path),
        tokenizer_hash=tokenizer_hash(path),
        **found,
    )


def load_tokenizer(path: Path, trust_remote_code: bool = False, chat_template: str | None = None):
    """The target's tokenizer; `chat_template` (data.chat_template, a Jinja file) replaces its template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    return tokenizer


# Loads a checkpoint's tokenizer with transformers and the standard library alone, so that it runs in any
# environment a job loads the tokenizer in (the project's, an engine's), and prints one JSON line: transformers'
# version, the tokenizer's class, how many tokens each marker its chat template writes (`<think>`, `</think>`)
# encodes to, or the error and the frames it came from. `preflight.tokenizer_findings` runs it.
TOKENIZER_PROBE = r"""
import json, sys, traceback
out = {}
try:
    import transformers
    out["transformers"] = transformers.__version__
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=sys.argv[2] == "1")
    out["class"] = type(tok).__name__
    template = tok.chat_template if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template)
    out["markers"] = {m: len(tok(m, add_special_tokens=False)["input_ids"]) for m in sys.argv[3:] if m in template}
except BaseException as exc:
    out["error"] = f"{type(exc).__name__}: {exc}".strip()
    out["frames"] = [[f.filename, f.lineno] for f in traceback.extract_tb(exc.__traceback__)]
print(json.dumps(out))
"""
THINKING_MARKERS = ("<think>", "</think>")


def remote_code_files(path: Path) -> list[Path]:
    """The Python files of a checkpoint's remote code (`tokenizer_config.json`'s `auto_map`: tokenization_kimi.py
    for Kimi-K2.5) that are in its folder."""
    conf = Path(path) / "tokenizer_config.json"
    if not conf.is_file():
        return []
    auto = json.loads(conf.read_text()).get("auto_map") or {}
    refs = [r for v in auto.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
    files = {Path(path) / f"{ref.split('--')[-1].rsplit('.', 1)[0]}.py" for ref in refs}
    return sorted(f for f in files if f.is_file())


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def tokenizer_files_fingerprint(path: Path) -> str:
    """What a tokenizer load can read in a checkpoint folder: every file in it but the weights, by content."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != "model.safetensors.index.json":
            h.update(f.name.encode() + b"\0" + file_sha256(f).encode())
    return h.hexdigest()


_PROBES: dict[tuple, dict[str, Any]] = {}


# What a tokenizer load depends on in an environment, read from its package metadata without importing them.
TOKENIZER_PACKAGES = ("transformers", "tokenizers", "tiktoken", "sentencepiece")
_PACKAGES_SCRIPT = (
    "import importlib.metadata as m, json, sys\n"
    "def v(d):\n"
    "    try:\n"
    "        return m.version(d)\n"
    "    except m.PackageNotFoundError:\n"
    "        return None\n"
    "print(json.dumps([list(sys.version_info[:2])] + [v(d) for d in sys.argv[1:]]))"
)


@functools.lru_cache(maxsize=64)
def tokenizer_packages(python: str) -> str:
    """The Python version and `TOKENIZER_PACKAGES`' versions in the environment of `python` (a JSON list; the
    interpreter's path where they cannot be read)."""
    import subprocess

    try:
        done = subprocess.run([python, "-c", _PACKAGES_SCRIPT, *TOKENIZER_PACKAGES], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return python
    return done.stdout.strip() if done.returncode == 0 and done.stdout.startswith("[") else python


def _probe(python: str, path: str, trust_remote_code: bool, timeout: float) -> dict[str, Any]:
    """One probe of a folder's tokenizer files per set of package versions (`tokenizer_packages`) and process: two
    environments with the same Python, transformers, tokenizers, tiktoken and sentencepiece load the same files
    the same way (a search's trials, one test session's checkpoints, the serving and capture environments of one
    cluster)."""
    key = (tokenizer_packages(python), tokenizer_files_fingerprint(Path(path)), trust_remote_code)
    if key not in _PROBES:
        _PROBES[key] = _run_probe(python, path, trust_remote_code, timeout)
    return _PROBES[key]


def _run_probe(python: str, path: str, trust_remote_code: bool, timeout: float) -> dict[str, Any]:
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tokenizer-probe-") as modules:
        # a fresh module cache: concurrent probes never share the copy transformers makes of the remote code
        env = {**os.environ, "HF_MODULES_CACHE": modules, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        args = [python, "-c", TOKENIZER_PROBE, path, "1" if trust_remote_code else "0", *THINKING_MARKERS]
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"loading the tokenizer took over {timeout:.0f} s"}
        except OSError as exc:
            return {"error": f"{python} does not run: {exc}"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"{python} exited {done.returncode}: {done.stderr.strip()[-300:]}"}


def probe_tokenizer(python: str, path: Path, trust_remote_code: bool, timeout: float = 600) -> dict[str, Any]:
    """`TOKENIZER_PROBE` run by `python` on the checkpoint at `path` (once per process for the same files). A frame
    of the error in one of the checkpoint's remote code files is named by that file (`remote_file`, `remote_line`):
    transformers runs a copy of it from its module cache."""
    out = dict(_probe(python, str(path), trust_remote_code, timeout))
    names = {f.name: f for f in remote_code_files(path)}
    for filename, line in reversed(out.get("frames", [])):
        if Path(filename).name in names:
            out["remote_file"], out["remote_line"] = str(names[Path(filename).name]), line
            break
    return out


def end_token_ids(tokenizer) -> list[int]:
    """The tokens at which the serving engines end a response: the tokenizer's eos, then the ids the checkpoint's
    generation_config.json names as `eos_token_id` (an int or a list), as vLLM 0.32 stops at both
    (`SamplingParams.update_from_generation_config`, vllm/sampling_params.py). Kimi-K2.5's tokenizer says `[EOS]`,
    while an assistant turn of its chat template ends at `<|im_end|>`: a regeneration that stopped at the first
    alone would write past the turn into the next one."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    config = Path(str(tokenizer.name_or_path)) / "generation_config.json"
    if config.is_file():
        named = json.loads(config.read_text()).get("eos_token_id")
        for i in [named] if isinstance(named, int) else named or []:
            ids += [i] if i not in ids else []
    return ids


def template_source(path: Path, chat_template: str | None) -> str:
    """How an error names the chat template the conversations were rendered with."""
    if chat_template is not None:
        return f"data.chat_template={chat_template}"
    return f"the chat template of the target at {path} (override it with data.chat_template=<file>)"


def load_target(
    path: Path, trust_remote_code: bool = False, compute: Compute | None = None, chat_template: str | None = None
):
    """(model, tokenizer) in eval mode, in `compute`'s dtype, on its devices (the CPU in float32 without one).

    One device: the whole model on it. Several (a task that owns more than one GPU, because the target does not
    fit one): spread over them by accelerate's `device_map="auto"`, each GPU filled up to `GPU_FILL` of its memory;
    forward hooks capture the states wherever their layer sits (`capture.HiddenStateCapture` gathers them).

    A multimodal wrapper checkpoint (Kimi-K2.5: `KimiK25ForConditionalGeneration`, the text model under
    `text_config`) loads as its text model under the wrapper's attribute (`orchestrator/wrappers.py`, which also
    lists what a real Kimi-K2.5 checkpoint needs beyond the tiny one); any other as HF's causal LM.
    """
    from transformers import AutoModelForCausalLM

    from orchestrator import wrappers

    compute = compute or compute_mod.cpu()
    placement = {"dtype": compute.dtype} | device_placement(compute)
    tokenizer = load_tokenizer(path, trust_remote_code, chat_template)
    config = wrappers.read_config(path)
    wrapper = wrappers.wrapper_of(config)
    if wrapper is not None:
        try:
            return wrappers.load_text_model(Path(path), config, wrapper, placement), tokenizer
        except wrappers.WrapperError as err:
            raise ArtifactError(str(err)) from err
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **placement)
    model.eval()
    return model, tokenizer


# Of each GPU's memory, what a spread target's weights may take; the rest is activations and captured states.
GPU_FILL = 0.85


def device_placement(compute: Compute) -> dict[str, Any]:
    """`from_pretrained`'s placement arguments for a process's devices."""
    if compute.device.type == "cpu":
        return {}  # loaded where from_pretrained loads by default
    if len(compute.devices) == 1:
        return {"device_map": {"": str(compute.device)}}
    return {
        "device_map": "auto",
        "max_memory": {d.index: int(compute_mod.device_memory_bytes(d) * GPU_FILL) for d in compute.devices},
    }


def weight_bytes(path: Path, dtype: str) -> int | None:
    """The memory a target folder's weights take once loaded in `dtype` (floating tensors converted, quantised or
    integer ones as stored), from the safetensors headers alone; None when the folder has no weights (yet)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    total = 0
    for file in files:
        for name, entry in safetensors_header(file).items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            floating = entry["dtype"].startswith(("F", "BF")) and not entry["dtype"].startswith("F8")
            total += math.prod(entry["shape"]) * size if floating else end - start
    return total


def safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's header: each tensor's dtype, shape and byte range. The format puts it first (an 8-byte
    little-endian length, then that much JSON), so a dry run learns a 1T-parameter target's size without opening
    (or mapping) a byte of its weights."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def target_config_json(path: Path) -> dict[str, Any]:
    conf = json.loads((Path(path) / "config.json").read_text())
    return conf.get("text_config", conf)


def load_head_tensors(
    path: Path, family: str | None = None, only: tuple[str, ...] | None = None, as_stored: bool = False
) -> dict[str, "torch.Tensor"]:
    """The target's input embedding, final norm and lm_head weights, read by name without loading the model: the
    names of `family`'s spec (orchestrator/families.py; HF's where no family is given).

    Returns keys `embed`, `norm`, `lm_head` (float32, or in their stored dtype `as_stored`; `only` those named);
    `lm_head` falls back to `embed` for tied embeddings. In a wrapper checkpoint only the text model's weights
    (`language_model.*` for Kimi-K2.5) are candidates.
    """
    from safetensors import safe_open

    from orchestrator import wrappers

    has_config = (Path(path) / "config.json").exists()
    wrapper = wrappers.wrapper_of(wrappers.read_config(path)) if has_config else None
    prefix = wrapper.prefix if wrapper else ""
    wanted = dict(families.FAMILIES[family].head_tensors if family else families.HF_HEAD_TENSORS)
    if only is not None:
        wanted = {name: suffix for name, suffix in wanted.items() if name in only}
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                for name, suffix in wanted.items():
                    if name not in found and key.startswith(prefix) and key.endswith(suffix) and "mtp" not in key:
                        tensor = f.get_tensor(key)
                        found[name] = tensor if as_stored else tensor.float()
    if "lm_head" in wanted and "lm_head" not in found and "embed" in found:
        found["lm_head"] = found["embed"]
    missing = [n for n in wanted if n not in found]
    if missing:
        raise ArtifactError(f"{path}: no weights named *{[wanted[m] for m in missing]} in its safetensors files")
    return found
