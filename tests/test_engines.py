"""The engine registry (orchestrator/engines): every engine behind one interface, found by name, and a new engine
added as one package and one YAML file, with no stage edited."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator import conf_dir, engines
from orchestrator.config import ConfigError
from orchestrator.engines import server_command
from orchestrator.pipeline import run_pipeline, stage_layer_ids


def test_the_registry_finds_each_engine_by_its_module_and_role():
    assert engines.names(engines.SERVE) == ("reference", "sglang", "vllm")
    assert engines.names(engines.CAPTURE) == ("hf", "sglang", "vllm")
    assert {name: engines.get(name).name for name in engines.names()} == {n: n for n in engines.names()}
    with pytest.raises(engines.EngineError, match=r"unknown engine 'tensorrt'; expected one of \("):
        engines.get("tensorrt")
    with pytest.raises(engines.EngineError, match=r"engine 'hf' does not serve; the engines that do: \('reference'"):
        engines.get("hf", engines.SERVE)
    with pytest.raises(engines.EngineError, match="engine 'reference' has no capture"):
        engines.get("reference").open_capture(None, None)


def test_the_config_refuses_an_engine_for_a_role_it_does_not_play(tiny_config):
    with pytest.raises(ConfigError, match=r"serve.engine='hf': expected one of \('reference', 'sglang', 'vllm'\)"):
        tiny_config("serve.engine=hf")
    with pytest.raises(ConfigError, match=r"extract.engine='reference': expected one of \('hf', 'sglang', 'vllm'\)"):
        tiny_config("extract.engine=reference")
    with pytest.raises(ConfigError, match="regenerate.engine=one_pass with extract.engine=hf.*extract.engine=vllm"):
        tiny_config("data.regenerate.engine=one_pass")


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "kimi_k25"])
def test_each_engine_reads_its_own_convention_and_the_reference_engine_reads_sglangs(family):
    """The ids a draft config carries, per engine: SGLang's and the reference engine's are one convention (one
    export serves on both), vLLM's another (a draft exported for SGLang would feed vLLM other layers)."""
    layers, n = [1, 3, 5], 8
    ids = {e: engines.to_engine_ids(e, layers, n, family, "0.32.0" if e == "vllm" else "0.5.23")
           for e in engines.names(engines.SERVE)}  # fmt: skip
    assert engines.id_convention("reference") == engines.id_convention("sglang") == "sglang"
    assert engines.id_convention("vllm") == "vllm"
    assert ids["vllm"] == [2, 4, 6]  # vLLM's id k: the state entering layer k, i.e. layer k-1's output
    assert engines.from_engine_ids("vllm", ids["sglang"], n, family, "0.32.0") != layers


def test_the_reference_server_reads_a_draft_config_in_sglangs_ids(fast_cache, tiny_config, tmp_path):
    """The reference engine's own server, given the trained draft (its config in SGLang's ids, as the reference
    engine's serve stage exports it), feeds it the trained layers; given the same draft in vLLM's ids, it reads the
    layers SGLang's rule reads for them, not the trained ones: it reads SGLang's convention, whatever the draft was
    written for."""
    from orchestrator.compute import cpu
    from orchestrator.draft import export as draft_export
    from orchestrator.engines.reference.server import Engine as ReferenceServer
    from orchestrator.pipeline import make_plan

    cfg = tiny_config()
    fast_cache("extract", "train")
    plan = make_plan(cfg, tmp_path / "run")
    trained, target, n = plan.dir("train") / "draft", Path(plan.target_dir), cfg.target.num_hidden_layers
    conf = json.loads((trained / "config.json").read_text())
    assert draft_export.nested_ids(conf) == engines.to_engine_ids("sglang", cfg.aux_layers, n, "llama", "0.5.23")
    server = ReferenceServer(target, trained, 3, "llama", "0.5.23", cpu())
    assert server.layers == list(cfg.aux_layers)

    vllm_ids = engines.to_engine_ids("vllm", cfg.aux_layers, n, "llama", "0.32.0")
    assert vllm_ids != draft_export.nested_ids(conf)  # Llama: vLLM's id k is SGLang's k - 1
    copy = shutil.copytree(trained, tmp_path / "draft_vllm")
    written = draft_export.write_layer_ids(conf, vllm_ids, "vllm")
    (copy / "config.json").write_text(json.dumps(written))
    sglang_reads = engines.from_engine_ids("sglang", draft_export.nested_ids(written), n, "llama", "0.5.23")
    assert sglang_reads != list(cfg.aux_layers)
    if len(sglang_reads) < len(cfg.aux_layers):  # SGLang's rule drops an id it cannot capture: the server refuses
        with pytest.raises(RuntimeError, match=rf"captured {len(sglang_reads)} of {len(cfg.aux_layers)} aux hidden"):
            ReferenceServer(target, copy, 3, "llama", "0.5.23", cpu())
    else:
        assert ReferenceServer(target, copy, 3, "llama", "0.5.23", cpu()).layers == sglang_reads


ECHO = """\
    from orchestrator.engines.reference import Reference


    class Echo(Reference):
        \"\"\"The reference engine under another name, with its own id convention's name and a flag of its own.\"\"\"

        name = "echo"

        def launch_command(self, cfg, target, draft, port, compute):
            return [*super().launch_command(cfg, target, draft, port, compute), "--echo"]


    ENGINE = Echo()
"""


def added_engine(tmp_path, monkeypatch, name: str, code: str, group: str, yaml: str):
    """An engine added as the guide says: one package (here in a folder on the engines package's path) and one YAML
    file (conf/<group>/<name>.yaml, here in a folder on Hydra's search path). Yields the overrides that select it."""
    package = tmp_path / "engines" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(code))
    monkeypatch.setattr(engines, "__path__", [*engines.__path__, str(package.parent)])
    engines._modules.cache_clear()
    engines.get.cache_clear()
    search = tmp_path / "conf"
    (search / group).mkdir(parents=True)
    (search / group / f"{name}.yaml").write_text(yaml)
    yield [f"hydra.searchpath=[file://{search}]", f"{group}={name}"]
    engines._modules.cache_clear()
    engines.get.cache_clear()
    sys.modules.pop(f"orchestrator.engines.{name}", None)


@pytest.fixture
def echo_engine(tmp_path, monkeypatch):
    """A serving engine: the package ECHO and conf/serve/echo.yaml, the reference engine's with its name."""
    yaml = (conf_dir() / "serve" / "reference.yaml").read_text().replace("engine: reference", "engine: echo")
    yield from added_engine(tmp_path, monkeypatch, "echo", ECHO, "serve", yaml)


def test_an_engine_added_as_one_package_and_one_yaml_is_planned_and_launched(echo_engine, tiny_config, tmp_path):
    assert "echo" in engines.names(engines.SERVE)
    cfg = tiny_config(*echo_engine, "dry_run=true")
    assert cfg.serve.engine == "echo" and engines.id_rules(cfg.serve) == "sglang 0.5.23"
    command = server_command(cfg, tmp_path / "target", None, 1234)
    assert command[-1] == "--echo" and "orchestrator.engines.reference.server" in command
    serve = stage_layer_ids(cfg, "serve")
    assert serve["convention"].startswith("echo (sglang 0.5.23 rules")
    assert serve["captures_canonical"] == list(cfg.aux_layers)
    run_pipeline(cfg, tmp_path / "run")  # a dry run: the plan, every stage's ids in its own convention
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    planned = {s["stage"]: s["layer_ids"] for s in plan["stages"]}
    assert planned["serve"] == serve and planned["extract"]["convention"] == "hf"
    shutil.rmtree(tmp_path / "run")


MIRROR = """\
    from orchestrator.engines.hf import HF


    class Mirror(HF):
        \"\"\"HF's hooks under another name, naming its own convention in the plan.\"\"\"

        name = "mirror"

        def capture_ids(self, cfg, layers):
            return super().capture_ids(cfg, layers) | {"convention": "mirror (hf hooks)"}


    ENGINE = Mirror()
"""


@pytest.fixture
def mirror_engine(tmp_path, monkeypatch):
    """A capture engine added the same way: the package MIRROR, and conf/extract/mirror.yaml, the default
    extraction with its engine."""
    yaml = "defaults:\n  - default\n  - _self_\nengine: mirror\n"
    yield from added_engine(tmp_path, monkeypatch, "mirror", MIRROR, "extract", yaml)


def test_a_capture_engine_added_as_one_package_and_one_yaml_plans_an_extraction(mirror_engine, tiny_config, tmp_path):
    assert engines.names(engines.CAPTURE) == ("hf", "mirror", "sglang", "vllm")
    assert "mirror" not in engines.names(engines.SERVE)
    cfg = tiny_config(*mirror_engine, "dry_run=true")
    assert cfg.extract.engine == "mirror"
    run_pipeline(cfg, tmp_path / "run")  # a dry run: the plan, with the extraction's ids in the engine's words
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    extract = {s["stage"]: s for s in plan["stages"]}["extract"]
    assert extract["layer_ids"]["convention"] == "mirror (hf hooks)"
    assert extract["layer_ids"]["capture_points"] == stage_layer_ids(tiny_config(), "extract")["capture_points"]
    shutil.rmtree(tmp_path / "run")
