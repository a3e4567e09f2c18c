"""Serving: the target with and without the draft behind the same HTTP API, benchmarked side by side.

Baseline and speculative servers run one after the other in this stage on the same prompt set, so the speedup
is a ratio measured in one run. The engine is SGLang (GPU; `orchestrator.serving.sglang` builds its command)
or the project's reference engine (CPU). A benchmark never resumes half-way: each server starts clean.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from orchestrator import engines
from orchestrator import layers as layer_contract
from orchestrator.artifacts import read_json, write_json, write_manifest
from orchestrator.compute import Compute, resolve_precision
from orchestrator.config import RootConfig
from orchestrator.data import conversations, prompt_ids
from orchestrator.draft import export as draft_export
from orchestrator.serving import client
from orchestrator.serving import sglang as sglang_engine
from orchestrator.serving.launch import server_command
from orchestrator.targets import load_tokenizer, target_config_json


def served_draft_dir(cfg: RootConfig, plan) -> Path:
    """The draft directory serving gets: the trained one when its config is written in the serving engine's id
    convention, under every key that engine's runners read (`draft_export.write_layer_ids`), else a copy in the
    run folder (`draft_<engine>`, the weights hard-linked) whose config ids and
    provenance say, in `serve.engine`'s convention, the layers the export captures in its own engine's (its
    provenance's `serving`). One trained draft so serves on SGLang and on vLLM, each given the ids of its own rule,
    and an export whose ids were wrong stays wrong, for the guard and eval to see. When `serve.layers` differs from
    the trained layers (a deliberate mismatch such as the seed replay) the copy says `serve.layers`, which the guard
    then refuses. Eval and serve both use it, so the standalone eval sees what serving sees."""
    s, t = cfg.serve, cfg.target
    trained = plan.dir("train") / "draft"
    conf = read_json(trained / "config.json", "draft config")
    prov = read_json(trained / draft_export.PROVENANCE, "draft provenance")
    exported = prov.get("serving") or {}
    convention = layer_contract.id_convention(exported.get("engine") or s.engine)
    deliberate = list(s.layers) != list(cfg.train.layers)
    serving_convention = layer_contract.id_convention(s.engine)
    written = draft_export.nested_ids(conf)
    complete = conf == draft_export.write_layer_ids(json.loads(json.dumps(conf)), written or [], serving_convention)
    if convention == serving_convention and not deliberate and complete:
        return trained
    if deliberate:
        layers = list(s.layers)
    else:  # what the export captures where it was meant to be served
        version = exported.get(f"{convention}_version")  # draft_export.serving_record
        layers = layer_contract.from_engine_ids(
            convention, written, t.num_hidden_layers, t.family, version or s.engine_version
        )
    ids = _ids_as_written(cfg, layers)
    copy = Path(plan.run_dir) / f"draft_{s.engine}"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(trained, copy, copy_function=_link_or_copy)
    for name in ("config.json", draft_export.PROVENANCE):  # rewritten, never through a link to the trained draft
        (copy / name).unlink()
    write_json(copy / "config.json", draft_export.write_layer_ids(conf, ids, serving_convention))
    prov["serving"] = draft_export.serving_record(s, t.family, ids)
    write_json(copy / draft_export.PROVENANCE, prov)
    return copy


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _ids_as_written(cfg: RootConfig, layers: list[int]) -> list[int]:
    t = cfg.target
    try:
        return layer_contract.to_engine_ids(
            cfg.serve.engine, layers, t.num_hidden_layers, t.family, cfg.serve.engine_version
        )
    except layer_contract.LayerContractError:
        return layers  # written as-is, as a pipeline without the contract would


def run_server(
    cfg: RootConfig, mode: str, target: Path, draft: Path | None, prompts: list[list[int]], out: Path, compute: Compute
) -> dict[str, Any]:
    s = cfg.serve
    engine = engines.get(s.engine, engines.SERVE)
    port = client.free_port()
    command = server_command(cfg, target, draft, port, compute)
    engine.check_command(cfg, command)
    log = out / f"{mode}_server.log"
    print(f"[serve] {mode}: {' '.join(command)}")
    with client.ServerProcess(command, port, log, s.startup_timeout_s, env=engine.server_env(cfg)) as server:
        engine.request(server, prompts[0], min(8, s.max_new_tokens), s.request_timeout_s)  # warm-up
        engine.reset(server)
        runs = [_median_pass(server, prompts, c, cfg, exact_arithmetic(cfg)) for c in s.concurrency]
        info = engine.server_info(server)
    return {"command": command, "log": str(log), "runs": runs, "server_info": info}


def exact_arithmetic(cfg: RootConfig) -> bool:
    """Whether greedy outputs must agree token for token: the engine says (the reference engine in float32, on
    the CPU: one request at a time, the same kernels for a verify pass and a decode step). In bf16, a 4-token
    verify pass and 1-token decode steps round differently, and an engine that batches (SGLang, vLLM) is not
    bitwise reproducible: there the rate of differing tokens is held to `serve.greedy_token_tolerance`."""
    return engines.get(cfg.serve.engine, engines.SERVE).exact(cfg)


def differing_token_rate(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of output tokens that differ between two sets of greedy outputs of the same prompts: for each
    prompt, every token from the first that differs on (greedy decoding follows its own first difference), over
    the longer output's length."""
    differing = total = 0
    for x, y in zip(a, b, strict=True):
        length = max(len(x), len(y))
        common = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        differing += length - common
        total += length
    return differing / total if total else 0.0


def _median_pass(server, prompts: list[list[int]], concurrency: int, cfg: RootConfig, exact: bool) -> dict[str, Any]:
    """`serve.repeats` passes over the prompt set; the median pass by tok/s, with every pass's tok/s and the rate
    of tokens that differ from the first pass. Each pass is the engine's own benchmark: its API, and where it
    counts them (vLLM), its own counters for what the draft achieved."""
    s = cfg.serve
    engine = engines.get(s.engine, engines.SERVE)
    passes = [engine.benchmark(server, prompts, cfg, concurrency) for _ in range(s.repeats)]
    between = max(differing_token_rate(passes[0]["output_ids"], p["output_ids"]) for p in passes)
    if between and exact:
        raise server.fail(
            f"greedy outputs differ between passes at concurrency {concurrency} ({between:.2%} of tokens), in float32 "
            "on the reference engine, which computes them exactly: the server is not deterministic"
        )
    median = sorted(passes, key=lambda p: p["output_tok_s"])[len(passes) // 2]
    return median | {"output_tok_s_passes": [p["output_tok_s"] for p in passes], "pass_differing_token_rate": between}


def run(cfg: RootConfig, plan, tracker, compute: Compute) -> dict[str, Any]:
    s = cfg.serve
    out = plan.dir("serve")
    out.mkdir(parents=True, exist_ok=True)
    target = Path(plan.target_dir)
    engine = engines.get(s.engine, engines.SERVE)
    # this node's environment, as installed, before anything starts: its version's id rule is the one that applies
    installed = engine.check_installed(cfg, s.python, "serve.python")
    draft = served_draft_dir(cfg, plan)
    flags: list[str] = []
    try:
        ids = sglang_engine.check_draft_for_serving(cfg, draft, target_config_json(target))
    except sglang_engine.ServingRefused as exc:
        if s.guard:
            raise
        flags.append(f"serve: guard off, serving anyway a draft the guard refuses: {exc}")
        ids = read_json(draft / "config.json", "draft config")["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    tracker.tags({"serve.eagle_aux_hidden_state_layer_ids": json.dumps(ids)})  # the layers' param is aux_layers
    # the engine's own loader on the draft, where it has one (vLLM): nothing it reads and drops, nothing unloaded,
    # and every runner of the engine feeding it the states it was trained on, by the runners' own reading
    trained = draft_export.provenance(draft).get("aux_layers")
    loaded = engine.check_draft(cfg, target, draft, trained)
    if loaded is not None and loaded["problems"]:
        raise sglang_engine.ServingRefused(
            f"{s.engine} {loaded['version']} would serve the draft {draft} ({loaded['model_class']}) "
            "without all of its weights:\n  - "
            + "\n  - ".join(loaded["problems"])
            + f"\nThe export's weight names are not the ones {s.engine}'s loader takes (docs/engines.md)"
        )
    if loaded is not None and loaded["layer_problems"]:
        refusal = f"{s.engine} {loaded['version']} would feed the draft {draft} other layers than it was trained on:"
        refusal += "\n  - " + "\n  - ".join(loaded["layer_problems"])
        if s.guard:
            raise sglang_engine.ServingRefused(refusal)
        flags.append(f"serve: guard off, serving anyway: {refusal}")

    tokenizer = load_tokenizer(target, cfg.target.trust_remote_code, cfg.data.chat_template)
    _, val_convs = conversations(cfg.data, cfg.seed)
    prompts = [prompt_ids(tokenizer, c, cfg.data.max_seq_len) for c in val_convs[: s.prompts]]

    servers = {}
    try:
        servers["baseline"] = run_server(cfg, "baseline", target, None, prompts, out, compute)
        servers["speculative"] = run_server(cfg, "speculative", target, draft, prompts, out, compute)
    finally:
        for mode in ("baseline", "speculative"):
            log = out / f"{mode}_server.log"
            if log.exists():
                tracker.artifact(log, "serve")

    per_concurrency = []
    identical = True
    rates = []
    for base, spec in zip(servers["baseline"]["runs"], servers["speculative"]["runs"]):
        same = base["output_ids"] == spec["output_ids"]
        identical &= same
        rates.append(differing_token_rate(base["output_ids"], spec["output_ids"]))
        per_concurrency.append(
            {
                "concurrency": base["concurrency"],
                "baseline_tok_s": base["output_tok_s"],
                "spec_tok_s": spec["output_tok_s"],
                "speedup": spec["output_tok_s"] / base["output_tok_s"],
                "baseline_tok_s_passes": base["output_tok_s_passes"],
                "spec_tok_s_passes": spec["output_tok_s_passes"],
                "accept_length": spec["accept_length"],
                "baseline_latency_mean_s": base["latency_mean_s"],
                "spec_latency_mean_s": spec["latency_mean_s"],
                **{  # what the engine reports that the client cannot see (vLLM: from its /metrics)
                    f"{mode}_{k}": run[k]
                    for mode, run in (("baseline", base), ("spec", spec))
                    for k in ("ttft_mean_s", "itl_mean_s")
                    if run.get(k) is not None
                },
                "greedy_outputs_identical": same,
                "greedy_differing_token_rate": rates[-1],
                "pass_differing_token_rate": max(base["pass_differing_token_rate"], spec["pass_differing_token_rate"]),
            }
        )
    head = per_concurrency[0]
    worst = max(rates)
    exact = exact_arithmetic(cfg)
    if exact and not identical:
        flags.append(
            f"serve: greedy outputs with and without speculation differ ({worst:.2%} of tokens) in float32 on the "
            "reference engine, which computes both exactly: verification is not exact"
        )
    elif worst > s.greedy_token_tolerance:
        flags.append(
            f"serve: {worst:.2%} of greedy output tokens differ with and without speculation, more than "
            f"serve.greedy_token_tolerance={s.greedy_token_tolerance:.2%} allows for {s.engine} in "
            f"{resolve_precision(s.precision, s.resources.gpus_per_node)}: verification is not exact"
        )
    spec_head = servers["speculative"]["runs"][0]
    state = (servers["speculative"]["server_info"].get("internal_states") or [{}])[0]
    histogram = spec_head.get("accept_histogram") or state.get("spec_accept_histogram")
    result: dict[str, Any] = {k: head[k] for k in ("baseline_tok_s", "spec_tok_s", "speedup", "accept_length")}
    result |= {k: v for k, v in head.items() if k.endswith(("ttft_mean_s", "itl_mean_s"))}
    result["engine"] = s.engine
    result["engine_version"] = servers["speculative"]["server_info"].get("version") or installed or s.engine_version
    result["id_rules"] = f"{s.id_rules} ({s.engine_version}, installed)" if installed else s.id_rules
    if s.fallback_reason:
        result["engine_fallback"] = s.fallback_reason
    result |= {
        "greedy_outputs_identical": identical,
        "greedy_differing_token_rate": worst,
        "greedy_check": "exact" if exact else f"tolerance {s.greedy_token_tolerance:g}",
        "per_concurrency": per_concurrency,
        "eagle_aux_hidden_state_layer_ids": ids,
        "compute": compute.describe(),
    }
    if loaded is not None:
        result[f"{s.engine}_load_check"] = {
            k: loaded[k] for k in ("model_class", "unused", "missing", "runners", "fed", "runner_here")
        }
    if histogram:
        reached = [sum(histogram[j:]) for j in range(len(histogram))]
        result["accept_rate_by_position"] = [
            reached[k + 1] / reached[k] if reached[k] else 0.0 for k in range(len(histogram) - 1)
        ]
        result["accept_histogram"] = histogram
        # the share of drafts whose k-th token is accepted (vLLM's acceptance per position, `vllm bench serve`)
        result["acceptance_by_position"] = [
            reached[k + 1] / reached[0] if reached[0] else 0.0 for k in range(len(histogram) - 1)
        ]
    # The serve cycle's profile, where the engine reports one (the reference engine's phases, mean ms each).
    for mode in ("baseline", "speculative"):
        for phase, ms in (servers[mode]["server_info"].get("phase_ms") or {}).items():
            result[f"{mode}_{phase}_ms"] = ms
    eval_manifest = plan.dir("eval") / "manifest.json"
    if eval_manifest.exists():
        expected = read_json(eval_manifest, "eval manifest")["result"].get("expected_accept_length")
        result["eval_expected_accept_length"] = expected
        if expected and head["accept_length"]:
            rel = abs(head["accept_length"] - expected) / expected
            result["accept_length_rel_diff"] = rel
            if rel > s.accept_length_tolerance:
                flags.append(
                    f"serve: served accept length {head['accept_length']:.3f} differs from eval's expected "
                    f"{expected:.3f} by {rel:.1%} (> serve.accept_length_tolerance={s.accept_length_tolerance:.0%}): "
                    "serving feeds the draft differently from the standalone eval (layer ids, capture points, dtype)"
                )
    result["mismatch"] = bool(flags)
    result["mismatch_flags"] = flags
    result["headline"] = {
        k: result.get(k)
        for k in (
            "baseline_tok_s",
            "spec_tok_s",
            "speedup",
            "accept_length",
            "eval_expected_accept_length",
            "greedy_outputs_identical",
        )
    }

    tracker.stage_result("serve", result)
    tracker.tags({"serve.mismatch": str(result["mismatch"]).lower()})
    detail = {
        "result": result,
        "servers": {
            m: {k: v for k, v in srv.items() if k != "runs"}
            | {"runs": [{k: v for k, v in r.items() if k != "output_ids"} for r in srv["runs"]]}
            for m, srv in servers.items()
        },
    }
    write_json(out / "serve.json", detail)
    write_manifest(out, {"stage": "serve", "key": plan.stage_keys["serve"], "result": result})
    for flag in flags:
        print(f"[serve] MISMATCH: {flag}")
    return result
