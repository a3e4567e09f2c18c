"""SGLang's command line: the only module that knows it (sglang 0.5.23; docs/engines.md#sglang-launch-command).

    launch_command            the `python -m sglang.launch_server ...` argv, speculative or baseline
    capture_command           the argv of a server of the target alone that answers states: its capture mode's (the
                              states at given ids) or the final norm's output
    server_env, gpu_env       the environment SGLang's CPU engine needs (the serve stage's; a job's devices')
    validate_with_sglang      parses an argv with sglang's own argparse parser, in the serving environment

sglang lives in its own environment (`serve.python`, built by scripts/make_sglang_env.sh), never in the
project's, so everything that needs sglang's code runs there as a subprocess. Without GPUs (serve.resources.
gpus_per_node=0) SGLang is started through cpu_kernels/launch.py, which runs `sglang.launch_server` as it is where
an sgl_kernel build loads, and otherwise with the project's PyTorch stand-in for it (docs/engines.md#sglang-on-a-cpu).
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

from orchestrator.compute import resolve_precision
from orchestrator.config.schema import ConfigError, RootConfig, check_speculative_args
from orchestrator.draft.guard import ServingRefused

MODULE = "sglang.launch_server"
ALGORITHM = "EAGLE3"
CPU_LAUNCHER = Path(__file__).with_name("cpu_kernels") / "launch.py"
# SGLang's CPU engine: one batch at a time (its overlap scheduler is a GPU feature), on the CPU device, with a KV
# pool of 65,536 tokens: left to itself it sizes the pool by the machine's free memory (1.6 M tokens, 12 GB for the
# tiny Llama here, 16 s of each start-up spent allocating it). serve.extra_args setting a flag replaces its value.
CPU_FLAGS = [["--device", "cpu"], ["--disable-overlap-schedule"], ["--max-total-tokens", "65536"]]
# An extraction through SGLang keeps two servers of the target up on the task's GPUs (orchestrator/engines/sglang/
# capture.py): each takes this fraction of their memory for its weights and KV pool.
CAPTURE_MEM_FRACTION = 0.42

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


def launch_command(
    cfg: RootConfig, target_path: str, draft_dir: str | None, port: int, host: str = "127.0.0.1"
) -> list[str]:
    """The argv that starts SGLang on `target_path`: with `draft_dir` EAGLE-3 speculative decoding, else the
    baseline."""
    s = cfg.serve
    check_speculative_args(s)
    check_extra_args(s.extra_args)
    gpus = s.resources.gpus_per_node
    start = [s.python, "-m", MODULE] if gpus else [s.python, str(CPU_LAUNCHER)]
    argv = [*start, "--model-path", str(target_path)]
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
    argv += ["--dtype", s.dtype or resolve_precision(s.precision, gpus)]
    if not gpus:
        given = {a.split("=", 1)[0] for a in s.extra_args}  # the user's own setting of a flag wins, value and all
        argv += [a for flag in CPU_FLAGS if flag[0] not in given for a in flag]
    if s.cuda_graph_max_bs_decode is not None:
        argv += ["--cuda-graph-max-bs-decode", str(s.cuda_graph_max_bs_decode)]
    argv += list(s.extra_args)
    argv += ["--host", host, "--port", str(port)]
    return argv


def capture_command(
    cfg: RootConfig,
    target_path: str,
    ids: list[int] | None,
    port: int,
    host: str = "127.0.0.1",
    *,
    python: str | None = None,
    gpus: int | None = None,
    dtype: str | None = None,
) -> list[str]:
    """A server of the target alone whose /generate, asked with `"return_hidden_states": true`, answers states: with
    `ids`, SGLang's capture mode (`--enable-return-aux-hidden-states` with EAGLE-3's id list,
    `--return-aux-hidden-state-layer-ids`, SGLang's convention; sglang/srt/arg_groups/validation_hook.py), whose
    states are the aux ones concatenated in id order; with `ids=None`, `--enable-return-hidden-states`, whose states
    are what the target's head reads (the final norm's output). Either answers the prompt's states ([prompt, width]),
    then one vector per decoded token but the last. Without the radix cache: a prefix an earlier request left cached
    is not computed again, and its states would be missing from the answer.

    `python`, `gpus` and `dtype` are the extract job's (extract.python, its devices, extract.precision), the serve
    stage's where not given. On GPUs the two servers of an extraction share the devices: each takes
    CAPTURE_MEM_FRACTION of their memory."""
    s = cfg.serve
    gpus = s.resources.gpus_per_node if gpus is None else gpus
    python = python or s.python
    start = [python, "-m", MODULE] if gpus else [python, str(CPU_LAUNCHER)]
    dtype = dtype or s.dtype or resolve_precision(s.precision, gpus)
    argv = [*start, "--model-path", str(target_path), "--dtype", dtype, "--disable-radix-cache"]
    if gpus > 1:
        argv += ["--tp-size", str(gpus)]
    if gpus:
        argv += ["--mem-fraction-static", str(CAPTURE_MEM_FRACTION)]
    else:
        argv += [a for flag in CPU_FLAGS for a in flag]
    if cfg.target.trust_remote_code:
        argv.append("--trust-remote-code")
    if ids is None:
        argv.append("--enable-return-hidden-states")
    else:
        argv += ["--enable-return-aux-hidden-states", "--speculative-algorithm", ALGORITHM]
        argv += ["--return-aux-hidden-state-layer-ids", *map(str, ids)]
    return [*argv, "--host", host, "--port", str(port)]


def server_env(cfg: RootConfig) -> dict[str, str]:
    """The serve stage's servers' environment (`gpu_env` for its nodes' GPUs)."""
    return gpu_env(cfg.serve.resources.gpus_per_node)


def gpu_env(gpus: int) -> dict[str, str]:
    """Without GPUs: SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, which `--device cpu` expects), the user's own
    setting kept."""
    if gpus:
        return {}
    return {"SGLANG_USE_CPU_ENGINE": os.environ.get("SGLANG_USE_CPU_ENGINE", "1")}


def module_args(argv: list[str]) -> list[str]:
    """The arguments `sglang.launch_server` receives from a `launch_command` argv, either form."""
    if argv[1:3] == ["-m", MODULE]:
        return argv[3:]
    if len(argv) > 1 and argv[1] == str(CPU_LAUNCHER):
        return argv[2:]
    raise ValueError(f"expected [python, '-m', '{MODULE}', ...] or [python, '{CPU_LAUNCHER}', ...], got {argv[:3]}")


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


_HAS_SGLANG: set[str] = set()  # the environments found able to import it, by interpreter path
_ACCEPTED: set[tuple[str, ...]] = set()  # (interpreter, *command) its parser accepted


def validate_with_sglang(python: str, argv: list[str], timeout: float = 120) -> None:
    """Parses a `launch_command` argv with sglang's parser in the environment of `python`.

    Catches unknown, ambiguous and mistyped flags and bad choices without a GPU. Raises ServingRefused with
    sglang's error when the parser rejects the command, or when `python` cannot import sglang. A command accepted
    once is not parsed again in this process (a dry run prints the same server for regeneration and the baseline).
    """
    if (python, *argv) in _ACCEPTED:
        return
    try:
        done = subprocess.run(
            [python, "-c", parser_check_script(), *module_args(argv)], capture_output=True, text=True, timeout=timeout
        )
    except FileNotFoundError:
        raise ServingRefused(
            f"serve.python={python!r} does not exist; build it with scripts/make_sglang_env.sh"
        ) from None
    except subprocess.TimeoutExpired:
        raise ServingRefused(f"sglang's argument parser in {python} did not finish within {timeout:.0f} s") from None
    if done.returncode == 0:
        _ACCEPTED.add((python, *argv))
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
    """Whether `python` can import the part of sglang that parses server arguments. An environment that can is not
    asked again in this process: a dry run asks before each command it checks, and each import is seconds. One that
    cannot is asked again, as it may be built meanwhile."""
    if python in _HAS_SGLANG:
        return True
    try:
        done = subprocess.run([python, "-c", "import sglang.srt.server_args"], capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if done.returncode == 0:
        _HAS_SGLANG.add(python)
    return done.returncode == 0


def _tail(text: str, lines: int = 20) -> str:
    """argparse's `error:` lines when there are any (its usage text runs to hundreds of lines), else the tail."""
    errors = [line for line in text.splitlines() if ": error: " in line]
    return "\n".join(errors or text.splitlines()[-lines:])
