"""Fast tests for the tiny target builder: the specs conf/ composes, shrunk to tiny sizes and a few optimizer steps."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch

from orchestrator import compute
from orchestrator.tiny import build as build_mod
from orchestrator.tiny import build_tiny_target, load_build_report, spec_hash, stdlib_conversations
from orchestrator.tiny.corpus import is_heldout

# a build in seconds: the builder's code paths, not a model that has learned
FAST_TRAIN = {
    "steps": 5,
    "seq_len": 64,
    "batch_size": 2,
    "warmup_steps": 2,
    "max_files": 16,
    "tokenizer_vocab_size": 384,
    "tokenizer_max_texts": 2000,
    "eval_sequences": 4,
}
FAST_MODEL = {
    "llama": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 512},
    "deepseek_v3": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "vocab_size": 512,
    },
}
EXPERIMENTS = {"llama": "tiny_eagle3", "deepseek_v3": "tiny_deepseek_eagle3"}
ARCHS = tuple(EXPERIMENTS)


@pytest.fixture(scope="module")
def fast_specs(tiny_config) -> dict:
    """Each tiny target's spec as its experiment composes it from conf/, shrunk by FAST_MODEL and FAST_TRAIN."""
    specs = {}
    for arch, experiment in EXPERIMENTS.items():
        tiny = tiny_config(experiment=experiment, fast=False).target.tiny
        assert tiny.arch == arch
        specs[arch] = {"arch": arch, "model": {**tiny.model, **FAST_MODEL[arch]}, "train": {**tiny.train, **FAST_TRAIN}}
    return specs


@pytest.fixture(scope="module")
def built(tmp_path_factory, fast_specs) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_target(root / arch, **fast_specs[arch], seed=0, progress=False) for arch in ARCHS}


def test_a_spec_names_every_key_the_builder_reads(fast_specs):
    spec = fast_specs["llama"]
    train = {k: v for k, v in spec["train"].items() if k != "warmup_steps"}
    with pytest.raises(ValueError, match=r"train keys missing: \['warmup_steps'\].*target\.tiny\.train"):
        spec_hash(spec["arch"], spec["model"], train, 0)
    model = {k: v for k, v in spec["model"].items() if k != "vocab_size"}
    with pytest.raises(ValueError, match=r"model keys missing: \['vocab_size'\]"):
        spec_hash(spec["arch"], model, spec["train"], 0)
    with pytest.raises(ValueError, match=r"unknown train keys: \['warmup'\]"):
        spec_hash(spec["arch"], spec["model"], {**spec["train"], "warmup": 3}, 0)


def test_corpus_deterministic_and_split():
    train_a, held_a = stdlib_conversations(seed=3, max_files=12)
    train_b, held_b = stdlib_conversations(seed=3, max_files=12)
    assert train_a == train_b and held_a == held_b
    assert train_a and held_a
    for conv in train_a + held_a:
        assert [m["role"] for m in conv] in (["user", "assistant"], ["user", "assistant"] * 2)
        for m in conv[1::2]:
            assert m["content"].strip() and len(m["content"]) <= 1200 + 400

    # The split is by file, so no file appears on both sides.
    def files(convs):
        return {c[0]["content"].split("`")[1] for c in convs}

    assert not files(train_a) & files(held_a)
    assert all(is_heldout(f) for f in files(held_a))


@pytest.mark.parametrize("arch", ARCHS)
def test_reload_and_report(built, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = built[arch]
    report = load_build_report(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    expected = {"llama": "LlamaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[arch]
    assert type(model).__name__ == expected == report["model_class"]
    assert model.dtype == torch.float32
    assert not model.config.tie_word_embeddings
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|end|>")
    assert tok.pad_token == "<|pad|>"
    assert len(tok) <= model.config.vocab_size

    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()

    assert report["uniform_loss"] == pytest.approx(math.log(model.config.vocab_size))
    assert report["steps"] == FAST_TRAIN["steps"]
    assert report["tokens_seen"] == 5 * 64 * 2
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    assert math.isfinite(report["heldout_loss"]) and 0 <= report["heldout_top1"] <= 1
    assert report["weights_sha256"]["files"].keys() == {"model.safetensors"}
    assert report["weights_sha256"] == build_mod.weights_sha256(out)
    # where its figures hold: the processor, as the build saw it
    assert report["environment"]["cpu"] and report["environment"]["torch_cpu_capability"] == (
        torch.backends.cpu.get_cpu_capability()
    )


def test_chat_template_assistant_mask(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["llama"])
    conv = [
        {"role": "user", "content": "Show `a.py`."},
        {"role": "assistant", "content": "def f(x):\n    return x\n"},
        {"role": "user", "content": "Continue."},
        {"role": "assistant", "content": "\nclass A:\n    pass\n"},
    ]
    enc = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]

    # Special tokens split the text, so the sequence is the concatenation of the pieces.
    def piece(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    special = {t: tok.convert_tokens_to_ids(t) for t in ("<|user|>", "<|assistant|>", "<|end|>")}
    exp_ids, exp_mask = [], []
    for m in conv:
        body = piece(m["content"]) + [special["<|end|>"]]
        exp_ids += [special[f"<|{m['role']}|>"]] + body
        exp_mask += [0] + [int(m["role"] == "assistant")] * len(body)
    assert ids == exp_ids
    assert mask == exp_mask

    prompt = tok.apply_chat_template(conv[:3], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>")
    prompt_ids = tok.apply_chat_template(conv[:3], tokenize=True, add_generation_prompt=True)
    prompt_ids = prompt_ids["input_ids"] if not isinstance(prompt_ids, list) else prompt_ids
    assert ids[: len(prompt_ids)] == prompt_ids
    assert tok.decode(ids) == tok.apply_chat_template(conv, tokenize=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_deterministic_and_cached(built, fast_specs, arch, tmp_path):
    first = load_build_report(built[arch])
    again = build_tiny_target(tmp_path / "again", **fast_specs[arch], seed=0, progress=False)
    assert load_build_report(again)["weights_sha256"] == first["weights_sha256"]

    report_path = built[arch] / "build_report.json"
    mtime = report_path.stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_tiny_target(built[arch], **fast_specs[arch], seed=0, progress=False) == built[arch]
    assert time.perf_counter() - t0 < 1.0
    assert report_path.stat().st_mtime_ns == mtime
    assert build_mod.weights_sha256(built[arch]) == first["weights_sha256"]


KEPT_MODE_BUILDS = """
import json, sys, torch
from orchestrator import compute
from orchestrator.tiny import build_tiny_target, load_build_report
torch.ones(1 << 18) * 2.0  # torch's threads start here, keeping subnormals
assert compute.denormal_mode() == "kept"
for name, spec in json.loads(sys.argv[1]).items():
    report = load_build_report(build_tiny_target(sys.argv[2] + "/" + name, **spec, seed=0, progress=False))
    print(name, report["weights_sha256"]["combined"], report["environment"]["subnormals"])
"""


def test_a_build_flushes_subnormals_as_its_spec_says_whoever_asks(fast_specs, tmp_path):
    """A build's threads flush subnormals or keep them as `train.flush_denormals` says, whatever mode the caller's
    threads run in: here (flushed, conftest) and in a process whose threads started keeping them. Each mode is
    built in the caller's process by one and in a process of its own by the other, to the same weights."""
    import subprocess
    import sys

    spec = fast_specs["llama"]
    specs = {f"flush_{f}": {**spec, "train": {**spec["train"], "flush_denormals": f}} for f in (True, False)}
    assert compute.denormal_mode() == "flushed"
    here = {}
    for name, s in specs.items():
        report = load_build_report(build_tiny_target(tmp_path / "here" / name, **s, seed=0, progress=False))
        here[name] = (report["weights_sha256"]["combined"], report["environment"]["subnormals"])
    assert compute.denormal_mode() == "flushed"  # the caller's threads as they were
    done = subprocess.run([sys.executable, "-c", KEPT_MODE_BUILDS, json.dumps(specs), str(tmp_path / "there")],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    there = {name: (sha, mode) for name, sha, mode in (line.split() for line in done.stdout.splitlines())}
    assert here == there
    assert here["flush_True"][1] == "flushed" and here["flush_False"][1] == "kept"


def test_a_processor_that_cannot_flush_subnormals_names_the_key_that_builds_without(fast_specs, tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "set_flush_denormal", lambda mode: False)  # what torch answers on such a processor
    spec = fast_specs["llama"]
    with pytest.raises(RuntimeError, match=r"target\.tiny\.train\.flush_denormals=false"):
        build_mod._build_in_new_process(tmp_path, {**spec, "seed": 0}, False, 1)
    assert not any(tmp_path.iterdir())


def test_other_seed_differs_and_spec_mismatch_raises(built, fast_specs, tmp_path):
    spec = fast_specs["llama"]
    other = build_tiny_target(tmp_path / "seed1", **spec, seed=1, progress=False)
    assert load_build_report(other)["weights_sha256"] != load_build_report(built["llama"])["weights_sha256"]
    with pytest.raises(ValueError, match="different spec"):
        build_tiny_target(built["llama"], **spec, seed=1, progress=False)


def test_concurrent_builders_build_once_and_clean_stale_temp(fast_specs, tmp_path, monkeypatch):
    calls = []
    real = build_mod._train_and_save

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(build_mod, "_train_and_save", counting)
    out = tmp_path / "shared"
    (tmp_path / ".shared.tmp-1-deadbeef").mkdir()  # left behind by a killed build
    results, errors = [], []

    def worker():
        try:
            results.append(build_tiny_target(out, **fast_specs["llama"], seed=0, progress=False))
        except Exception as e:  # pragma: no cover - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [out, out]
    assert len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared", "shared.lock"]  # no temp dirs left
    assert json.loads((out / "build_report.json").read_text())["steps"] == FAST_TRAIN["steps"]


def test_the_demos_target_is_the_repositorys_copy_and_a_rebuild_is_another_target(tiny_config, tmp_path, monkeypatch):
    """The demo's tiny Llama is not built: its recipe's build is kept in orchestrator/tiny/shipped, whole (its
    weights hash to what its report says), and copied into the cache as it is; `target.tiny.rebuild=true` is
    another target folder and another key for every stage, so nothing computed on one is read for the other."""
    import hashlib

    from orchestrator.pipeline import stage_keys
    from orchestrator.targets import ensure_target, target_dir

    cfg = tiny_config(fast=False)
    t = cfg.target.tiny
    kept = build_mod.shipped_build(t.arch, dict(t.model), dict(t.train), cfg.seed)
    assert kept is not None and kept.parent == build_mod.SHIPPED, "the demo's recipe has a kept build"
    report = load_build_report(kept)
    for name, digest in report["weights_sha256"]["files"].items():  # a pointer file or a cut copy fails here
        assert hashlib.sha256((kept / name).read_bytes()).hexdigest() == digest, name

    def no_build(*args, **kwargs):
        raise AssertionError("the kept target was built again")

    monkeypatch.setattr(build_mod, "_build_in_mode", no_build)
    copied = ensure_target(tiny_config(f"outputs_dir={tmp_path}", fast=False), progress=False)
    assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in kept.iterdir())
    assert all((copied / p.name).read_bytes() == p.read_bytes() for p in kept.iterdir())
    rebuilt = tiny_config("target.tiny.rebuild=true", fast=False)
    assert target_dir(rebuilt) != target_dir(cfg)
    keys, other = stage_keys(cfg), stage_keys(rebuilt)
    assert all(keys[stage] != other[stage] for stage in ("extract", "train", "eval")), (keys, other)
    with pytest.raises(AssertionError, match="built again"):  # a rebuild trains: here, the patched builder says so
        ensure_target(tiny_config(f"outputs_dir={tmp_path}", "target.tiny.rebuild=true", fast=False), progress=False)
    # the tests' own recipes are kept too: the FAST target and the small tiny Kimi are copied, never built
    fast = tiny_config().target.tiny
    assert build_mod.shipped_build(fast.arch, dict(fast.model), dict(fast.train), cfg.seed).name == "tiny_llama_fast"
    from conftest import TINY_KIMI_MODEL, TINY_KIMI_TRAIN

    kimi = tiny_config(experiment="tiny_kimi_eagle3", fast=False).target.tiny
    small = build_mod.shipped_build(kimi.arch, {**kimi.model, **TINY_KIMI_MODEL}, {**kimi.train, **TINY_KIMI_TRAIN}, 0)
    assert small is not None and small.name == "tiny_kimi_small"
