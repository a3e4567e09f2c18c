"""SGLang's command line and draft directory (orchestrator/engines/sglang/cli.py), against golden files.

Goldens live in tests/golden/; `EAGLE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sglang.py` rewrites them
(review the diff).
The `sglang` tests parse the golden commands with sglang's own parser: they need `SGLANG_PYTHON` pointing at a
python that imports sglang (scripts/make_sglang_env.sh builds one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import user_overrides
from golden import GOLDEN_DIR, assert_matches_golden
from hydra import compose, initialize_config_dir

import orchestrator
from orchestrator import engines
from orchestrator.config import RootConfig, load
from orchestrator.draft import export as draft_export
from orchestrator.draft import guard
from orchestrator.draft.guard import ServingRefused
from orchestrator.draft.model import DraftShape, Eagle3Draft, default_shape
from orchestrator.engines.sglang import cli as sglang

SERVING_PYTHON = "/opt/sglang-env/bin/python"
PORT = 30000
# Fixed paths for the goldens, one of them hostile: argv elements are passed verbatim, never through a shell.
KIMI_PATHS = ("/models/Kimi-K2.5", "/outputs/kimi_eagle3/train/draft")
LLAMA_PATHS = ("/models/tiny llama's target", "/outputs/tiny_eagle3/train/draft")

DATA = Path(__file__).parent / "data"

EXPERIMENTS = {
    "kimi_eagle3": (["+experiment=kimi_eagle3"], KIMI_PATHS),
    # the demo's fallback to the reference engine off: these commands are SGLang's, wherever its env is
    "tiny_eagle3_sglang": (["+experiment=tiny_eagle3", "serve=sglang", "serve.fallback=null"], LLAMA_PATHS),
}


def make_config(overrides: list[str]) -> RootConfig:
    with initialize_config_dir(config_dir=str(orchestrator.conf_dir()), version_base="1.3"):
        # serve.python defaults to $SGLANG_PYTHON; pin it so goldens do not depend on the environment.
        return load(compose("config", overrides=user_overrides([*overrides, f"serve.python={SERVING_PYTHON}"])))


def assert_golden(name: str, data: Any) -> None:
    assert_matches_golden(f"{name}.json", json.dumps(data, indent=2) + "\n")


# Where the checkout lies differs between machines; the goldens name the CPU launcher by its place in the repository.
LAUNCHER = "<repo>/orchestrator/engines/sglang/cpu_kernels/launch.py"


def launch_commands(experiment: str) -> dict[str, list[str]]:
    overrides, (target, draft) = EXPERIMENTS[experiment]
    cfg = make_config(overrides)

    def relative(argv):
        return [LAUNCHER if a == str(sglang.CPU_LAUNCHER) else a for a in argv]

    return {
        "speculative": relative(sglang.launch_command(cfg, target, draft, PORT)),
        "baseline": relative(sglang.launch_command(cfg, target, None, PORT)),
    }


def target_config_of(cfg: RootConfig) -> dict[str, Any]:
    """The fields of the target's HF config.json that the draft export reads."""
    t = cfg.target
    conf = {
        "architectures": [t.architecture],
        "hidden_size": t.hidden_size,
        "num_hidden_layers": t.num_hidden_layers,
        "vocab_size": t.vocab_size,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": t.rope_theta,
    }
    if t.rope_scaling is not None:
        conf["rope_scaling"] = t.rope_scaling
    return conf


def exported_draft_config(cfg: RootConfig, target_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The draft config.json the export writes for `cfg`, from `target_config` (the target's config.json, its text
    model's for a wrapper: what the train stage reads) or the target's fields in `cfg`."""
    t, d = cfg.target, cfg.draft
    shape = default_shape(
        t.hidden_size,
        t.vocab_size,
        d.num_aux_layers,
        d.hidden_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        d.head_dim,
        d.intermediate_size,
        d.draft_vocab_size,
        d.rms_norm_eps,
        t.rope_theta,
        d.max_position_embeddings or t.max_position_embeddings,
    )
    ids = engines.to_engine_ids(
        cfg.serve.engine, cfg.aux_layers, t.num_hidden_layers, t.family, cfg.serve.sglang_version
    )
    target_config = target_config or target_config_of(cfg)
    return draft_export.draft_config(shape, ids, d.torch_dtype, target_config, shape.max_position_embeddings)


# ------------------------------------------------------------------------------------------------- goldens


@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_launch_command_matches_golden(experiment):
    assert_golden(f"sglang_launch_{experiment}", launch_commands(experiment))


def test_launch_command_invariants():
    for experiment in EXPERIMENTS:
        commands = launch_commands(experiment)
        spec, base = commands["speculative"], commands["baseline"]
        # on GPUs SGLang's own entry point; without, the launcher that brings the CPU stand-in where it is needed
        gpus = make_config(EXPERIMENTS[experiment][0]).serve.resources.gpus_per_node
        assert (
            spec[:3] == [SERVING_PYTHON, "-m", "sglang.launch_server"]
            if gpus
            else spec[:2] == [SERVING_PYTHON, LAUNCHER]
        )
        assert ("--device" in spec) == (not gpus) and ("--device" in base) == (not gpus)
        assert spec[spec.index("--speculative-algorithm") + 1] == "EAGLE3"
        for flag in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"):
            assert flag in spec
        assert not [a for a in base if a.startswith("--speculative")]
        assert "--cuda-graph-max-bs" not in spec
        assert spec[-4:] == ["--host", "127.0.0.1", "--port", str(PORT)]
    kimi = launch_commands("kimi_eagle3")["speculative"]
    assert kimi[kimi.index("--tp-size") + 1] == "8" and "--trust-remote-code" in kimi
    assert kimi[kimi.index("--model-path") + 1] == KIMI_PATHS[0]
    llama = launch_commands("tiny_eagle3_sglang")["speculative"]
    assert "--tp-size" not in llama and "--trust-remote-code" not in llama
    assert llama[llama.index("--model-path") + 1] == LLAMA_PATHS[0]


def test_optional_flags_follow_the_config():
    cfg = make_config(
        [
            "+experiment=tiny_eagle3",
            "serve=sglang",
            "serve.fallback=null",
            "serve.cuda_graph_max_bs_decode=16",
            "serve.mem_fraction_static=0.7",
            "serve.dtype=null",
            "serve.extra_args=[--log-level,debug]",
        ]
    )
    argv = sglang.launch_command(cfg, "/t", "/d", 31000, host="0.0.0.0")
    assert argv[argv.index("--cuda-graph-max-bs-decode") + 1] == "16"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.7"
    assert argv[argv.index("--dtype") + 1] == "float32"  # serve.precision=auto without GPUs, as eval ran the draft
    pinned = make_config(["+experiment=tiny_eagle3", "serve=sglang", "serve.fallback=null", "serve.dtype=bfloat16"])
    bf16 = sglang.launch_command(pinned, "/t", "/d", 31000)
    assert bf16[bf16.index("--dtype") + 1] == "bfloat16"
    assert argv[-6:] == ["--log-level", "debug", "--host", "0.0.0.0", "--port", "31000"]


def test_a_users_own_device_flag_replaces_the_cpu_default_whole():
    """Without GPUs the command adds `--device cpu`; a user's `--device` (either spelling) replaces it, value and all,
    and no stray `cpu` is left for SGLang's parser to refuse."""
    for extra in ("[--device,xpu]", "['--device=xpu']"):
        cfg = make_config(
            ["+experiment=tiny_eagle3", "serve=sglang", "serve.fallback=null", f"serve.extra_args={extra}"]
        )
        argv = sglang.launch_command(cfg, "/t", None, PORT)
        assert "cpu" not in argv and argv.count("--disable-overlap-schedule") == 1, argv
        assert argv[argv.index("--max-total-tokens") + 1] == "65536", argv  # a bounded KV pool on the CPU
    own = make_config(["+experiment=tiny_eagle3", "serve=sglang", "serve.fallback=null",
                       "serve.extra_args=[--max-total-tokens,4096]"])  # fmt: skip
    argv = sglang.launch_command(own, "/t", None, PORT)
    assert argv.count("--max-total-tokens") == 1 and argv[argv.index("--max-total-tokens") + 1] == "4096", argv


def test_kimi_draft_config_matches_golden():
    """The Kimi draft's config.json, exported from Kimi-K2.5's own config.json (tests/data/targets): its YaRN rope
    (beta_fast 32) is the one the published Kimi-K2.5 EAGLE-3 draft trained by SpecForge carries."""
    from orchestrator.targets import target_config_json

    cfg = make_config(["+experiment=kimi_eagle3"])
    assert cfg.aux_layers == [-1, 2, 30]
    conf = exported_draft_config(cfg, target_config_json(DATA / "targets" / "moonshotai__Kimi-K2.5"))
    published = json.loads((DATA / "drafts" / "published" / "k-l-lambda__Kimi-K2.5-Eagle3" / "config.json").read_text())
    assert conf["rope_theta"] == published["rope_theta"] == 50000.0
    scaling = {k: v for k, v in published["rope_scaling"].items() if k != "type"}
    assert conf["rope_scaling"] == {"rope_type": "yarn"} | scaling
    assert conf["rope_scaling"]["beta_fast"] == 32.0
    # sglang >= 0.5.13 reads DeepSeek/Kimi ids as "entering layer k" unless the first id is 1 (PR #25454).
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 31]
    assert conf["draft_vocab_size"] == 32000 and conf["target_hidden_size"] == 7168
    assert_golden("sglang_draft_config_kimi_eagle3", conf)


def test_llama_draft_config_matches_golden():
    cfg = make_config(["+experiment=tiny_eagle3", "serve=sglang", "serve.fallback=null"])
    conf = exported_draft_config(cfg)
    # Llama: sglang stores k + 1 and captures the state entering that layer, i.e. the output of layer k.
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == cfg.aux_layers == [1, 4, 6]
    assert_golden("sglang_draft_config_tiny_eagle3", conf)


# ------------------------------------------------------------------------------------------ argument errors


def test_topk_one_with_other_draft_token_count_is_refused():
    cfg = make_config(["+experiment=kimi_eagle3"])
    cfg.serve.num_draft_tokens = 6
    with pytest.raises(ValueError, match=r"serve\.num_draft_tokens=6.*serve\.num_steps\+1=4"):
        sglang.launch_command(cfg, *KIMI_PATHS, PORT)


def test_tree_drafting_keeps_its_draft_token_count():
    cfg = make_config(["+experiment=kimi_eagle3", "serve.eagle_topk=4", "serve.num_draft_tokens=8"])
    argv = sglang.launch_command(cfg, *KIMI_PATHS, PORT)
    assert argv[argv.index("--speculative-eagle-topk") + 1] == "4"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "8"


@pytest.mark.parametrize(
    "extra, key",
    [
        (["--cuda-graph-max-bs", "8"], "serve.cuda_graph_max_bs_decode"),
        (["--cuda-graph-max-bs=8"], "serve.cuda_graph_max_bs_decode"),
        (["--speculative-algorithm", "EAGLE"], "serve.num_steps"),
        (["--speculative-num-steps=5"], "serve.num_steps"),
        (["--port", "1"], "the port argument"),
        (["--tp", "4"], "serve.tp_size"),
        (["--model", "/other"], "target.path"),
    ],
)
def test_extra_args_that_fight_the_config_are_refused(extra, key):
    cfg = make_config(["+experiment=kimi_eagle3"])
    cfg.serve.extra_args = extra
    with pytest.raises(ValueError, match=f"serve.extra_args.*{extra[0]}.*{key}"):
        sglang.launch_command(cfg, *KIMI_PATHS, PORT)


# ----------------------------------------------------------------------------------- the draft directory


TINY = DraftShape(
    hidden_size=32,
    target_hidden_size=32,
    num_aux_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    vocab_size=64,
    draft_vocab_size=48,
    max_position_embeddings=2048,
)
TINY_TARGET = {"hidden_size": 32, "vocab_size": 64, "max_position_embeddings": 2048, "rope_theta": 10000.0}


def write_draft(folder: Path, ids: list[int], trained: list[int]) -> Path:
    torch.manual_seed(0)
    draft = Eagle3Draft(TINY)
    draft.set_vocab_map(*draft_export.build_vocab_map(torch.randint(0, 100, (TINY.vocab_size,)), TINY.draft_vocab_size))
    conf = draft_export.draft_config(TINY, ids, "bfloat16", TINY_TARGET, TINY.max_position_embeddings)
    draft_export.export(draft, folder, conf, {"aux_layers": trained}, TINY_TARGET)
    return folder


def rewrite_ids(folder: Path, ids: list[int]) -> None:
    conf = json.loads((folder / "config.json").read_text())
    conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (folder / "config.json").write_text(json.dumps(conf))


def test_draft_with_contract_ids_is_accepted_and_other_ids_refused(tmp_path):
    cfg = make_config(["+experiment=tiny_eagle3", "serve=sglang", "serve.fallback=null"])
    ids = engines.to_engine_ids("sglang", cfg.aux_layers, cfg.target.num_hidden_layers, "llama", "0.5.23")
    folder = write_draft(tmp_path / "draft", ids, cfg.aux_layers)
    assert guard.check_draft_for_serving(cfg, folder, TINY_TARGET) == ids

    rewrite_ids(folder, [2, 5, 7])
    with pytest.raises(ServingRefused) as err:
        guard.check_draft_for_serving(cfg, folder, TINY_TARGET)
    message = str(err.value)
    assert "eagle_aux_hidden_state_layer_ids=[2, 5, 7]" in message
    assert "aux_layers=[1, 4, 6]" in message
    assert "captures only 2 states for 3 ids: [2, 5]" in message  # id 7 -> layer 8 does not exist
    assert "set it to [1, 4, 6]" in message


def test_kimi_seed_ids_written_as_is_are_refused(tmp_path):
    cfg = make_config(["+experiment=kimi_eagle3"])
    folder = write_draft(tmp_path / "draft", [0, 3, 31], [-1, 2, 30])
    assert guard.check_draft_for_serving(cfg, folder, TINY_TARGET) == [0, 3, 31]

    # The seed wrote the canonical list as-is: sglang 0.5.23 drops -1 and reads 2, 30 as "entering".
    rewrite_ids(folder, [-1, 2, 30])
    with pytest.raises(ServingRefused) as err:
        guard.check_draft_for_serving(cfg, folder, TINY_TARGET)
    message = str(err.value)
    assert "eagle_aux_hidden_state_layer_ids=[-1, 2, 30]" in message
    assert "trained on aux_layers=[-1, 2, 30]" in message
    assert "captures only 2 states for 3 ids: [1, 29]" in message
    assert "set it to [0, 3, 31]" in message

    # SGLang's own default-style ids: three states, but the wrong ones.
    rewrite_ids(folder, [2, 30, 58])
    with pytest.raises(ServingRefused, match=r"captures \[1, 29, 57\].*set it to \[0, 3, 31\]"):
        guard.check_draft_for_serving(cfg, folder, TINY_TARGET)


def test_kimi_ids_depend_on_the_sglang_version():
    # Before PR #25454 (sglang < 0.5.13) the DeepSeek family always shifted by one, so the seed's list was right.
    old = make_config(["+experiment=kimi_eagle3", "serve.sglang_version=0.5.12"])
    guard.check_layer_ids(old, [-1, 2, 30], [-1, 2, 30])
    with pytest.raises(ServingRefused, match=r"sglang 0\.5\.12 .*set it to \[-1, 2, 30\]"):
        guard.check_layer_ids(old, [0, 3, 31], [-1, 2, 30])


def test_malformed_draft_or_missing_provenance_is_refused(tmp_path):
    cfg = make_config(["+experiment=tiny_eagle3", "serve=sglang", "serve.fallback=null"])
    folder = write_draft(tmp_path / "draft", [1, 4, 6], [1, 4, 6])
    with pytest.raises(ServingRefused, match="target_hidden_size=32 but the target's hidden_size is 256"):
        guard.check_draft_for_serving(cfg, folder, TINY_TARGET | {"hidden_size": 256})
    (folder / draft_export.PROVENANCE).unlink()
    with pytest.raises(ServingRefused, match="no trained aux_layers"):
        guard.check_draft_for_serving(cfg, folder, TINY_TARGET)


# ------------------------------------------------------------------------------ sglang's own parser


STAND_IN_SERVER_ARGS = """
class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", required=True)
        parser.add_argument("--speculative-algorithm", choices=["EAGLE", "EAGLE3"])
        parser.add_argument("--speculative-num-steps", type=int)
"""


def test_parser_check_script_parses_the_command_with_server_args(tmp_path, monkeypatch):
    """The check runs the command's arguments through whatever `sglang.srt.server_args.ServerArgs` adds to an
    argparse parser, and reports that parser's verdict: here a stand-in with three of sglang's flags, on
    PYTHONPATH, so that the check's own wiring is tested without sglang (the real parser:
    `test_golden_commands_parse_with_sglang`, with SGLANG_PYTHON)."""
    package = tmp_path / "sglang" / "srt"
    package.mkdir(parents=True)
    for folder in (tmp_path / "sglang", package):
        (folder / "__init__.py").write_text("")
    (package / "server_args.py").write_text(STAND_IN_SERVER_ARGS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    python = sys.executable
    head = [python, "-m", "sglang.launch_server"]
    sglang.validate_with_sglang(python, [*head, "--model-path", "/t", "--speculative-algorithm", "EAGLE3"])
    with pytest.raises(ServingRefused, match=r"(?s)invalid choice: 'EAGLE9'.*command: .*EAGLE9"):
        sglang.validate_with_sglang(python, [*head, "--model-path", "/t", "--speculative-algorithm", "EAGLE9"])
    with pytest.raises(ServingRefused, match=r"unrecognized arguments: --speculative-num-draft-tokens"):
        sglang.validate_with_sglang(python, [*head, "--model-path", "/t", "--speculative-num-draft-tokens", "4"])
    with pytest.raises(ServingRefused, match=r"argument --speculative-num-steps: invalid int value: 'three'"):
        sglang.validate_with_sglang(python, [*head, "--model-path", "/t", "--speculative-num-steps", "three"])
    with pytest.raises(ServingRefused, match=r"the following arguments are required: --model-path"):
        sglang.validate_with_sglang(python, head)


def test_missing_serving_python(tmp_path):
    missing = str(tmp_path / "no-python")
    assert not sglang.sglang_available(missing)
    with pytest.raises(ServingRefused, match="does not exist"):
        sglang.validate_with_sglang(missing, [missing, "-m", "sglang.launch_server", "--model-path", "/t"])


def test_an_environment_that_imports_sglang_is_asked_once_and_one_that_cannot_each_time(tmp_path, monkeypatch):
    """A dry run asks before each command it checks; an environment's import of sglang is seconds, so one that
    succeeded is not run again, while one that failed is (it may be built meanwhile). The same for a command its
    parser accepted (the dry run's regeneration server is its baseline's command)."""
    runs = []
    real = sglang.subprocess.run
    monkeypatch.setattr(sglang.subprocess, "run", lambda argv, **kw: runs.append(argv[0]) or real(argv, **kw))
    for name, status in (("imports", 0), ("lacks", 1)):
        (tmp_path / name).write_text(f"#!/bin/sh\nexit {status}\n")
        (tmp_path / name).chmod(0o755)
    imports, lacks = str(tmp_path / "imports"), str(tmp_path / "lacks")
    assert [sglang.sglang_available(imports) for _ in range(3)] == [True] * 3
    assert [sglang.sglang_available(lacks) for _ in range(2)] == [False] * 2
    assert runs == [imports, lacks, lacks]
    # a command its parser accepted is not parsed again; one it refused is, and is refused again
    runs.clear()
    for _ in range(2):
        sglang.validate_with_sglang(imports, [imports, "-m", sglang.MODULE, "--model-path", "/t"])
    sglang.validate_with_sglang(imports, [imports, "-m", sglang.MODULE, "--model-path", "/u"])
    for _ in range(2):
        with pytest.raises(ServingRefused, match="rejects the launch command"):
            sglang.validate_with_sglang(lacks, [lacks, "-m", sglang.MODULE, "--model-path", "/t"])
    assert runs == [imports, imports, lacks, lacks]


def test_python_without_sglang(tmp_path):
    python = sys.executable  # the project's environment, which never holds sglang
    if sglang.sglang_available(python):
        pytest.skip("this environment imports sglang")
    with pytest.raises(ServingRefused, match="cannot import sglang.srt.server_args.*make_sglang_env.sh"):
        sglang.validate_with_sglang(python, [python, "-m", "sglang.launch_server", "--model-path", "/t"])


@pytest.mark.sglang
@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_golden_commands_parse_with_sglang(experiment, sglang_python):
    python = sglang_python
    commands = json.loads((GOLDEN_DIR / f"sglang_launch_{experiment}.json").read_text())
    for argv in commands.values():
        sglang.validate_with_sglang(python, [str(sglang.CPU_LAUNCHER) if a == LAUNCHER else a for a in argv])


@pytest.mark.sglang
def test_sglang_parser_errors_come_back(sglang_python):
    python = sglang_python
    argv = [python, "-m", "sglang.launch_server", "--model-path", "/t", "--cuda-graph-max-bs", "8"]
    with pytest.raises(ServingRefused, match="ambiguous option: --cuda-graph-max-bs could match"):
        sglang.validate_with_sglang(python, argv)
    with pytest.raises(ServingRefused, match="--speculative-num-steps: invalid int value"):
        sglang.validate_with_sglang(python, argv[:5] + ["--speculative-num-steps", "three"])


@pytest.mark.sglang
def test_sglang_reads_a_drafts_ids_where_the_project_says_it_does(sglang_python, tmp_path):
    """SGLang 0.5.23's own reading of the draft config (`resolve_spec_aux_hidden_state_config`, tests/
    sglang_ids_probe.py), held to the project's (`engines.sglang.sglang_config_ids`): the nested key of an SGLang
    export; the nested key again, not the top-level one, of a vLLM export (both keys, here [2, 5, 7] against a nested
    [1, 4, 6], so that which one SGLang took shows). A speculators export SGLang does not read at all (no
    `model_type` at its top: transformers' AutoConfig refuses it), which is why the check refuses that format for
    SGLang and `train.from_draft` rewrites it in SGLang's. Only config.json files are read: the tiny Llama's
    architecture for the target, the project's export of a draft config for the drafts."""
    import subprocess

    from orchestrator.draft import export as draft_export
    from orchestrator.draft.model import default_shape
    from orchestrator.engines.sglang import sglang_config_ids

    target = tmp_path / "target"
    target.mkdir()
    tconf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
             "intermediate_size": 352, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 8,
             "vocab_size": 2048, "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
             "torch_dtype": "float32"}  # fmt: skip
    (target / "config.json").write_text(json.dumps(tconf))
    shape = default_shape(128, 2048, 3, None, 2, 2, None, None, 1024, 1e-6, 10000.0, 2048, None)
    drafts = {}
    for name, convention in (("sglang_export", "sglang"), ("vllm_export", "vllm")):
        conf = draft_export.draft_config(shape, [1, 4, 6], "float32", tconf, 2048, convention)
        if convention == "vllm":
            conf[draft_export.TOP_LEVEL_IDS] = [2, 5, 7]
        drafts[name] = tmp_path / name
        drafts[name].mkdir()
        (drafts[name] / "config.json").write_text(json.dumps(conf))
    speculators = Path(__file__).parent / "data" / "drafts" / "speculators_0.9.0" / "with_ids"
    probe = Path(__file__).parent / "sglang_ids_probe.py"
    argv = [sglang_python, str(probe), str(target), *map(str, drafts.values()), str(speculators)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sglangs = json.loads(proc.stdout.splitlines()[-1])
    assert "Should have a `model_type` key" in sglangs.pop(str(speculators))["error"]
    assert sglangs == {str(drafts["sglang_export"]): [1, 4, 6], str(drafts["vllm_export"]): [1, 4, 6]}
    for draft in drafts.values():
        [(_, source, ids)] = sglang_config_ids(json.loads((draft / "config.json").read_text()), 8)
        assert ids == sglangs[str(draft)], draft


@pytest.mark.sglang
def test_the_kimi_dry_run_prints_both_server_commands_and_sglangs_parser_accepts_them(
    sglang_python, tiny_config, tmp_path, capsys
):
    """+experiment=kimi_eagle3_vllm's serve stage, on paper: the dry run prints the baseline and speculative SGLang
    commands the serve job will run (tp 8, the draft at the train stage's output), and the server the extract job
    starts to answer the prompts turn by turn (the baseline's command), and SGLang 0.5.23's own parser (`ServerArgs`,
    in serve.python) accepts each."""
    from conftest import kimi_checkpoint

    from orchestrator.pipeline import make_plan, print_regenerate_command, print_serve_commands

    kimi = kimi_checkpoint(tmp_path / "Kimi-K2.5")
    cfg = tiny_config(f"target.path={kimi}", f"serve.python={sglang_python}", experiment="kimi_eagle3_vllm",
                      fast=False)  # fmt: skip
    plan = make_plan(cfg, tmp_path / "run")
    print_serve_commands(cfg, plan)
    out = capsys.readouterr().out
    assert out.count("[serve] sglang's parser in serve.python accepts it") == 2, out
    lines = [x for x in out.splitlines() if x.startswith("[serve] ") and " server: " in x]
    baseline, speculative = (x.split(" server: ", 1)[1].split() for x in lines)
    assert "--speculative-algorithm" not in baseline and "--tp-size" in baseline
    assert speculative[speculative.index("--speculative-draft-model-path") + 1] == str(plan.dir("train") / "draft")
    print_regenerate_command(cfg, plan)
    out = capsys.readouterr().out
    assert "[regenerate] sglang's parser in serve.python accepts it" in out, out
    line = next(x for x in out.splitlines() if x.startswith("[regenerate] the extract job serves the target"))
    assert "(every turn in turn, 4096 new tokens at most)" in line
    assert line.split("): ", 1)[1].split() == baseline, "regeneration serves the target as the baseline does"


def test_sglang_captures_from_its_own_environment_with_a_post_norm_teacher(sglang_python, tiny_config):
    """extract.engine=sglang before any job: its environment (extract=sglang selects it), a post_norm teacher (SGLang
    answers the final norm's output, never the last layer's raw one), no regeneration by HF in this process, not an
    eval engine; the embedding output computed where capture mode would need id -1 (the Llama rule) and captured
    where the DeepSeek rule names it with id 0."""
    from orchestrator.config import ConfigError
    from orchestrator.engines.sglang.capture import capture_plan

    with pytest.raises(ConfigError, match=r"extract.python=.* holds no sglang.*select extract=sglang"):
        tiny_config("extract.engine=sglang", "data.regenerate.enabled=false")
    ours = (f"extract.python={sglang_python}", "extract=sglang")
    with pytest.raises(ConfigError, match=r"extract.teacher=pre_norm with extract.engine=sglang: .*no id captures"):
        tiny_config(*ours, "data.regenerate.enabled=false", "extract.teacher=pre_norm")
    with pytest.raises(ConfigError, match=r"data.regenerate.engine=hf with extract.engine=sglang"):
        tiny_config(*ours, "data.regenerate.enabled=true", "data.regenerate.engine=hf")
    with pytest.raises(ConfigError, match=r"eval.engine=sglang: .*set eval.engine=vllm"):
        tiny_config(*ours, "data.regenerate.enabled=false", "eval.engine=sglang")
    with pytest.raises(ConfigError, match=r"aux_layers=\[-1\] through SGLang's capture mode"):
        tiny_config(*ours, "data.regenerate.enabled=false", "aux_layers=[-1]", "draft.num_aux_layers=1")
    cfg = tiny_config(*ours, "data.regenerate.enabled=false", "aux_layers=[-1,3,5]")
    assert cfg.extract.engine == "sglang" and cfg.extract.python == sglang_python
    assert capture_plan(cfg, [-1, 3, 5]) == ([3, 5], True)  # Llama: id == canonical, -1 refused by capture mode
    assert capture_plan(cfg, [1, 4, 6]) == ([1, 4, 6], False)
    deepseek = tiny_config(*ours, "data.regenerate.enabled=false", "target=tiny_deepseek_v3", "aux_layers=[-1,1,2]")
    assert capture_plan(deepseek, [-1, 1, 2]) == ([0, 2, 3], False)  # DeepSeek: id 0 enters layer 0, the embedding
    # the dry run's memory check counts the two servers' copies of the target
    from orchestrator.preflight import memory_findings
    from orchestrator.targets import ensure_target

    found = {f.message.split(":")[0]: f for f in memory_findings(cfg, ensure_target(cfg, progress=False))}
    assert "x 2 copies (sglang's capture keeps 2 servers of it up) x 1 task(s)" in found["extract"].message
    assert "copies" not in found["eval"].message
    command = sglang.capture_command(cfg, "/t", [3, 5], 1234, python=sglang_python, gpus=0, dtype="float32")
    assert command[1] == str(sglang.CPU_LAUNCHER) and "--disable-radix-cache" in command
    assert command[command.index("--return-aux-hidden-state-layer-ids") + 1 :][:2] == ["3", "5"]
    final = sglang.capture_command(cfg, "/t", None, 1234, python=sglang_python, gpus=2, dtype="bfloat16")
    assert final[1:3] == ["-m", "sglang.launch_server"] and "--enable-return-hidden-states" in final
    assert final[final.index("--tp-size") + 1] == "2" and "--enable-return-aux-hidden-states" not in final
    for argv in (command, final):
        sglang.validate_with_sglang(sglang_python, argv)  # SGLang's own parser takes both
