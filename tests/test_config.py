"""Config: every experiment composes and validates; bad input fails at compose time, naming the key."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import user_overrides
from hydra import compose, initialize_config_dir

from orchestrator import conf_dir
from orchestrator.config import ConfigError, RootConfig, load
from orchestrator.pipeline import make_plan

EXPERIMENTS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


def compose_root(overrides: list[str]) -> RootConfig:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return load(compose("config", overrides=user_overrides(overrides)))


def test_there_are_experiments():
    assert {"tiny_eagle3", "tiny_deepseek_eagle3", "kimi_eagle3"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment, tmp_path):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        raw = compose("config", overrides=user_overrides([f"+experiment={experiment}"]))
    space = None
    if "search" in raw:  # a layer search: its space is validated as the search command does, before any job
        from orchestrator import search

        search_cfg, experiment_tree = search.split(raw)
        cfg = load(experiment_tree)
        space = search.build_space(search_cfg, cfg)
        assert tuple(cfg.aux_layers) in space.points  # the experiment's own layers are the study's baseline
    else:
        cfg = load(raw)
    assert isinstance(cfg, RootConfig)
    for stage in ("extract", "train", "eval", "serve"):
        assert getattr(cfg, stage).layers == cfg.aux_layers  # one node, interpolated everywhere
    plan = make_plan(cfg, tmp_path / "run")
    assert [s["stage"] for s in plan.stages] == (
        ["extract", "train", "eval"] if space else ["extract", "train", "eval", "serve"]
    )


def test_stage_configs_do_not_repeat_the_layer_list():
    for path in (conf_dir()).rglob("*.yaml"):
        if path.parent.name == "experiment" or path.name == "config.yaml":
            continue
        for line in path.read_text().splitlines():
            if line.strip().startswith(("layers:", "aux_layers:")):
                assert line.strip() == "layers: ${aux_layers}", f"{path}: {line!r} must read layers: ${{aux_layers}}"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("aux_layers=[1,4,99]", "out of range for a target with 8 decoder layers"),
        ("aux_layers=[1,1,4]", "duplicate"),
        ("aux_layers=[1,4]", "draft.num_aux_layers=3"),
        ("aux_layers=[6,4,1]", "ascending"),
        ("aux_layers=[1,4,7]", "last decoder layer"),
        ("train.lr=fast", "train.lr"),
        ("+train.learning_rate=1", "learning_rate"),
        (
            "serve.num_draft_tokens=8",
            "serve.num_draft_tokens=8: with serve.eagle_topk=1 SGLang silently replaces it by serve.num_steps+1=4",
        ),
        ("serve.num_steps=0", "serve.num_steps=0: expected >= 1"),
        ("serve.eagle_topk=0", "serve.eagle_topk=0: expected >= 1"),
        ("serve.eagle_topk=4", "serve.eagle_topk=4: the reference engine drafts a chain"),
        ("serve.engine=tgi", "serve.engine"),
        ("stages=[train]", "prefix"),
        ("extract.teacher=logits", "extract.teacher='logits': expected one of"),
        ("serve.repeats=0", "serve.repeats"),
        ("serve.startup_estimate_min=-8", "serve.startup_estimate_min=-8.0: expected minutes > 0"),
        ("serve.concurrency=[]", "serve.concurrency"),
        ("data.regenerate.temperature=-1", "data.regenerate.temperature"),
        ("data.regenerate.max_new_tokens=0", "data.regenerate.max_new_tokens"),
    ],
)
def test_bad_config_names_the_key(override, fragment):
    # the reference engine's rules (SGLang's ids): vLLM captures the last layer and refuses a tree in its own words
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        compose_root(["+experiment=tiny_eagle3", "serve=reference", override])


def test_vllm_refuses_a_tree_naming_the_key():
    with pytest.raises(
        ConfigError,
        match=r"serve\.eagle_topk=4: serve\.engine=vllm \(vllm 0\.32\.0\) drafts a chain .* has no token tree",
    ):
        compose_root(["+experiment=tiny_eagle3", "serve=vllm", "serve.eagle_topk=4", "serve.num_draft_tokens=8"])


def test_tree_drafting_needs_two_draft_tokens():
    with pytest.raises(ConfigError, match=r"serve\.num_draft_tokens=1: expected >= 2"):
        compose_root(["+experiment=kimi_eagle3", "serve.eagle_topk=4", "serve.num_draft_tokens=1"])


@pytest.mark.parametrize(
    "key", ["serve.guard", "extract.resources", "cluster.setup", "target.tiny", "data.regenerate.batch_size"]
)
def test_a_key_missing_from_the_yaml_fails_naming_it(key):
    # The schema holds no defaults: a key no YAML file sets is an error, not a silent value.
    with pytest.raises(ConfigError, match=re.escape(f"config key '{key}' has no value")):
        compose_root(["+experiment=tiny_eagle3", f"~{key}"])


@pytest.mark.parametrize(
    "option",
    [*(f"cluster={p.stem}" for p in sorted((conf_dir() / "cluster").glob("*.yaml")) if p.stem != "default"),
     "serve=sglang"],
)  # fmt: skip
def test_group_options_no_experiment_selects_set_every_key(option):
    assert isinstance(compose_root(["+experiment=tiny_eagle3", option]), RootConfig)


@pytest.mark.parametrize("group, key", [("cluster", "kind"), ("serve", "engine"), ("target", "name"), ("data", "name")])
def test_a_groups_base_alone_names_what_its_options_set(group, key):
    """Each group's default.yaml gives every key but the ones its options choose: selected alone, it is refused
    naming the first of them."""
    with pytest.raises(ConfigError, match=re.escape(f"config key '{group}.{key}' has no value")):
        compose_root(["+experiment=tiny_eagle3", f"{group}=default"])


def test_kimi_plan_ids_capture_the_seed_layers(tmp_path):
    """The seed's [-1, 2, 30]: SGLang serves them as ids [0, 3, 31]; vLLM captures layers 2 and 30 and the teacher's
    source (ids 3, 31, 61), and the embedding output is computed from the checkpoint's table, which the plan says."""
    cfg = compose_root(["+experiment=kimi_eagle3"])
    plan = make_plan(cfg, tmp_path / "run")
    by_stage = {s["stage"]: s for s in plan.stages}
    serve = by_stage["serve"]["layer_ids"]
    assert serve["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 31]
    assert serve["captures_canonical"] == [-1, 2, 30]
    extract = by_stage["extract"]["layer_ids"]
    assert extract["eagle_aux_hidden_state_layer_ids"] == [3, 31, 61], extract
    assert extract["embedding"].startswith("layer -1 computed from the checkpoint's embed_tokens.weight"), extract
    assert by_stage["serve"]["resources"]["gpus_per_node"] == 8


def _cli(args: list[str], outputs: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "EAGLE_ORCH_OUTPUTS": str(outputs)}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *user_overrides(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.vllm
def test_cli_dry_run_kimi_needs_only_the_checkpoints_small_files(tmp_path, vllm_python):
    """The headline command's dry run on Kimi-K2.5's checkpoint as shipped (INT4 experts; every tensor's header,
    no data): every check passes, every stage's memory among them (595.1 GB of weights over 8 H200s a node)."""
    from conftest import kimi_here

    outputs = tmp_path / "outputs"
    proc = _cli(["+experiment=kimi_eagle3", "dry_run=true", *kimi_here(tmp_path, vllm_python)], outputs)
    assert proc.returncode == 0, proc.stderr
    assert "extract: target weights 595.1 GB in bfloat16 (compressed-tensors tensors as stored, in vllm" in proc.stdout
    plans = list(outputs.rglob("plan.json"))
    assert len(plans) == 1
    plan = json.loads(plans[0].read_text())
    serve = [s for s in plan["stages"] if s["stage"] == "serve"][0]
    assert serve["layer_ids"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 31]
    assert "eagle_aux_hidden_state_layer_ids" in proc.stdout
    # each environment a job runs, what it holds, and the checkpoint's tokenizer code loaded in each
    assert "sglang 0.5.23, as pinned, for the serve and extract stages run" in proc.stdout, proc.stdout
    assert "[engine environment] extract.python=" in proc.stdout and "vllm 0.32.0, as pinned, for the extract and " \
        "eval stages run" in proc.stdout  # fmt: skip
    assert proc.stdout.count("[tokenizer] ") >= 3 and "TikTokenTokenizer loads in extract.python=" in proc.stdout
    # its checkpoint's generation_config.json names no sampling: the family's documented thinking-mode settings
    assert "[regenerate] the target's answers are decoded temperature 1.0, top_p 0.95: Moonshot's settings" in (
        proc.stdout
    )
    assert not list(outputs.rglob("jobs")), "a dry run submits nothing"
    assert not (outputs / "mlflow.db").exists(), "a dry run starts no MLflow run"


def test_cli_out_of_range_fails_before_any_job(tmp_path):
    proc = _cli(["+experiment=tiny_eagle3", "aux_layers=[1,4,99]"], tmp_path)
    assert proc.returncode == 2
    assert "aux_layers" in proc.stderr and "99" in proc.stderr and "-1 (embedding output) .. 7" in proc.stderr
    assert not list(tmp_path.rglob("jobs")) and not list(tmp_path.rglob("plan.json"))


@pytest.mark.vllm
def test_dry_run_prints_the_extraction_storage_and_an_over_budget_plan_is_refused(tmp_path, vllm_python):
    from conftest import kimi_here

    here, outputs = kimi_here(tmp_path, vllm_python), tmp_path / "outputs"
    # on a 24-hour partition (one dry run for both parts: each vLLM parser check costs seconds)
    proc = _cli(["+experiment=kimi_eagle3", "dry_run=true", "cluster.max_time_min=1440", *here], outputs)
    assert proc.returncode == 0, proc.stderr
    # the recipes' scale, states streamed: the val split's 1,000 conversations x 1.1 answered turns (the sample
    # file's mean) x 8192 tokens, each token 4 states (3 aux + teacher) x 7168 x 2 bytes + id and mask; and the
    # train split's 660,000 sequences' token ids (600,000 conversations x 1.1), 5 bytes a token
    stored, ids = 1100 * 8192, 660_000 * 8192
    total = stored * 57_349 + ids * 5
    assert (
        f"extract writes at most {total / 1e9:,.1f} GB: {stored:,} tokens x 57,349 bytes/token + {ids:,} streamed "
        "tokens' ids x 5 bytes (4 states)" in proc.stdout
    ), proc.stdout
    plan = json.loads(next(outputs.rglob("plan.json")).read_text())
    assert plan["stages"][0]["storage"]["max_bytes"] == total
    # on a 24-hour partition the plan prints every job's limit against it, the training and its capture service
    # as allocations, and the training's hours and GPU-hours at the published rates
    day = proc
    assert "[time limits] train asks 3840 min, 512 GPU-hours at most; the partition allows 1440" in day.stdout
    assert "[time limits] the capture service asks 4080 min" in day.stdout, day.stdout[-3000:]
    assert "[train time] 82,500 steps, 660,000 samples, at most 5.41 B tokens" in day.stdout, day.stdout[-3000:]
    assert "[train time] 3 allocations of at most 1440 min" in day.stdout

    refused = _cli(["+experiment=kimi_eagle3", "dry_run=true", "extract.max_bytes=1e10", *here], outputs / "refused")
    assert refused.returncode != 0
    assert (
        f"[storage] extraction writes at most {total / 1e9:,.1f} GB ({stored:,} tokens x 57,349 bytes/token + "
        f"{ids:,} streamed tokens' ids x 5 bytes; of {stored + ids:,} tokens"
        in refused.stderr
        and "extract.max_bytes=10.0 GB" in refused.stderr
    )
    assert not list((outputs / "refused").rglob("plan.json")), "refused before anything is written"


def test_kimi_without_user_data_fails_naming_data():
    """The Kimi experiment has no built-in corpus: composed without conversations it fails, naming the key, and
    it trains on the target's own answers through its serving engine."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        raw = compose("config", overrides=["+experiment=kimi_eagle3"])
    with pytest.raises(ConfigError, match=r"data\.train_files=\[\]: data=jsonl needs at least one file"):
        load(raw)
    cfg = compose_root(["+experiment=kimi_eagle3"])
    assert cfg.data.name == "jsonl" and cfg.data.regenerate.enabled and cfg.data.regenerate.engine == "server"


def test_a_family_added_as_one_entry_is_accepted_and_each_engine_applies_its_loops_rule(monkeypatch, tmp_path):
    """A target family is one entry of orchestrator/families.py: with it, the config accepts the family, and each
    engine reads its ids by the rule of the capture loop the entry names, with no other edit."""
    from orchestrator import engines, families
    from orchestrator import layers as layer_contract

    with pytest.raises(ConfigError, match=r"target.family='mistral': expected one of \('llama', 'deepseek_v3'"):
        compose_root(["+experiment=tiny_eagle3", "target.family=mistral"])
    monkeypatch.setitem(families.FAMILIES, "mistral", families.Family("mistral", "MistralForCausalLM", "llama"))
    cfg = compose_root(["+experiment=tiny_eagle3", "target.family=mistral"])
    assert make_plan(cfg, tmp_path / "run").stages[-1]["layer_ids"]["captures_canonical"] == list(cfg.aux_layers)
    assert engines.get("sglang").id_rule("mistral", "0.5.23") is layer_contract.SGLANG_SHIFT
    assert engines.get("vllm").id_rule("mistral", "0.32.0") is layer_contract.VLLM_ENTERING
    monkeypatch.setitem(families.FAMILIES, "mistral", families.Family("mistral", "MistralForCausalLM", "deepseek"))
    assert engines.get("sglang").id_rule("mistral", "0.5.23") is layer_contract.SGLANG_FIRST_ID
    assert engines.get("vllm").id_rule("mistral", "0.32.0") is layer_contract.VLLM_DEEPSEEK
    with pytest.raises(ValueError, match=r"family 'mistral': decoder_loop='mamba', expected one of \('llama'"):
        families.Family("mistral", "MistralForCausalLM", "mamba")
