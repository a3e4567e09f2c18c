"""Build, train and cache tiny HF target models (Llama, DeepSeek-V3) on the stdlib chat corpus.

Arch `kimi_k25` trains a DeepSeek-V3 text model like `deepseek_v3` and saves it the way the Kimi-K2.5
checkpoint is laid out: the wrapper's config.json (`KimiK25ForConditionalGeneration`, the text model's config
under `text_config`), the text weights under `language_model.` with one tensor per routed expert
(`orchestrator/wrappers.py`), and beside them a tiny vision tower, the media tokens and the image processor's
settings (`kimi_k25.py`), so that vLLM loads it as it loads the real one.

Determinism: given the same seed, spec, Python stdlib, torch/transformers/tokenizers versions,
CPU instruction set and torch thread count, a step-limited build produces bit-identical weights
(the CPU kernels used are deterministic; ``torch.use_deterministic_algorithms`` is not switched on
because it is global state and importing it pulls in torch._dynamo). A different thread count can
change float reduction order and hence the weights: pin ``train["threads"]`` to make builds
comparable across machines. A ``seconds``-limited build is not reproducible.

Subnormal floats: ``train["flush_denormals"]`` (the spec's, so the cache's) says whether every torch thread
flushes them to zero during the build. The mode is each thread's own and torch's threads take it when they start
(`compute.flush_denormals`), so a caller whose threads already run in the other mode, or in both, builds in a
process of its own, started in the spec's mode: the weights never depend on who asked for them.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from orchestrator import compute, families, wrappers

from . import kimi_k25
from .corpus import Conversation, corpus_fingerprint, stdlib_conversations

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{%- elif message['role'] in ['user', 'system'] -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- else -%}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

PAD_TOKEN = "<|pad|>"
END_TOKEN = "<|end|>"  # doubles as eos
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")
SPECIAL_TOKENS = (PAD_TOKEN, END_TOKEN, *ROLE_TOKENS)

# Per arch, a published chat template and its special tokens instead of the project's own (the arch's real
# tokenizer has them): (template file under tiny/templates, special tokens, eos, pad). Kimi-K2's template as
# ggml-org/llama.cpp vendors it (models/templates/moonshotai-Kimi-K2.jinja @ 566059a26b0ce8faec4ea053605719d399c64cc5,
# tests/data/chat_templates/SOURCES.md); its markers are Kimi's special tokens, `<|im_end|>` ends a turn (Kimi's
# generation_config stops there). The tokenizer itself stays a small BPE: Kimi's own is tiktoken remote code.
PUBLISHED_TEMPLATES = {
    "kimi_k25": (
        "moonshotai-Kimi-K2.jinja",
        (
            "[PAD]",
            "<|im_end|>",
            "<|im_system|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_middle|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
            *kimi_k25.MEDIA_TOKENS,
        ),  # fmt: skip
        "<|im_end|>",
        "[PAD]",
    )
}
TEMPLATES_DIR = Path(__file__).with_name("templates")

REPORT_NAME = "build_report.json"
# a tiny target's arch is its family (orchestrator/families.py)
ARCHS = families.names()
# arch -> the multimodal wrapper its checkpoint is saved in
WRAPPED = {name: wrappers.WRAPPERS[f.wrapper] for name, f in families.FAMILIES.items() if f.wrapper}

# Every key a build reads; the values live in conf/target/tiny_*.yaml (`target.tiny`).
TRAIN_KEYS = (
    "steps",  # stop after this many optimizer steps ...
    "seconds",  # ... and/or after this much training wall time (not reproducible)
    "seq_len",
    "batch_size",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "betas",
    "grad_clip",
    "tokenizer_vocab_size",  # None: the model's vocab_size
    "tokenizer_max_texts",
    "eval_sequences",
    "max_files",  # corpus subsample; None: every file
    "threads",  # torch intra-op threads during the build; None: leave torch's setting
    "flush_denormals",  # subnormal floats flushed to zero on every thread (compute.flush_denormals)
)
MODEL_KEYS = ("vocab_size", "max_position_embeddings")  # read by the builder itself; the rest go to the HF config


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(
    texts: Sequence[str],
    vocab_size: int,
    out_dir: Path | None = None,
    *,
    model_max_length: int = 2048,
    arch: str = "llama",
):
    """Train a byte-level BPE tokenizer; return it as a ``PreTrainedTokenizerFast``, with the project's chat
    template, or the arch's published one and its special tokens (PUBLISHED_TEMPLATES).

    If ``out_dir`` is given the tokenizer is saved there (tokenizer.json, tokenizer_config.json,
    chat template) and is loadable with ``AutoTokenizer.from_pretrained(out_dir)``.
    """
    if arch in PUBLISHED_TEMPLATES:
        name, specials, eos, pad = PUBLISHED_TEMPLATES[arch]
        template = (TEMPLATES_DIR / name).read_text()
    else:
        specials, eos, pad, template = SPECIAL_TOKENS, END_TOKEN, PAD_TOKEN, CHAT_TEMPLATE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token=pad,
        additional_special_tokens=[t for t in specials if t not in (eos, pad)],
        chat_template=template,
        model_max_length=model_max_length,
    )
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


# --------------------------------------------------------------------------- helpers


def _normalize_spec(arch: str, model: dict, train: dict, seed: int) -> dict[str, Any]:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    unknown = set(train) - set(TRAIN_KEYS)
    if unknown:
        raise ValueError(f"unknown train keys: {sorted(unknown)}; expected {list(TRAIN_KEYS)}")
    missing = [k for k in TRAIN_KEYS if k not in train]
    if missing:
        raise ValueError(f"train keys missing: {missing}; set them under target.tiny.train (conf/target/tiny_*.yaml)")
    missing = [k for k in MODEL_KEYS if k not in model]
    if missing:
        raise ValueError(f"model keys missing: {missing}; set them under target.tiny.model (conf/target/tiny_*.yaml)")
    tr = dict(train)
    if tr["steps"] is None and tr["seconds"] is None:
        raise ValueError("train needs 'steps' and/or 'seconds'")
    spec = {"arch": arch, "model": dict(model), "train": tr, "seed": int(seed)}
    if arch in PUBLISHED_TEMPLATES:  # the template's text decides the tokens trained on
        name = PUBLISHED_TEMPLATES[arch][0]
        spec["chat_template"] = hashlib.sha256((TEMPLATES_DIR / name).read_bytes()).hexdigest()
    if arch == "kimi_k25":  # what the checkpoint holds beside the text model, and the router's bias
        spec["beside_text"] = kimi_k25.SPEC
    # json round trip: tuples -> lists, so a spec compares equal to the one read back from disk.
    return json.loads(json.dumps(spec, sort_keys=True))


# Tiny targets built once and kept in the repository (each folder as a build leaves it, its report naming the
# processor it was built on): a build is the same on one machine only, so the demo and the tests take these copies,
# and every machine starts from the same weights. `target.tiny.rebuild=true` builds on the machine at hand instead.
SHIPPED = Path(__file__).resolve().parent / "shipped"


def shipped_build(arch: str, model: dict, train: dict, seed: int) -> Path | None:
    """The repository's copy of this recipe's build (`SHIPPED`), or None where none is kept."""
    spec = _normalize_spec(arch, model, train, seed)
    for report in sorted(SHIPPED.glob(f"*/{REPORT_NAME}")):
        if json.loads(report.read_text()).get("spec") == spec:
            return report.parent
    return None


def shipped_weights(arch: str, model: dict, train: dict, seed: int) -> str | None:
    """The combined weights hash of the repository's copy of this recipe's build, or None where none is kept."""
    found = shipped_build(arch, model, train, seed)
    return None if found is None else json.loads((found / REPORT_NAME).read_text())["weights_sha256"]["combined"]


def spec_hash(arch: str, model: dict, train: dict, seed: int) -> str:
    """Short content hash of a build spec, handy for naming cache directories."""
    spec = _normalize_spec(arch, model, train, seed)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _make_config(arch: str, model: dict, tokenizer) -> Any:
    from transformers import DeepseekV3Config, LlamaConfig

    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    # a deep copy: transformers rewrites a rope_scaling dict in place, which would change the spec it came from
    kwargs = {**ids, "vocab_size": len(tokenizer), **copy.deepcopy(model)}
    if kwargs["vocab_size"] < len(tokenizer):
        raise ValueError(f"model vocab_size {kwargs['vocab_size']} < tokenizer size {len(tokenizer)}")
    # the family's text model (kimi_k25's is DeepSeek-V3)
    cls = {"LlamaForCausalLM": LlamaConfig, "DeepseekV3ForCausalLM": DeepseekV3Config}[
        families.FAMILIES[arch].text_architecture
    ]
    return cls(**kwargs)


def save_target(model, tokenizer, arch: str, out: Path, seed: int) -> None:
    """The trained text model and its tokenizer saved into `out` as the arch's checkpoint is laid out: a plain
    `save_pretrained`, or the wrapper's checkpoint (config.json, `<text_attribute>.*` weights as transformers
    names them on save, and for Kimi-K2.5 what the checkpoint holds beside the text model)."""
    from safetensors.torch import save_file

    if arch not in WRAPPED:
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        return
    wrapper = WRAPPED[arch]
    text_config = model.config.to_dict()
    ids = {k: text_config.get(k) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    top_level = {"dtype": text_config.get("dtype"), "tie_word_embeddings": False, **ids}
    weights = wrappers.wrapped_state_dict(wrapper, model)
    if arch == "kimi_k25":
        top_level |= kimi_k25.wrapper_fields(tokenizer)
        weights |= kimi_k25.vision_tensors(text_config["hidden_size"], seed)
        kimi_k25.write_preprocessor_config(out)
    config = wrappers.wrapper_config(wrapper, text_config, **top_level)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def weights_sha256(model_dir: Path) -> dict[str, Any]:
    """sha256 per ``*.safetensors`` file plus a combined hash over (name, digest) pairs."""
    files = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        files[path.name] = h.hexdigest()
    combined = hashlib.sha256("".join(f"{n}:{d}\n" for n, d in files.items()).encode()).hexdigest()
    return {"combined": combined, "files": files}


class _PackedStream:
    """Endless stream of [batch, seq_len] token blocks from shuffled, concatenated conversations."""

    def __init__(self, tokenizer, convs: list[Conversation], seq_len: int, batch_size: int, seed: int):
        if not convs:
            raise ValueError("no training conversations")
        self.tok, self.convs = tokenizer, convs
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rng = random.Random(seed)
        self.buffer: list[int] = []
        self.tokens_seen = 0
        self.epochs = 0
        self._convs_iter: Iterator[Conversation] = iter(())

    def _refill(self, n_convs: int = 64) -> None:
        batch: list[Conversation] = []
        while len(batch) < n_convs:
            conv = next(self._convs_iter, None)
            if conv is None:
                if batch:
                    break
                order = list(self.convs)
                self.rng.shuffle(order)
                self._convs_iter = iter(order)
                self.epochs += 1
                continue
            batch.append(conv)
        texts = self.tok.apply_chat_template(batch, tokenize=False)
        for ids in self.tok(texts, add_special_tokens=False)["input_ids"]:
            self.buffer.extend(ids)

    def next_batch(self) -> torch.Tensor:
        need = self.seq_len * self.batch_size
        while len(self.buffer) < need:
            self._refill()
        block, self.buffer = self.buffer[:need], self.buffer[need:]
        self.tokens_seen += need
        return torch.tensor(block, dtype=torch.long).view(self.batch_size, self.seq_len)


def _eval_blocks(tokenizer, convs: list[Conversation], seq_len: int, n_blocks: int):
    """Pack heldout conversations into blocks with their assistant masks.

    The conversation order uses a fixed seed (not the build seed) so every build is scored on
    the same text, drawn from many heldout files rather than the first few.
    """
    convs = list(convs)
    random.Random(0).shuffle(convs)
    ids: list[int] = []
    mask: list[int] = []
    need = seq_len * n_blocks
    from orchestrator.data import render  # the assistant mask under any template, as extraction takes it

    for conv in convs:
        rendered = render(tokenizer, conv, 1 << 30)
        ids.extend(rendered.input_ids)
        mask.extend(rendered.loss_mask)
        if len(ids) >= need:
            break
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError("heldout corpus too small for one eval block")
    ids_t = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    mask_t = torch.tensor(mask[: n * seq_len], dtype=torch.bool).view(n, seq_len)
    return ids_t, mask_t


@torch.no_grad()
def _evaluate(model, ids: torch.Tensor, mask: torch.Tensor, batch_size: int) -> dict[str, float]:
    model.eval()
    tot = {"all": [0.0, 0, 0], "assistant": [0.0, 0, 0]}  # loss sum, correct, count
    for i in range(0, ids.shape[0], batch_size):
        x = ids[i : i + batch_size]
        logits = model(input_ids=x).logits[:, :-1].float()
        target = x[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        correct = logits.argmax(-1) == target
        everything = torch.ones_like(target, dtype=torch.bool)
        for key, sel in (("all", everything), ("assistant", mask[i : i + batch_size, 1:])):
            tot[key][0] += nll[sel].sum().item()
            tot[key][1] += correct[sel].sum().item()
            tot[key][2] += int(sel.sum())
    model.train()
    out = {}
    for key, (loss, correct, count) in tot.items():
        prefix = "heldout" if key == "all" else "heldout_assistant"
        out[f"{prefix}_loss"] = loss / max(count, 1)
        out[f"{prefix}_top1"] = correct / max(count, 1)
        out[f"{prefix}_tokens"] = count
    return out


def _lr_factor(progress: float, step: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _progress(total: int | None, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=False)


# --------------------------------------------------------------------------- build


def _train_and_save(tmp: Path, spec: dict[str, Any], progress: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    arch, model_over, tr, seed = spec["arch"], spec["model"], spec["train"], spec["seed"]
    t_start = time.perf_counter()
    train_convs, heldout_convs = stdlib_conversations(seed, tr["max_files"])
    rng = random.Random(seed)
    tok_texts = [m["content"] for conv in train_convs for m in conv]
    rng.shuffle(tok_texts)
    tok_vocab = tr["tokenizer_vocab_size"] or model_over["vocab_size"]
    max_pos = model_over["max_position_embeddings"]
    tokenizer = train_tokenizer(tok_texts[: tr["tokenizer_max_texts"]], tok_vocab, model_max_length=max_pos, arch=arch)
    t_tok = time.perf_counter()

    config = _make_config(arch, model_over, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "kimi_k25":
        kimi_k25.set_router_bias(model, seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    seq_len, bs = tr["seq_len"], tr["batch_size"]
    stream = _PackedStream(tokenizer, train_convs, seq_len, bs, seed + 1)
    eval_ids, eval_mask = _eval_blocks(tokenizer, heldout_convs, seq_len, tr["eval_sequences"])

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tr["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tr["lr"],
        betas=tuple(tr["betas"]),
    )

    steps, seconds = tr["steps"], tr["seconds"]
    bar = _progress(steps, progress, f"train {arch}")
    step, loss_ema, last_loss = 0, None, float("nan")
    step_times: list[float] = []
    t_train = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - t_train
        if (steps is not None and step >= steps) or (seconds is not None and elapsed >= seconds):
            break
        progress_frac = max(step / steps if steps else 0.0, elapsed / seconds if seconds else 0.0)
        lr = tr["lr"] * _lr_factor(progress_frac, step, tr["warmup_steps"], tr["min_lr_ratio"])
        for group in opt.param_groups:
            group["lr"] = lr
        t_step = time.perf_counter()
        x = stream.next_batch()
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if tr["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tr["grad_clip"])
        opt.step()
        step += 1
        last_loss = loss.item()
        step_times.append(time.perf_counter() - t_step)
        loss_ema = last_loss if loss_ema is None else 0.95 * loss_ema + 0.05 * last_loss
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.1e}")
    bar.close()
    train_seconds = time.perf_counter() - t_train

    metrics = _evaluate(model, eval_ids, eval_mask, bs)

    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    save_target(model, tokenizer, arch, tmp, seed)

    import tokenizers
    import transformers

    vocab = config.vocab_size
    return {
        "spec": spec,
        "arch": arch,
        "model_class": WRAPPED[arch].architecture if arch in WRAPPED else type(model).__name__,
        "text_model_class": type(model).__name__,
        "parameters": n_params,
        "vocab_size": vocab,
        "tokenizer_size": len(tokenizer),
        "uniform_loss": math.log(vocab),
        **metrics,
        "final_train_loss": last_loss,
        "final_train_loss_ema": loss_ema,
        "steps": step,
        "tokens_seen": stream.tokens_seen,
        "train_epochs_started": stream.epochs,
        "train_conversations": len(train_convs),
        "heldout_conversations": len(heldout_convs),
        "corpus_sha256": corpus_fingerprint(train_convs + heldout_convs),
        "train_seconds": train_seconds,
        # p10 is a fair estimate of the uncontended step time when the machine is shared.
        "step_seconds": _quantiles(step_times),
        "tokenizer_seconds": t_tok - t_start,
        "total_seconds": time.perf_counter() - t_start,
        "weights_sha256": weights_sha256(tmp),
        "environment": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "torch_threads": torch.get_num_threads(),
            "subnormals": compute.denormal_mode(),  # on the threads that built it: the spec's flush_denormals
            "machine": platform.machine(),
            **cpu_identity(),
        },
    }


def cpu_identity() -> dict[str, str]:
    """The processor a build ran on: its report says where its figures hold. A build is the same on one machine,
    not across machines: the same commit and packages built the tiny Llama to held-out losses 4.97 and 5.12 on two
    (docs/measurements.md#figures-and-the-processor)."""
    return {"cpu": compute.cpu_name(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _build_in_mode(tmp: Path, spec: dict[str, Any], progress: bool) -> dict[str, Any]:
    """`_train_and_save` with subnormals as the spec says on every thread: here when this process's threads
    already are so, else in a process of its own that sets the mode before its first parallel operation."""
    threads = spec["train"]["threads"]
    if compute.denormal_mode() == _wanted_mode(spec):
        with _isolated_torch_state(threads):
            return _train_and_save(tmp, spec, progress)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_build_in_new_process, tmp, spec, progress, threads or torch.get_num_threads()).result()


def _wanted_mode(spec: dict[str, Any]) -> str:
    """The `compute.denormal_mode` a build's spec asks its threads for."""
    return "flushed" if spec["train"]["flush_denormals"] else "kept"


def _build_in_new_process(tmp: Path, spec: dict[str, Any], progress: bool, threads: int) -> dict[str, Any]:
    flush = bool(spec["train"]["flush_denormals"])
    if not torch.set_flush_denormal(flush) and flush:  # before any parallel operation
        raise RuntimeError(
            "target.tiny.train.flush_denormals: this processor cannot flush subnormal floats (torch.set_flush_denormal"
            " needs x86 with SSE3 or AArch64); build with target.tiny.train.flush_denormals=false"
        )
    torch.set_num_threads(threads)
    mode = compute.denormal_mode()
    if mode != _wanted_mode(spec):
        raise RuntimeError(f"a fresh build process's torch threads have subnormals {mode}")
    return _train_and_save(tmp, spec, progress)


@contextlib.contextmanager
def _isolated_torch_state(threads: int | None):
    """Pin the thread count and fork the RNG so a build neither depends on nor disturbs the caller."""
    before = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            if threads:
                torch.set_num_threads(threads)
            yield
    finally:
        torch.set_num_threads(before)


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    return {q: xs[min(len(xs) - 1, int(f * len(xs)))] for q, f in (("p10", 0.1), ("median", 0.5), ("p90", 0.9))}


def _read_report(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / REPORT_NAME
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _check_cached(out_dir: Path, spec: dict[str, Any]) -> bool:
    report = _read_report(out_dir)
    if report is None:
        return False
    if report.get("spec") != spec:
        raise ValueError(
            f"{out_dir} holds a build of a different spec:\n  cached: {report.get('spec')}\n  wanted: {spec}"
        )
    return True


def build_tiny_target(
    out_dir: Path | str,
    arch: str,
    model: dict,
    train: dict,
    seed: int = 0,
    *,
    progress: bool = True,
    rebuild: bool = False,
) -> Path:
    """Build (or reuse) a trained tiny target in ``out_dir`` and return ``out_dir``: the repository's copy of this
    recipe's build (`SHIPPED`) where one is kept, unless ``rebuild``, else a build on this machine.

    A build is complete iff ``out_dir/build_report.json`` exists; it is written inside a temp
    sibling directory which is renamed into place last, so a crashed build is never mistaken for
    a complete one. A file lock at ``<out_dir>.lock`` serialises concurrent builders.
    """
    from filelock import FileLock

    out_dir = Path(out_dir)
    spec = _normalize_spec(arch, model, train, seed)
    if _check_cached(out_dir, spec):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):
        if _check_cached(out_dir, spec):
            return out_dir
        if out_dir.exists() and any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} exists, is not empty and has no {REPORT_NAME}; refusing to overwrite")
        # Temp dirs are only created under the lock, so any left over belong to killed builds.
        for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        shipped = None if rebuild else shipped_build(arch, model, train, seed)
        try:
            if shipped is not None:  # every file of the kept build, its report last
                for f in sorted(shipped.iterdir(), key=lambda f: f.name == REPORT_NAME):
                    shutil.copyfile(f, tmp / f.name)
            else:
                report = _build_in_mode(tmp, spec, progress)
                (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
            if out_dir.exists():
                out_dir.rmdir()  # empty (checked above); rename cannot replace a non-empty dir
            os.replace(tmp, out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def load_build_report(out_dir: Path | str) -> dict[str, Any]:
    report = _read_report(Path(out_dir))
    if report is None:
        raise FileNotFoundError(f"no {REPORT_NAME} in {out_dir}")
    return report
