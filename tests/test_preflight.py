"""The mismatch guard: each category of train/serve inconsistency, planted in an otherwise valid tiny setup,
is caught (before any job where it needs no artifact) with a message naming the fix. Values no run can use
(a layer the engine cannot capture, a wrong speculative-argument set, an unknown teacher kind) fail in config
validation, tested in test_config.py."""

from __future__ import annotations

import json

import pytest
import torch

from orchestrator import preflight
from orchestrator.draft import export as E
from orchestrator.draft.model import DraftShape, Eagle3Draft
from orchestrator.pipeline import make_plan, run_pipeline

SHAPE = DraftShape(
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
TARGET_CONFIG = {
    "hidden_size": 32,
    "vocab_size": 50,
    "max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "num_hidden_layers": 8,
}


def failing(findings, category):
    return [f for f in findings if f.category == category and not f.ok]


# ------------------------------------------------------------------------------ config: caught before any job


def test_serve_layers_differing_from_trained_is_refused_before_any_job(tiny_config, tmp_path):
    cfg = tiny_config("serve.layers=[0,3,6]")
    [finding] = failing(preflight.config_findings(cfg), "layer ids")
    assert "serve.layers=[0, 3, 6]" in finding.message and "aux_layers=[1, 4, 6]" in finding.message
    assert "drop the serve.layers override" in finding.fix
    with pytest.raises(preflight.PreflightError, match="Fix: drop the serve.layers override"):
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "jobs").exists() and not (tmp_path / "run" / "plan.json").exists()


def test_hidden_size_mismatch(tiny_config):
    [finding] = failing(preflight.config_findings(tiny_config("draft.hidden_size=64")), "hidden sizes")
    assert "set draft.hidden_size to the target's" in finding.fix


def test_wrong_speculative_algorithm_in_extra_args(tiny_config):
    [finding] = failing(
        preflight.config_findings(tiny_config("serve.extra_args=[--speculative-algorithm,EAGLE]")), "speculative args"
    )
    assert "always EAGLE3" in finding.fix


def test_draft_steps_beyond_trained_depth(tiny_config):
    [finding] = failing(
        preflight.config_findings(tiny_config("serve.num_steps=5", "serve.num_draft_tokens=6")), "draft steps"
    )
    assert "raise train.ttt_steps" in finding.fix


def test_valid_tiny_config_passes(tiny_config):
    assert preflight.failures(preflight.config_findings(tiny_config())) == []


# ------------------------------------------------------------------------------------- artifacts


@pytest.fixture
def setup(tiny_config, tmp_path):
    """A valid tiny run's artifacts: target folder, extraction manifest, exported draft directory."""
    cfg = tiny_config()
    plan = make_plan(cfg, tmp_path / "run")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    (target / "tokenizer.json").write_text('{"model": "bpe-v1"}')
    from orchestrator.targets import tokenizer_hash

    tok = tokenizer_hash(target)
    extract = tmp_path / "extract"
    extract.mkdir()
    (extract / "manifest.json").write_text(
        json.dumps(
            {
                "stage": "extract",
                "aux_layers": [1, 4, 6],
                "teacher": {"kind": "post_norm"},
                "hidden_size": cfg.target.hidden_size,
                "tokenizer_hash": tok,
            }
        )
    )
    torch.manual_seed(0)
    draft = Eagle3Draft(SHAPE)
    draft.set_vocab_map(*E.build_vocab_map(torch.arange(50), 20))
    draft_dir = tmp_path / "draft"
    conf = E.draft_config(SHAPE, [1, 4, 6], "bfloat16", TARGET_CONFIG, 64)
    E.export(
        draft, draft_dir, conf, {"aux_layers": [1, 4, 6], "trained_ttt_steps": 4, "tokenizer_hash": tok}, TARGET_CONFIG
    )
    return cfg, plan, target, extract, draft_dir


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_valid_artifacts_pass(setup):
    cfg, _, target, extract, draft = setup
    findings = preflight.extraction_findings(cfg, extract, target) + preflight.draft_findings(cfg, draft, target)
    assert preflight.failures(findings) == []


def test_off_by_one_ids_in_draft_config(setup):
    cfg, _, target, _, draft = setup
    edit_json(
        draft / "config.json",
        eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 5, 7], "use_aux_hidden_state": True},
    )
    [finding] = failing(preflight.draft_findings(cfg, draft, target), "layer ids")
    assert "captures only 2 states" in finding.message and "[1, 4, 6]" in finding.message
    assert "set it to [1, 4, 6]" in finding.fix


def test_kimi_embedding_written_as_is(tiny_config, setup):
    _, _, target, _, draft = setup
    cfg = tiny_config("aux_layers=[-1,2,4]", experiment="tiny_deepseek_eagle3")
    edit_json(draft / "orchestrator.json", aux_layers=[-1, 2, 4])
    edit_json(
        draft / "config.json",
        eagle_config={"eagle_aux_hidden_state_layer_ids": [-1, 2, 4], "use_aux_hidden_state": True},
    )
    [finding] = failing(preflight.draft_findings(cfg, draft, target), "layer ids")
    assert "captures only 2 states" in finding.message and "set it to [0, 3, 5]" in finding.fix


def test_teacher_kind_mismatch(setup):
    cfg, _, target, extract, _ = setup
    edit_json(extract / "manifest.json", teacher={"kind": "pre_norm"})
    [finding] = failing(preflight.extraction_findings(cfg, extract, target), "teacher kind")
    assert "pre_norm" in finding.message and "re-extract" in finding.fix


def test_tokenizer_changed_since_extraction_and_training(setup):
    cfg, _, target, extract, draft = setup
    (target / "tokenizer.json").write_text('{"model": "bpe-v2"}')
    assert "re-extract" in failing(preflight.extraction_findings(cfg, extract, target), "tokenizer")[0].fix
    assert (
        "serve the target the draft was trained for"
        in failing(preflight.draft_findings(cfg, draft, target), "tokenizer")[0].fix
    )


def test_d2t_holding_target_ids_instead_of_offsets(setup):
    from safetensors.torch import load_file, save_file

    cfg, _, target, _, draft = setup
    weights = load_file(str(draft / "model.safetensors"))
    weights["d2t"] = weights["d2t"] + torch.arange(20)
    save_file(weights, str(draft / "model.safetensors"))
    [finding] = failing(preflight.draft_findings(cfg, draft, target), "draft vocabulary")
    assert "offsets" in finding.message and "re-export" in finding.fix


def test_missing_d2t(setup):
    from safetensors.torch import load_file, save_file

    cfg, _, target, _, draft = setup
    weights = load_file(str(draft / "model.safetensors"))
    del weights["d2t"]
    save_file(weights, str(draft / "model.safetensors"))
    assert failing(preflight.draft_findings(cfg, draft, target), "draft vocabulary")


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("architectures", ["LlamaForCausalLM"], "architectures"),
        ("draft_vocab_size", None, "draft_vocab_size"),
        ("torch_dtype", None, "torch_dtype"),
        ("max_position_embeddings", 32, "max_position_embeddings"),
        ("rope_theta", 500000.0, "rope_theta"),
    ],
)
def test_draft_config_fields(setup, field, value, fragment):
    cfg, _, target, _, draft = setup
    edit_json(draft / "config.json", **{field: value})
    findings = failing(preflight.draft_findings(cfg, draft, target), "draft config")
    assert any(fragment in f.message for f in findings) and all("re-export" in f.fix for f in findings)


def test_target_hidden_size_mismatch_in_draft(setup):
    cfg, _, target, _, draft = setup
    edit_json(target / "config.json", hidden_size=64)
    assert failing(preflight.draft_findings(cfg, draft, target), "hidden sizes")


def test_serving_more_steps_than_trained(tiny_config, setup):
    _, _, target, _, draft = setup
    cfg = tiny_config("serve.num_steps=5", "serve.num_draft_tokens=6", "train.ttt_steps=7")
    [finding] = failing(preflight.draft_findings(cfg, draft, target), "draft steps")
    assert "lower serve.num_steps" in finding.fix


def test_check_entry_reports_on_a_draft_directory(tiny_config, setup, tmp_path):
    _, _, _, _, draft = setup
    edit_json(
        draft / "config.json",
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6], "use_aux_hidden_state": True},
    )
    cfg = tiny_config("check=true", f"check_draft={draft}")
    result = run_pipeline(cfg, tmp_path / "check")
    assert result["check"] is True and result["ok"] is False
    assert any("layer ids" in f for f in result["failures"])


def test_dry_run_refuses_a_target_that_cannot_fit_a_tasks_gpus(tiny_config, tmp_path, capsys):
    """The weights' size, read from their safetensors headers, against the GPUs each task gets: refused before any
    job with the numbers and the tasks_per_node that would fit."""
    from orchestrator.targets import ensure_target, weight_bytes

    cfg = tiny_config()
    target = ensure_target(cfg, progress=False)
    need = weight_bytes(target, "bfloat16")
    assert need == weight_bytes(target, "float32") // 2  # the tiny target's weights are all floating point
    gpu_gb = need * 0.6 / 1e9  # one GPU holds 60% of the weights: two per task fit, one does not
    tight = tiny_config("dry_run=true", "extract.resources.gpus_per_node=2", f"cluster.gpu_memory_gb={gpu_gb}")
    with pytest.raises(preflight.PreflightError) as refused:
        run_pipeline(tight, tmp_path / "tight")
    message = str(refused.value)
    assert f"target weights {need / 1e9:,.1f} GB in bfloat16" in message
    assert "extract.resources.tasks_per_node=1" in message  # the fix: both GPUs for one task
    assert not (tmp_path / "tight" / "plan.json").exists()
    spread = tiny_config(
        "dry_run=true",
        "extract.resources.gpus_per_node=2",
        "extract.resources.tasks_per_node=1",
        f"cluster.gpu_memory_gb={gpu_gb}",
    )
    assert run_pipeline(spread, tmp_path / "spread")["dry_run"]
    assert "[memory] extract: target weights" in capsys.readouterr().out


def test_dry_run_refuses_a_quantized_target_for_the_hf_capture(tiny_config, tmp_path):
    """A checkpoint whose config.json declares quantization (Kimi-K2.5's compressed-tensors INT4 experts, here
    planted in a copy of the tiny target's config) cannot be captured by HF transformers: refused before any job,
    naming what to do, whatever its weights' byte count."""
    from conftest import quantized_tiny_target

    quantized = quantized_tiny_target(tiny_config, tmp_path / "quantized")
    cfg = tiny_config("dry_run=true", f"target.path={quantized}")
    with pytest.raises(
        preflight.PreflightError, match=r"extract: the target at .* is quantized \(compressed-tensors\)"
    ):
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "plan.json").exists()


def test_slurm_gpu_stages_need_the_clusters_gpu_memory(tiny_config, tmp_path):
    cfg = tiny_config("dry_run=true", "cluster=slurm", "extract.resources.gpus_per_node=1")
    with pytest.raises(preflight.PreflightError, match=r"set cluster\.gpu_memory_gb"):
        run_pipeline(cfg, tmp_path / "run")
    ok = tiny_config("dry_run=true", "cluster=slurm", "extract.resources.gpus_per_node=1", "cluster.gpu_memory_gb=141")
    assert run_pipeline(ok, tmp_path / "ok")["dry_run"]


def test_the_targets_remote_code_imports_are_checked_by_the_dry_run(tiny_config, tmp_path):
    """Kimi-K2.5's tokenizer is remote code importing tiktoken (the `kimi` extra): the dry run checks each package
    in target.remote_code_imports imports, and names the install when one does not."""
    findings = preflight.config_findings(tiny_config("target.remote_code_imports=[tiktoken]"))
    assert [f.ok for f in findings if "target.remote_code_imports" in f.message] == [True]
    cfg = tiny_config("dry_run=true", "target.remote_code_imports=[no_such_package_xyz]")
    with pytest.raises(preflight.PreflightError, match=r"no_such_package_xyz is not installed.*\.\[kimi\]"):
        run_pipeline(cfg, tmp_path / "run")
