"""Drafts trained elsewhere: which target layers each engine would feed them (published drafts' own config.json
files, tests/data/drafts/published/SOURCES.md), the search for the layers a draft was trained on, and such a
draft measured by eval in place of a trained one (train.from_draft)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from orchestrator import preflight
from orchestrator.artifacts import read_json
from orchestrator.draft import formats, readings
from orchestrator.pipeline import make_plan, run_pipeline

PUBLISHED = Path(__file__).parent / "data" / "drafts" / "published"
PINS = {"sglang": "0.5.23", "vllm": "0.32.0"}


def _fed(conf: dict, n: int, family: str) -> dict[str, list[int] | None]:
    return {
        r.label: (list(r.layers) if r.layers is not None else None)
        for r in readings.engine_readings(conf, n, family, PINS)
    }


def test_aq_medais_kimi_draft_is_fed_layers_1_29_57_today_and_2_30_58_before_sglangs_first_id_rule():
    """AQ-MedAI's Kimi-K2.5 draft ships nested ids [2, 30, 58] and no record of its layers. SGLang 0.5.23 reads
    them entering layers 2, 30, 58 (the first id is not 1: no shift), i.e. the outputs of layers 1, 29, 57;
    SGLang before 0.5.13 shifted every id: outputs of 2, 30, 58. vLLM's V1 runner reads the nested key (the same
    states as SGLang 0.5.23); its Model Runner V2 reads no nested key and captures its defaults (2, 30, 58), which
    for Kimi's 61 layers happen to be the same states."""
    conf = json.loads((PUBLISHED / "AQ-MedAI__Kimi-K25-eagle3" / "config.json").read_text())
    assert formats.draft_format(PUBLISHED / "AQ-MedAI__Kimi-K25-eagle3") == "sglang"
    assert _fed(conf, 61, "kimi_k25") == {
        "sglang 0.5.23": [1, 29, 57],
        "sglang < 0.5.13": [2, 30, 58],
        "vllm 0.32.0 V1": [1, 29, 57],
        "vllm 0.32.0 MRV2": [1, 29, 57],
    }
    sources = {r.label: r.source for r in readings.engine_readings(conf, 61, "kimi_k25", PINS)}
    assert sources["vllm 0.32.0 MRV2"] == "no ids: its defaults", sources


def test_a_speculators_draft_without_ids_is_fed_each_engines_defaults():
    """nm-testing's converted Llama-3.1-8B draft (speculators format) carries no ids anywhere: every engine feeds
    it its defaults, SGLang and vLLM the same states for a Llama ([2, 16, 29] entering: outputs 1, 15, 28)."""
    folder = PUBLISHED / "nm-testing__EAGLE3-LLaMA3.1-Instruct-8B-converted"
    assert formats.draft_format(folder) == "speculators"
    conf = json.loads((folder / "config.json").read_text())
    assert _fed(conf, 32, "llama") == {
        "sglang 0.5.23": [1, 15, 28],
        "vllm 0.32.0 V1": [1, 15, 28],
        "vllm 0.32.0 MRV2": [1, 15, 28],
    }
    project = formats.project_config(conf, "speculators")
    assert project["hidden_size"] == 4096 and project["draft_vocab_size"] == 32000
    assert project["architectures"] == ["LlamaForCausalLMEagle3"]


def test_the_candidates_are_every_reading_and_it_shifted_by_one():
    conf = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}}
    rows = readings.engine_readings(conf, 8, "llama", PINS)
    options = readings.candidates(rows, 8, 3)
    assert options == {
        (1, 4, 6): ["sglang 0.5.23"],  # SGLang's Llama rule: id i is the output of layer i
        (0, 3, 5): ["vllm 0.32.0 V1"],  # vLLM's: the state entering layer i
        (2, 5, 7): [],
        (-1, 2, 4): [],
        (1, 3, 4): ["vllm 0.32.0 MRV2"],  # no nested key read: its defaults (2, 4, 5)
        (0, 2, 3): [],
        (2, 4, 5): [],
    }


def test_a_reading_is_named_only_when_its_loss_is_below_every_others_by_three_standard_errors_and_a_margin():
    """Paired over the same sequences: a loss_0 lower by 5 per 100 positions on every one of 40 sequences is clear;
    the same mean difference, alternating -25 and +15, is within the noise. acc_0 does not decide: the clear case's
    winner has the lower acc_0."""
    S = readings.SequenceScore
    clear = [
        {"layers": [1, 4, 6], "loss_0": 2.00, "acc_0": 0.50, "per_sequence": [S(50, 100, 200.0)] * 40},
        {"layers": [0, 3, 5], "loss_0": 2.05, "acc_0": 0.55, "per_sequence": [S(55, 100, 205.0)] * 40},
    ]
    found, why = readings.verdict(clear)
    assert found == [1, 4, 6] and "closest: [0, 3, 5]" in why, why
    noisy = [
        {"layers": [1, 4, 6], "loss_0": 2.0, "acc_0": 0.5, "per_sequence": [S(50, 100, 180.0), S(50, 100, 220.0)] * 20},
        {"layers": [0, 3, 5], "loss_0": 2.05, "acc_0": 0.5, "per_sequence": [S(50, 100, 205.0)] * 40},
    ]
    found, why = readings.verdict(noisy)
    assert found is None and why.startswith("cannot tell"), why
    # consistent on every sequence, so many standard errors, but 0.0001 on a loss_0 of 6.09: a tie (MIN_LEAD)
    alike = [
        {"layers": [2, 5, 7], "loss_0": 6.0914, "acc_0": 0.04, "per_sequence": [S(4, 100, 609.14)] * 48},
        {"layers": [1, 4, 6], "loss_0": 6.0915, "acc_0": 0.06, "per_sequence": [S(6, 100, 609.15)] * 48},
    ]
    found, why = readings.verdict(alike)
    assert found is None and "only 0.0001 below [1, 4, 6]" in why and "under 0.1%" in why, why


def test_a_relabeled_draft_is_read_searched_and_measured_by_eval_like_the_trained_one(fast_cache, tiny_config,
                                                                                      tmp_path):  # fmt: skip
    """The FAST draft (trained on [1, 4, 6]) relabeled: `check_draft=` prints each engine's reading (vLLM reads
    [2, 5, 7] as the trained layers; SGLang's Llama rule captures two states only, id 7 being the last layer), and
    refuses serve.engine=reference, which reads SGLang's convention. The loss_0 search cannot name this weak draft's
    layers with confidence (16 steps on the weak FAST target: loss_0 within 0.0001 under every reading with 128-token
    answers, 2.9 standard errors apart with 64-token ones), and says so rather than name one; where it names one it
    must be the trained [1, 4, 6] (over 48 sequences consistent 0.0001 differences named [2, 5, 7] at 12.7 standard
    errors before `readings.MIN_LEAD`).
    Imported with train.from_draft (aux_layers [1, 4, 6]), eval measures exactly what it measures for the trained
    draft: the same weights fed the same states."""
    outputs = fast_cache("extract", "train", "eval")
    cfg = tiny_config("cluster=local")
    plan = make_plan(cfg, tmp_path / "run")
    draft = tmp_path / "relabeled"
    assert formats.relabel(plan.dir("train") / "draft", draft, "vllm", "llama", 8, "0.32.0") == [2, 5, 7]
    assert not (draft / "orchestrator.json").exists()
    # the search over 48 validation conversations (FAST holds 16): enough sequences for many standard errors
    check = tiny_config("cluster=local", "data.max_val_conversations=48", "eval.max_conversations=48")
    findings = preflight.run_checks(check, make_plan(check, tmp_path / "check"), str(draft))
    by = {f.category: f for f in findings if f.category in ("draft format", "trained layers")}
    assert by["draft format"].ok and "vllm format" in by["draft format"].message
    # a weak draft: the search cannot tell (a lead under 0.1% of loss_0, or under 3 standard errors), or names the
    # layers it was trained on; never another set
    trained = by["trained layers"].message
    named = re.search(r"fits (\[[\d, ]+\]) best", trained)
    assert ("cannot tell" in trained and not named) or (named and named.group(1) == "[1, 4, 6]"), trained
    refused = [f for f in findings if f.category == "layer ids" and not f.ok]
    assert len(refused) == 1 and "captures 2 states for 3 ids" in refused[0].message, refused

    stages = ("cluster=local", f"outputs_dir={outputs}", "stages=[extract,train,eval]")
    original = run_pipeline(tiny_config(*stages), tmp_path / "trained")["stages"]["eval"]
    summary = run_pipeline(tiny_config(*stages, f"train.from_draft={draft}"), tmp_path / "imported")
    assert summary["stages"]["train"]["imported_from"] == str(draft)
    imported = summary["stages"]["eval"]
    for key in ("acc_0", "acc_1", "expected_accept_length", "trained_states_acc_0"):
        assert imported[key] == original[key], key
    assert imported["mismatch"] is False


SPECULATORS = Path(__file__).parent / "data" / "drafts" / "speculators_0.9.0"


def test_speculators_own_exports_are_read_and_imported_with_their_ids_or_each_engines_defaults(fast_cache,
                                                                                                tiny_config,
                                                                                                tmp_path):  # fmt: skip
    """speculators 0.9.0's converter, run on the FAST draft (tests/data/drafts/speculators_0.9.0/SOURCE.md), with
    the ids passed (top-level [2, 5, 7]: vLLM's runners feed the trained [1, 4, 6]; SGLang reads no nested key and
    captures its defaults) and without (null: every engine its defaults). Its weights, renamed from `layers.0.*`,
    load into the project's draft whole, and import as a project draft whose ids every runner reads."""
    from safetensors.torch import load_file

    from orchestrator.draft import export as draft_export

    fast_cache("extract")
    cfg = tiny_config("cluster=local")
    target = Path(make_plan(cfg, tmp_path).target_dir)
    with_ids, no_ids = SPECULATORS / "with_ids", SPECULATORS / "no_ids"
    assert formats.draft_format(with_ids) == formats.draft_format(no_ids) == "speculators"
    assert _fed(read_json(with_ids / "config.json", "c"), 8, "llama") == {
        "sglang 0.5.23": [1, 3, 4],
        "vllm 0.32.0 V1": [1, 4, 6],
        "vllm 0.32.0 MRV2": [1, 4, 6],
    }
    assert list(_fed(read_json(no_ids / "config.json", "c"), 8, "llama").values()) == [[1, 3, 4]] * 3
    model, conf, fmt = formats.read_draft(with_ids, target)
    saved = load_file(str(with_ids / "model.safetensors"))
    assert fmt == "speculators" and conf["hidden_size"] == 128 and model.shape.num_aux_layers == 3
    assert (model.midlayer.mlp.up_proj.weight == saved["layers.0.mlp.up_proj.weight"]).all()
    assert (model.fc.weight == saved["fc.weight"]).all() and (model.d2t == saved["d2t"]).all()

    out = tmp_path / "imported"
    formats.import_draft(with_ids, out, target, [1, 4, 6], [2, 5, 7], "vllm", {"aux_layers": [1, 4, 6]})
    written = read_json(out / "config.json", "c")
    assert written["eagle_aux_hidden_state_layer_ids"] == written["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert draft_export.validate_draft_dir(out, read_json(target / "config.json", "t")) == []
    assert draft_export.provenance(out)["imported"] == {"from": str(with_ids), "format": "speculators"}
    with pytest.raises(Exception, match="takes 3 states"):
        formats.import_draft(with_ids, tmp_path / "two", target, [1, 4], [2, 5], "vllm", {})


def test_train_from_draft_names_the_key_when_no_draft_is_there(tiny_config, tmp_path):
    from orchestrator.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.from_draft=.*: no draft there"):
        tiny_config(f"train.from_draft={tmp_path / 'nothing'}")


class _Probe(torch.nn.Module):
    """A draft whose first step is a least-squares fit, from the target's states at its layers and the next token, to
    the target's next logits: everything it knows comes from those layers, so fed another layer's states it is
    measurably worse. It answers `unroll` as the project's drafts do, for `readings.score`."""

    def __init__(self, weight: torch.Tensor, hidden: int, num_aux: int, vocab: int):
        super().__init__()
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long))  # the draft vocabulary is the target's
        self.fc = torch.nn.Linear(num_aux * hidden, hidden, bias=False)  # its shape tells the count of aux layers
        self.shape = SimpleNamespace(target_hidden_size=hidden)
        self.weight, self.vocab = weight, vocab

    def features(self, aux: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([aux, torch.nn.functional.one_hot(next_ids, self.vocab).to(aux.dtype)], dim=-1)

    def unroll(self, aux, ids, valid, steps):
        logits = self.features(aux[0], ids[0]) @ self.weight
        return SimpleNamespace(tokens=[logits.argmax(-1)[None]], logits=[logits[None]])


def _tiny_random_llama(num_layers: int, hidden: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # large initial weights (0.3): each layer moves the states far from the last one's
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, initializer_range=0.3)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_the_search_names_the_layers_a_constructed_draft_depends_on_and_fails_if_every_reading_got_the_same_states():
    """The positive case the demo's draft cannot give (on the tiny target neighbouring layers' states barely differ):
    a random 8-layer Llama whose layers move the states far, and a probe fitted on 60 sequences to its states at
    [2, 4, 6]. The draft config is read with vLLM's convention (the state entering each layer), [1, 3, 5]; the
    search tries it shifted by one either way, scores 40 other sequences under each, and must name [2, 4, 6] by
    more than 3 standard errors, with [0, 2, 4] and [1, 3, 5] clearly above it. A scorer that fed every reading
    the same states would give them all the same loss_0 and name none."""
    from orchestrator.capture import HiddenStateCapture

    n, hidden, vocab, trained = 8, 32, 48, (2, 4, 6)
    model = _tiny_random_llama(n, hidden, vocab)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, vocab, (24,), generator=generator).tolist() for _ in range(100)]
    features, targets = [], []
    probe = _Probe(torch.zeros(0), hidden, len(trained), vocab)
    with torch.no_grad(), HiddenStateCapture(model, trained) as capture:
        for ids in sequences[:60]:
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            features.append(probe.features(capture.aux()[0][:-1], torch.tensor(ids[1:])))
            targets.append(logits[1:])
            capture.clear()
    x, y = torch.cat(features), torch.cat(targets)
    ridge = 1e-3 * torch.eye(x.shape[1])
    probe.weight = torch.linalg.solve(x.T @ x + ridge, x.T @ y)

    read = readings.Reading("vllm", "0.32.0", "V1", "eagle_config", (2, 4, 6), (1, 3, 5))
    scored = [(ids, [0] * 4 + [1] * (len(ids) - 4)) for ids in sequences[60:]]
    found = readings.find_trained(model, probe, [read], n, scored, torch.device("cpu"))
    losses = {tuple(row["layers"]): row["loss_0"] for row in found["rows"]}
    assert set(losses) == {(0, 2, 4), (1, 3, 5), (2, 4, 6)}, losses
    assert found["found"] == [2, 4, 6], (found["why"], losses)
    print(found["why"], losses)
    assert min(losses[(0, 2, 4)], losses[(1, 3, 5)]) > 1.01 * losses[(2, 4, 6)], losses
