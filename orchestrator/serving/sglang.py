"""SGLang's command line: the only module that knows it (sglang 0.5.23; docs/engines.md#sglang-launch-command).

    launch_command            the `python -m sglang.launch_server ...` argv, speculative or baseline
    check_draft_for_serving   refuses a draft directory SGLang would load wrongly, above all one whose
                              `eagle_config` ids capture other layers than the draft was trained on
    validate_with_sglang      parses an argv with sglang's own argparse parser, in the serving environment

sglang lives in its own environment (`serve.python`, built by scripts/make_sglang_env.sh), never in the
project's, so everything that needs sglang's code runs there as a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from orchestrator import layers as layer_contract
from orchestrator.artifacts import ArtifactError
from orchestrator.config import ConfigError, RootConfig, check_speculative_args
from orchestrator.draft import export as draft_export

MODULE = "sglang.launch_server"
ALGORITHM = "EAGLE3"

# Flags `launch_command` sets from a serve.* key; setting them again in extra_args would silently win
# (argparse keeps the last value), so they are refused there with the key to use instead.
MANAGED_FLAGS = {
    "--model-path": "target.path",
    "--model": "target.path",
    "--tp-size": "serve.tp_size",
    "--tensor-parallel-size": "serve.tp_size",
    "--trust-remote-code": "target.trust_remote_code",
    "--mem-fraction-static": "serve.mem_fraction_static",
    "--dtype": "serve.dtype",
    "--cuda-graph-max-bs-decode": "serve.cuda_graph_max_bs_decode",
    "--host": "the host argument",
    "--port": "the port argument",
}


class ServingRefused(RuntimeError):
    """A draft or launch command that SGLang would reject, or worse, accept and serve wrongly."""


def launch_command(
    cfg: RootConfig, target_path: str, draft_dir: str | None, port: int, host: str = "127.0.0.1"
) -> list[str]:
    """The argv that starts SGLang on `target_path`: with `draft_dir` EAGLE-3 speculative decoding, else the
    baseline."""
    s = cfg.serve
    check_speculative_args(s)
    check_extra_args(s.extra_args)
    argv = [s.python, "-m", MODULE, "--model-path", str(target_path)]
    if draft_dir is not None:
        # All three of steps/topk/draft-tokens or none: a partial set crashes at startup, and none lets
        # SGLang pick per-architecture defaults that the config would not record.
        argv += [
            "--speculative-algorithm",
            ALGORITHM,
            "--speculative-draft-model-path",
            str(draft_dir),
            "--speculative-num-steps",
            str(s.num_steps),
            "--speculative-eagle-topk",
            str(s.eagle_topk),
            "--speculative-num-draft-tokens",
            str(s.num_draft_tokens),
        ]
    if s.tp_size > 1:
        argv += ["--tp-size", str(s.tp_size)]
    if cfg.target.trust_remote_code:
        argv.append("--trust-remote-code")
    if s.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(s.mem_fraction_static)]
    if s.dtype is not None:
        argv += ["--dtype", s.dtype]
    if s.cuda_graph_max_bs_decode is not None:
        argv += ["--cuda-graph-max-bs-decode", str(s.cuda_graph_max_bs_decode)]
    argv += list(s.extra_args)
    argv += ["--host", host, "--port", str(port)]
    return argv


def check_extra_args(extra_args: list[str]) -> None:
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag == "--cuda-graph-max-bs":
            raise ConfigError(
                f"serve.extra_args contains {arg!r}: sglang 0.5.23 rejects it as ambiguous (it matches "
                f"--cuda-graph-max-bs-decode and --cuda-graph-max-bs-prefill); set serve.cuda_graph_max_bs_decode"
            )
        if not flag.startswith("--"):
            continue
        if flag.startswith("--speculative"):
            raise ConfigError(
                f"serve.extra_args contains {arg!r}: the speculative flags come from the draft directory and "
                f"serve.num_steps / serve.eagle_topk / serve.num_draft_tokens; remove it from serve.extra_args"
            )
        # sglang's parser accepts unambiguous abbreviations (`--tp 8` is `--tp-size 8`), so prefixes count too.
        managed = [name for name in MANAGED_FLAGS if name.startswith(flag)]
        if managed:
            raise ConfigError(
                f"serve.extra_args contains {arg!r}, which would override {MANAGED_FLAGS[managed[0]]} "
                f"({managed[0]}); set that instead"
            )


# ------------------------------------------------------------------------------------------ the draft directory


def check_draft_for_serving(cfg: RootConfig, draft_dir: str | Path, target_config: dict[str, Any]) -> list[int]:
    """The draft config's aux-layer ids, once the directory passes SGLang's loading rules and the layer contract.

    Raises ServingRefused when the directory is malformed, or when SGLang (at `serve.sglang_version`, with the
    rule for `target.family`) would capture other states from the target than those the draft was trained on,
    as recorded in its provenance file.
    """
    folder = Path(draft_dir)
    problems = draft_export.validate_draft_dir(folder, target_config)
    if problems:
        raise ServingRefused(f"draft {folder} cannot be served by SGLang:\n  - " + "\n  - ".join(problems))
    ids = json.loads((folder / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    try:
        prov = draft_export.provenance(folder)
        trained = prov["aux_layers"]
    except (ArtifactError, KeyError) as exc:
        raise ServingRefused(
            f"draft {folder}: no trained aux_layers in {draft_export.PROVENANCE} ({exc}); without them nobody can "
            f"tell which target layers its fc expects, so it is not served"
        ) from None
    check_exported_engine(cfg, prov, ids, where=f"draft {folder}")
    check_layer_ids(cfg, ids, trained, where=f"draft {folder}")
    return list(ids)


def check_exported_engine(cfg: RootConfig, prov: dict[str, Any], ids: list[int], where: str = "draft") -> None:
    """Refuses a draft whose config was written for an engine of another id convention (its provenance's
    `serving.engine`): an SGLang export served by vLLM feeds the draft the layer below each trained one."""
    s = cfg.serve
    exported = (prov.get("serving") or {}).get("engine")
    if exported is None or layer_contract.id_convention(exported) == layer_contract.id_convention(s.engine):
        return
    rules = (prov.get("serving") or {}).get("id_rules") or exported
    try:
        what = f"{s.engine} would capture {_captured(cfg, ids)[1]}"
    except layer_contract.LayerContractError as exc:
        what = f"{s.engine} has no rule for them ({exc})"
    raise ServingRefused(
        f"{where} was exported for {exported} ({rules}: ids {list(ids)} for aux_layers={prov.get('aux_layers')}), "
        f"not for serve.engine={s.engine} ({s.id_rules}); {what}. Fix: serve it through the pipeline, whose serve "
        f"stage writes the draft for its engine (orchestrator.draft.served.served_draft_dir), or set "
        f"serve.engine={exported}."
    )


def _captured(cfg: RootConfig, ids: list[int]) -> tuple[list[int], str]:
    """The canonical states serve.engine captures for a draft config's ids, and them in words."""
    t, s = cfg.target, cfg.serve
    captured = layer_contract.from_engine_ids(s.engine, ids, t.num_hidden_layers, t.family, s.engine_version)
    return captured, f"{captured} ({', '.join(layer_contract.describe(k) for k in captured) or 'nothing'})"


def check_layer_ids(cfg: RootConfig, ids: list[int], trained: list[int], where: str = "draft") -> None:
    """Refuses ids that make SGLang capture anything but exactly the canonical `trained` layers, in that order."""
    t, s = cfg.target, cfg.serve
    captured, states = _captured(cfg, ids)
    if captured == list(trained) and len(ids) == len(trained):
        return
    rule = layer_contract.engine_rule(layer_contract.id_convention(s.engine), t.family, s.engine_version)
    if len(captured) < len(ids):
        what = f"captures only {len(captured)} states for {len(ids)} ids: {states}"
    else:
        what = f"captures {states}"
    try:
        fixed_ids = layer_contract.to_engine_ids(s.engine, trained, t.num_hidden_layers, t.family, s.engine_version)
        fix = f"set it to {fixed_ids} (orchestrator.layers.to_engine_ids) or re-export the draft"
    except layer_contract.LayerContractError as exc:
        fix = f"no ids express the trained layers with this rule ({exc}); retrain on layers it can capture"
    raise ServingRefused(
        f"{where}: config.json eagle_config.eagle_aux_hidden_state_layer_ids={list(ids)}, but the draft was trained "
        f"on aux_layers={list(trained)} ({draft_export.PROVENANCE}). {s.id_rules} ({rule.name} rule for "
        f"target.family={t.family}, {t.num_hidden_layers} layers) {what}. Fix: {fix}."
    )


# ---------------------------------------------------------------------------------- sglang's own argument parser


def parser_check_script() -> str:
    """Python run in the serving environment: parse sys.argv[1:] exactly as `sglang.launch_server` does."""
    return textwrap.dedent(
        """\
        import argparse
        import sys

        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser(prog="sglang.launch_server")
        ServerArgs.add_cli_args(parser)
        parser.parse_args(sys.argv[1:])
        """
    )


def validate_with_sglang(python: str, argv: list[str], timeout: float = 120) -> None:
    """Parses a `launch_command` argv with sglang's parser in the environment of `python`.

    Catches unknown, ambiguous and mistyped flags and bad choices without a GPU. Raises ServingRefused with
    sglang's error when the parser rejects the command, or when `python` cannot import sglang.
    """
    if argv[1:3] != ["-m", MODULE]:
        raise ValueError(f"expected an argv of the form [python, '-m', '{MODULE}', ...], got {argv[:3]}")
    try:
        done = subprocess.run(
            [python, "-c", parser_check_script(), *argv[3:]], capture_output=True, text=True, timeout=timeout
        )
    except FileNotFoundError:
        raise ServingRefused(
            f"serve.python={python!r} does not exist; build it with scripts/make_sglang_env.sh"
        ) from None
    except subprocess.TimeoutExpired:
        raise ServingRefused(f"sglang's argument parser in {python} did not finish within {timeout:.0f} s") from None
    if done.returncode == 0:
        return
    stderr = done.stderr.strip()
    if "ModuleNotFoundError" in stderr or "ImportError" in stderr:
        raise ServingRefused(
            f"{python} cannot import sglang.srt.server_args; build the serving environment with "
            f"scripts/make_sglang_env.sh:\n{_tail(stderr)}"
        )
    raise ServingRefused(
        f"sglang's parser in {python} rejects the launch command:\n{_tail(stderr)}\ncommand: {' '.join(argv)}"
    )


def sglang_available(python: str, timeout: float = 120) -> bool:
    """Whether `python` can import the part of sglang that parses server arguments."""
    try:
        done = subprocess.run([python, "-c", "import sglang.srt.server_args"], capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _tail(text: str, lines: int = 20) -> str:
    """argparse's `error:` lines when there are any (its usage text runs to hundreds of lines), else the tail."""
    errors = [line for line in text.splitlines() if ": error: " in line]
    return "\n".join(errors or text.splitlines()[-lines:])
