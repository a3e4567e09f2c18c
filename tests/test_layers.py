"""The layer contract: every conversion, with the source of its rule, and the cases that must raise."""

import pytest

from orchestrator import engines
from orchestrator import layers as L

# --- canonical validation -------------------------------------------------------------------------------


def test_canonical_accepts_embedding_and_last_layer():
    assert L.validate_canonical([-1, 2, 30], 61) == (-1, 2, 30)
    assert L.validate_canonical([0, 60], 61) == (0, 60)


@pytest.mark.parametrize(
    "layers, fragment",
    [
        ([-2, 1, 2], "out of range"),
        ([1, 2, 61], "out of range"),
        ([2, 2, 3], "duplicate"),
        ([30, 2, -1], "ascending"),
        ([], "empty"),
    ],
)
def test_canonical_rejects(layers, fragment):
    with pytest.raises(L.LayerContractError, match=fragment):
        L.validate_canonical(layers, 61)


# --- HF transformers ----------------------------------------------------------------------------------------
# Source: transformers LlamaModel/DeepseekV3Model: hidden_states[0] is the embedding output, hidden_states[i]
# the output of layer i-1, and the last entry is taken after the final norm.


def test_hf_hidden_states_index_is_k_plus_one():
    assert [L.hf_hidden_states_index(k, 8) for k in (-1, 0, 3, 6)] == [0, 1, 4, 7]


def test_hf_last_layer_is_not_in_hidden_states():
    with pytest.raises(L.LayerContractError, match="final norm"):
        L.hf_hidden_states_index(7, 8)


def test_hf_capture_points():
    assert [L.hf_capture_point(k, 8) for k in (-1, 0, 7)] == ["embed_tokens", "layers.0", "layers.7"]
    assert L.hf_teacher_capture_point("post_norm", 8) == "norm"
    assert L.hf_teacher_capture_point("pre_norm", 8) == "layers.7"
    with pytest.raises(L.LayerContractError, match="teacher kind"):
        L.hf_teacher_capture_point("logits", 8)


# --- SGLang, Llama family ------------------------------------------------------------------------------------
# Source: sglang 0.5.23 python/sglang/srt/models/llama.py, set_eagle3_layers_to_capture:
#   self.model.layers_to_capture = [val + 1 for val in layer_ids]; capture happens before layer i runs, for i
#   in range(num_layers), so id k captures the output of layer k, -1 the embedding, and N-1 is never captured.


def test_sglang_llama_ids_equal_canonical():
    assert engines.to_engine_ids("sglang", [-1, 3, 6], 8, "llama", "0.5.23") == [-1, 3, 6]
    assert engines.from_engine_ids("sglang", [-1, 3, 6], 8, "llama", "0.5.23") == [-1, 3, 6]


def test_sglang_llama_last_layer_cannot_be_captured():
    with pytest.raises(L.LayerContractError, match="last decoder layer"):
        engines.to_engine_ids("sglang", [1, 4, 7], 8, "llama", "0.5.23")
    # and reading such ids back shows the silent loss
    assert engines.from_engine_ids("sglang", [1, 4, 7], 8, "llama", "0.5.23") == [1, 4]


def test_sglang_concatenates_in_ascending_order():
    # Source: sglang pack_aux_hidden_states concatenates in layer order, not list order.
    assert engines.from_engine_ids("sglang", [6, -1, 3], 8, "llama", "0.5.23") == [-1, 3, 6]


# --- SGLang, DeepSeek-V2/V3 and Kimi family ------------------------------------------------------------------
# Source: sglang 0.5.23 python/sglang/srt/models/deepseek_v2.py (kimi_k25.py delegates to it), after
# sgl-project/sglang PR #25454 (first released in 0.5.13):
#   if layer_ids and layer_ids[0] == 1: layers_to_capture = [val + 1 ...] else: layers_to_capture = list(layer_ids)


def test_kimi_seed_layers_on_0_5_23():
    ids = engines.to_engine_ids("sglang", [-1, 2, 30], 61, "kimi_k25", "0.5.23")
    assert ids == [0, 3, 31]
    assert engines.from_engine_ids("sglang", ids, 61, "kimi_k25", "0.5.23") == [-1, 2, 30]


def test_kimi_seed_layers_written_as_is_capture_only_two_states():
    # docs/kimi_k25.md#layer-ids-for-kimi: [-1, 2, 30] written as-is into a 0.5.23 draft config captures only
    # two states.
    assert engines.from_engine_ids("sglang", [-1, 2, 30], 61, "kimi_k25", "0.5.23") == [1, 29]


def test_deepseek_first_id_one_shifts():
    assert engines.from_engine_ids("sglang", [1, 10, 20], 61, "deepseek_v3", "0.5.23") == [1, 10, 20]
    # Both [1, 10, 20] (shift mode) and [2, 11, 21] (as-is) capture these; the encoder prefers the ids that
    # read the same under the older always-shift rule too.
    assert engines.to_engine_ids("sglang", [1, 10, 20], 61, "deepseek_v3", "0.5.23") == [1, 10, 20]
    assert engines.from_engine_ids("sglang", [2, 11, 21], 61, "deepseek_v3", "0.5.23") == [1, 10, 20]


def test_deepseek_output_of_layer_zero_first_is_not_expressible():
    with pytest.raises(L.LayerContractError, match="layer 0 cannot be the first"):
        engines.to_engine_ids("sglang", [0, 10, 20], 61, "deepseek_v3", "0.5.23")


def test_deepseek_before_pr_25454_always_shifts():
    # Source: sglang 0.5.12.post1 deepseek_v2.py: layers_to_capture = [val + 1 for val in layer_ids].
    assert engines.to_engine_ids("sglang", [-1, 2, 30], 61, "kimi_k25", "0.5.12") == [-1, 2, 30]
    assert engines.to_engine_ids("sglang", [-1, 2, 30], 61, "kimi_k25", "0.5.13") == [0, 3, 31]


def test_sglang_unknown_family_raises():
    with pytest.raises(L.LayerContractError, match="no SGLang layer-id rule"):
        engines.to_engine_ids("sglang", [1, 2, 3], 8, "mamba", "0.5.23")


def test_sglang_bad_version_raises():
    with pytest.raises(L.LayerContractError, match="X.Y.Z"):
        engines.to_engine_ids("sglang", [1, 2, 3], 8, "deepseek_v3", "latest")


# --- vLLM / speculators ---------------------------------------------------------------------------------------
# Source: speculators/vLLM eagle3: id k is the state entering layer k (no shift); k == N is the final
# pre-norm state (docs/engines.md#layer-ids).


def test_vllm_ids_are_entering_layer():
    assert engines.to_engine_ids("vllm", [-1, 2, 30], 61, "llama", "0.32.0") == [0, 3, 31]
    assert engines.to_engine_ids("vllm", [2, 30, 60], 61, "llama", "0.32.0") == [3, 31, 61]
    assert engines.from_engine_ids("vllm", [3, 31, 61], 61, "llama", "0.32.0") == [2, 30, 60]


def test_vllm_rules_are_read_from_its_model_code_per_family_and_version():
    """vLLM 0.32's capture loops (vllm/model_executor/models/llama.py and deepseek_v2.py): Llama records the
    embedding as id 0, DeepSeek/Kimi fails there; both record the final state as id N; an unread version has no
    rule."""
    assert engines.to_engine_ids("vllm", [-1, 3, 7], 8, "llama", "0.32.0") == [0, 4, 8]
    assert engines.to_engine_ids("vllm", [0, 3, 7], 8, "deepseek_v3", "0.32.1") == [1, 4, 8]
    with pytest.raises(L.LayerContractError, match="no embedding output for this family"):
        engines.to_engine_ids("vllm", [-1, 3, 7], 8, "kimi_k25", "0.32.0")
    assert engines.from_engine_ids("vllm", [0, 4], 8, "deepseek_v3", "0.32.0") == [3]
    with pytest.raises(L.LayerContractError, match="no vLLM layer-id rule recorded for version '0.31.0'"):
        engines.to_engine_ids("vllm", [1, 4, 6], 8, "llama", "0.31.0")
    # the demo's one-layer shift: SGLang's ids for [1, 4, 6] make vLLM capture the layers below
    assert engines.from_engine_ids(
        "vllm", engines.to_engine_ids("sglang", [1, 4, 6], 8, "llama", "0.5.23"), 8, "llama", "0.32.0"
    ) == [0, 3, 5]


def test_unknown_engine_raises():
    with pytest.raises(L.LayerContractError, match="unknown engine"):
        engines.to_engine_ids("tgi", [1, 2, 3], 8, "llama", "1.0")


def test_the_kimi_triples_table_in_the_docs_is_the_contracts():
    """docs/kimi_k25.md's table of Kimi triples gives, per engine, the ids `orchestrator/layers.py` writes."""
    import json
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "kimi_k25.md").read_text()
    rows = re.findall(r"^\| `(\[[-\d, ]+\])` \| [^|]+ \| (`\[[-\d, ]+\]`|-) \| (`\[[-\d, ]+\]`|-) \|$", doc, re.M)
    assert len(rows) == 3, rows
    for triple, sglang_ids, vllm_ids in rows:
        for engine, written in (("sglang", sglang_ids), ("vllm", vllm_ids)):
            try:
                version = "0.5.23" if engine == "sglang" else "0.32.0"
                ids = engines.to_engine_ids(engine, json.loads(triple), 61, "kimi_k25", version)
            except L.LayerContractError:
                ids = None
            assert (None if written == "-" else json.loads(written.strip("`"))) == ids, (triple, engine)


def test_vllm_captures_the_seeds_kimi_layers_and_the_embedding_output_is_computed_from_the_table(tmp_path, monkeypatch):
    """kimi_eagle3's [-1, 2, 30] through vLLM: its DeepSeek loop has no id for the embedding output, so it captures
    layers 2 and 30 and the teacher's source (ids 3, 31, 61), and the assembler puts the checkpoint's embedding rows
    at the sequence's tokens first, as stored. vLLM's Llama loop captures the embedding itself (id 0). A family
    whose embedding output is not a plain look-up is refused for -1, naming why."""
    import dataclasses
    import sys

    import torch
    from conftest import compose_config

    from orchestrator import families
    from orchestrator.data import Rendered
    from orchestrator.engines.vllm.ids import capture_ids, engine_layers
    from orchestrator.states.assemble import Assembler

    kimi = compose_config(tmp_path, f"extract.python={sys.executable}", experiment="kimi_eagle3", fast=False)
    assert engine_layers(kimi, [-1, 2, 30]) == ([2, 30], True)
    assert capture_ids(kimi, [-1, 2, 30]) == [3, 31, 61]
    assert engine_layers(kimi, [1, 29, 57]) == ([1, 29, 57], False)
    llama = compose_config(tmp_path, "extract.engine=vllm", f"extract.python={sys.executable}",
                           "data.regenerate.enabled=false")  # fmt: skip
    assert engine_layers(llama, [-1, 1, 4]) == ([-1, 1, 4], False) and capture_ids(llama, [-1, 1, 4]) == [0, 2, 5, 8]

    table = torch.randn(10, 4).to(torch.bfloat16)
    captured, teacher = torch.randn(3, 2, 4), torch.randn(3, 4)
    states = Assembler("float32", embed=table).sequence(Rendered([7, 1, 3], [0, 1, 1]), captured, teacher)
    assert torch.equal(states.aux[:, :4], table[[7, 1, 3]].float())
    assert torch.equal(states.aux[:, 4:], captured.flatten(1)) and torch.equal(states.teacher, teacher)

    scaled = dataclasses.replace(families.FAMILIES["kimi_k25"], embedding_lookup=False)
    monkeypatch.setitem(families.FAMILIES, "kimi_k25", scaled)
    with pytest.raises(L.LayerContractError, match="embedding output is not its table's rows as stored"):
        engine_layers(kimi, [-1, 2, 30])
