"""Typed stage results (orchestrator/results.py): a stored result reads back into its dataclass and is written again
as the same JSON, key for key and in the same order; tracking, the summary and the search read the fields.

The stored results under tests/data/results/ are manifests' "result" objects written by the stages of this code
(extract, train, eval measured and unmeasured, an imported draft, serve on the reference engine) and one serve result
of earlier code on vLLM, whose keys came in another order.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from orchestrator import results, search, tracking
from orchestrator.results import EvalResult, ExtractResult, ServeResult, TrainResult

STORED = Path(__file__).parent / "data" / "results"
CASES = {
    "extract": "extract",
    "train": "train",
    "train_imported": "train",
    "eval": "eval",
    "eval_unmeasured": "eval",
    "serve": "serve",
    "serve_vllm_earlier_order": "serve",
}


def _stored(name: str) -> dict:
    return json.loads((STORED / f"{name}.json").read_text())


@pytest.mark.parametrize("name", CASES)
def test_a_stored_result_is_written_back_as_it_was(name):
    stored = _stored(name)
    typed = results.load(CASES[name], stored)
    assert type(typed) is results.RESULTS[CASES[name]]
    assert typed.extra == {}, f"every key of a {CASES[name]} result has a field: {typed.extra}"
    assert json.dumps(typed.to_dict()) == json.dumps(stored), "the same keys, values and order"


@pytest.mark.parametrize("name", [n for n in CASES if n != "serve_vllm_earlier_order"])
def test_a_result_built_from_its_fields_is_what_the_stage_writes(name):
    """Built field by field (as a stage builds it, no stored key order to follow), a result writes the keys the
    stage writes, in the stage's order."""
    stored = _stored(name)
    typed = results.load(CASES[name], stored)
    rebuilt = type(typed)(**{f.name: getattr(typed, f.name) for f in dataclasses.fields(typed) if f.init})
    assert json.dumps(rebuilt.to_dict()) == json.dumps(stored)


def test_fields_are_read_by_name_and_position():
    ev = results.load("eval", _stored("eval"))
    stored = _stored("eval")
    assert ev.acc == [stored[f"acc_{k}"] for k in range(3)] and ev.positions == [950, 950, 950]
    assert ev.expected_accept_length == stored["expected_accept_length"] and ev.mismatch is False
    assert ev.headline == ev.make_headline() == stored["headline"]
    train = results.load("train", _stored("train"))
    assert train.val_acc == [_stored("train")[f"val_acc_{k}"] for k in range(len(train.val_acc))]
    assert train.headline == train.make_headline() and train.compute["device"] == "cpu"
    serve = results.load("serve", _stored("serve"))
    assert serve.phase_ms["speculative_verify_ms"] == _stored("serve")["speculative_verify_ms"]
    assert serve.headline == serve.make_headline() and serve.server_seconds == _stored("serve")["server_seconds"]
    vllm = results.load("serve", _stored("serve_vllm_earlier_order"))
    assert vllm.load_check["model_class"] == "Eagle3LlamaForCausalLM" and "spec_itl_mean_s" in vllm.engine_latency
    extract = results.load("extract", _stored("extract"))
    assert extract.headline == extract.make_headline() and extract.tokens == _stored("extract")["tokens"]
    unmeasured = results.load("eval", _stored("eval_unmeasured"))
    assert unmeasured.acc == [] and unmeasured.expected_accept_length is None and unmeasured.mismatch is True


def test_cached_and_unknown_keys_survive_a_summary():
    """pipeline.finish marks a cached stage by attribute: summary.json gets "cached": true after the stored keys,
    as before; a key no field names (earlier or later code) stays where it was; no manifest is an empty result."""
    stored = {"tokens": 5, "someday": {"a": 1}, "tokens_per_s": 2.0}
    typed = results.load("extract", stored)
    assert typed.extra == {"someday": {"a": 1}} and typed.tokens == 5
    typed.cached = True
    assert list(typed.to_dict().items()) == [*stored.items(), ("cached", True)]
    assert results.load("serve", {}).to_dict() == {}
    assert results.load("train", {"val_acc_0": 0.5, "cached": True}).cached is True
    with pytest.raises(ValueError, match="no result type"):
        results.load("nope", {})


def test_none_valued_keys_are_written_back():
    """A stored None (serve's accept length when the target ended every answer at once; eval's expected accept
    length that serve compares with, from an eval that measured nothing) is written back, not dropped."""
    stored = {"baseline_tok_s": 10.0, "accept_length": None, "eval_expected_accept_length": None, "mismatch": False}
    assert results.load("serve", stored).to_dict() == stored


def test_tracking_reads_a_typed_eval_result():
    """The metrics of a typed result are those of its stored dict (tests/test_mlflow_ui.py's known input)."""
    typed = EvalResult(
        acc=[0.9, 0.8],
        full_acc=[0.9, 0.7],
        trained_states_acc=[0.91],
        acc_gap=[0.01],
        acc_gap_se=[0.02],
        positions=[400],
        draft_steps=3,
        sequences=8,
        expected_accept_length=2.7,
        mean_accepted_per_cycle=1.66,
        verify_passes=40,
        served_states_rel_diff=0.0004,
        mismatch=False,
    )
    expected = {
        "eval/acc_0": 0.9,
        "eval/acc_1": 0.8,
        "eval/trained_states_acc_0": 0.91,
        "eval/acc_gap_0": 0.01,
        "eval/acc_gap_se_0": 0.02,
        "eval/expected_accept_length": 2.7,
        "eval/sequences": 8.0,
        "eval/verify_passes": 40.0,
        "eval/served_states_rel_diff": 0.0004,
        "eval/mismatch": 0.0,
    }
    assert tracking.stage_metrics("eval", typed) == expected
    assert tracking.stage_metrics("eval", typed.to_dict()) == expected


@pytest.mark.parametrize("name", ["extract", "eval", "eval_unmeasured", "serve", "serve_vllm_earlier_order"])
def test_typed_and_stored_results_log_the_same_metrics(name):
    stored = _stored(name)
    typed = results.load(CASES[name], stored)
    metrics = tracking.stage_metrics(CASES[name], typed)
    assert metrics == tracking.stage_metrics(CASES[name], stored) and metrics
    if name.startswith("serve"):
        assert metrics["serve/speedup"] == stored["speedup"]
        assert metrics["serve/greedy_outputs_identical"] == float(stored["greedy_outputs_identical"])
        assert [k for k in metrics if k.startswith("serve/accept_rate_")] == [
            f"serve/accept_rate_{i}" for i in range(len(stored["accept_rate_by_position"]))
        ]
    if name == "serve":
        assert metrics["serve/speculative_verify_ms"] == stored["speculative_verify_ms"]
    if name == "extract":
        assert metrics == {f"extract/{k}": float(stored[k]) for k in (
            "tokens", "tokens_per_s", "bytes_per_token", "regenerate_s", "loss_tokens_per_sequence"
        )}  # fmt: skip


def test_note_and_objective_read_the_fields():
    serve = _stored("serve")
    summary = {
        "aux_layers": [1, 4, 6],
        "mismatch_flags": [],
        "stages": {"train": _stored("train") | {"cached": True}, "eval": _stored("eval"), "serve": serve},
    }
    note = tracking.run_note(summary)
    assert f"**{serve['speedup']:.2f}x**" in note and "| cached stages | train |" in note
    assert "(own tokens; eval, exported draft on the live target)" in note
    typed = {s: results.load(s, r) for s, r in summary["stages"].items()}
    assert tracking.run_note(summary | {"stages": typed}) == note

    class Cfg:
        stages = ["extract", "train", "eval", "serve"]

    assert search.objective(Cfg(), summary) == serve["speedup"]
    Cfg.stages = ["extract", "train", "eval"]
    assert search.objective(Cfg(), summary) == _stored("eval")["expected_accept_length"]
    unmeasured = summary | {"stages": {"eval": _stored("eval_unmeasured")}}
    with pytest.raises(KeyError, match="eval measured no expected_accept_length"):
        search.objective(Cfg(), unmeasured)


def test_stages_build_their_results_typed():
    """What each stage builds: a trained draft's result from its final validation, an imported one's, extraction's
    figures, and their headlines as the stages have always written them."""
    final = {"step": 16, "loss": 13.2, "acc_0": 0.9, "full_acc_0": 0.9, "acc_1": 0.8, "full_acc_1": 0.7}
    trained = TrainResult.from_validation(final | {"expected_accept_length": 2.6}, draft_dir="d", compute={"x": 1})
    trained.headline = trained.make_headline()
    assert trained.to_dict() == {
        "draft_dir": "d",
        "val_step": 16,
        "val_loss": 13.2,
        "val_acc_0": 0.9,
        "val_full_acc_0": 0.9,
        "val_acc_1": 0.8,
        "val_full_acc_1": 0.7,
        "val_expected_accept_length": 2.6,
        "headline": {"acc_0": 0.9, "acc_1": 0.8, "expected_accept_length": 2.6},
        "compute": {"x": 1},
    }
    assert TrainResult(draft_dir="d", eagle_aux_hidden_state_layer_ids=[2], imported_from="f").to_dict() == {
        "draft_dir": "d",
        "eagle_aux_hidden_state_layer_ids": [2],
        "imported_from": "f",
    }
    extract = ExtractResult(tokens=3, tokens_per_s=1.5, bytes_per_token=8.0)
    assert extract.make_headline() == {"tokens": 3, "tokens_per_s": 1.5, "bytes_per_token": 8.0}
    assert ServeResult(baseline_from="elsewhere").make_headline()["baseline_from"] == "elsewhere"
