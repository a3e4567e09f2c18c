"""Serving: the target with and without the draft behind the same HTTP API, benchmarked side by side.

Baseline and speculative servers run one after the other in this stage on the same prompt set, so the speedup
is a ratio measured in one run. The engine is `serve.engine`'s (orchestrator/engines/: vLLM, SGLang, or the
project's reference engine), its command from `engines.server_command`. A benchmark never resumes half-way:
each server starts clean.
"""

from __future__ import annotations

import copy
import hashlib
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from orchestrator import engines
from orchestrator.artifacts import read_json, stable_hash, write_json, write_manifest
from orchestrator.compute import Compute, hardware, resolve_precision
from orchestrator.config import ConfigError, RootConfig
from orchestrator.data import conversations, prompt_ids
from orchestrator.draft import export as draft_export
from orchestrator.draft import guard
from orchestrator.draft.served import served_draft_dir
from orchestrator.engines import client, server_command
from orchestrator.results import GREEDY, EvalResult, ServeResult
from orchestrator.targets import load_tokenizer, target_config_json


def run_server(
    cfg: RootConfig,
    mode: str,
    target: Path,
    draft: Path | None,
    prompts: list[list[int]],
    out: Path,
    compute: Compute,
    have: dict[str, list[dict[str, Any]]],
    ready: Callable[[], Any] = lambda: None,
    launched: client.ServerProcess | None = None,
) -> dict[str, Any]:
    """Starts `mode`'s server (or takes `launched`, started before) and runs the passes `have` (concurrency -> the
    passes cached) lacks of `serve.repeats` per concurrency level; the server's command, log, info, and every pass,
    cached ones first. `ready` is waited for once the server is up, before any request: work overlapped with its
    start-up (the loader check, the other server's start-up) ends before anything is timed."""
    s = cfg.serve
    engine = engines.get(s.engine, engines.SERVE)
    server = launched or server_process(cfg, mode, target, draft, out, compute)
    log, command = server.log_path, server.command
    print(f"[serve] {mode}: {' '.join(command)}")
    passes, counts, timed = {}, None, prompts[: s.prompts]
    with server:
        ready()
        clock = [server.launched_at, server.healthy_at, time.monotonic()]
        engine.request(server, prompts[0], min(8, s.max_new_tokens), s.request_timeout_s)  # warm-up
        engine.reset(server)
        clock.append(time.monotonic())
        for c in s.concurrency:
            cached = have.get(str(c), [])
            passes[str(c)] = cached + [
                engine.benchmark(server, timed, cfg, c) for _ in range(max(0, s.repeats - len(cached)))
            ]
        clock.append(time.monotonic())
        if draft is not None and accept_prompts(cfg):  # untimed, after the passes: each response's own count
            counts = engine.request_counts(server, prompts[: accept_prompts(cfg)], cfg)
            clock.append(time.monotonic())
        info = engine.server_info(server)
    # where this server's time went: starting until healthy, waiting for what had to end before its first request
    # (the loader check, the other server's start-up or passes), the warm-up request, the passes it ran, the count
    phases = ("startup_s", "waited_s", "warmup_s", "measure_s", "count_s")
    seconds = {k: round(b - a, 3) for k, a, b in zip(phases, clock, clock[1:])}
    out = {"command": command, "log": str(log), "passes": passes, "server_info": info, "seconds": seconds}
    out["launched_at"] = round(server.launched_wall, 3)  # the epoch second it started: whether two overlapped
    return out | ({"request_counts": counts} if counts is not None else {})


def server_process(
    cfg: RootConfig, mode: str, target: Path, draft: Path | None, out: Path, compute: Compute
) -> client.ServerProcess:
    """`mode`'s server as the engine starts it (its command checked by the engine's own parser), not started yet."""
    s = cfg.serve
    engine = engines.get(s.engine, engines.SERVE)
    port = client.free_port()
    command = server_command(cfg, target, draft, port, compute)
    engine.check_command(cfg, command)
    return client.ServerProcess(command, port, out / f"{mode}_server.log", s.startup_timeout_s, engine.server_env(cfg))


def accept_prompts(cfg: RootConfig) -> int:
    """The prompts the speculative server answers for per-request counts (serve.accept_prompts)."""
    n = cfg.serve.accept_prompts
    return cfg.serve.prompts if n is None else n


def accept_interval(counts: list[list[int]], resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The accept length over the counted requests (Σ tokens / Σ verify passes, each request's [tokens, verify
    passes] as the engine counted them; a request with no verify pass, which ended on its prefill token, is left
    out) and its 95% interval: the 2.5th and 97.5th percentiles of the same ratio over `resamples` resamplings of
    the requests with replacement (a bootstrap; seeded, so the same counts give the same interval). Requests, not
    verify passes, are the independent draws: one request's passes share its text. {} where no request drafted."""
    import random

    counts = [c for c in counts if c[1]]
    if not counts:
        return {}
    tokens, passes = [c[0] for c in counts], [c[1] for c in counts]
    pooled, n = sum(tokens) / sum(passes), len(counts)
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        draws.append(sum(tokens[i] for i in pick) / sum(passes[i] for i in pick))
    draws.sort()
    low, high = draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]
    return {"accept_length_counted": pooled, "accept_length_requests": n, "accept_length_ci95": [low, high]}


def measurement_keys(
    stage_keys: dict[str, str], measuring: str | None, prompts: list[list[int]], timed: int
) -> dict[str, str]:
    """The cache keys of the baseline and speculative passes: the plan's (pipeline.stage_keys), with what only the
    job knows: the engine as installed (`Engine.measuring`) and the token ids of the prompts each server answers
    (the baseline the first `timed`, serve.prompts; the speculative server also those it counts after them)."""

    def sha(p: list[list[int]]) -> str:
        return hashlib.sha256(json.dumps(p).encode()).hexdigest()

    answered = {"baseline": sha(prompts[:timed]), "speculative": sha(prompts)}
    return {
        mode: stable_hash({"plan": stage_keys[f"serve_{mode}"], "engine": measuring, "prompts": answered[mode]})
        for mode in ("baseline", "speculative")
    }


def measure(
    cfg: RootConfig,
    run: tuple[str, str],
    mode: str,
    key: str,
    started: dict[str, bool],
    start: Callable[[dict], dict[str, Any]],
) -> dict[str, Any]:
    """`mode`'s server as measured under `key`: from `outputs/cache/serve/<mode>/<key>/`, where as many passes per
    concurrency level as `serve.repeats` asks are there, else `start(have)` runs the missing ones and they are added
    (`serve.force`: all measured again). One measurement per key: a run (a sweep point) that finds another measuring
    the same key waits for it, then takes its passes. `started` records whether a server started and who measured
    the passes (`run`: this run's MLflow run id and folder; the host and time)."""
    from filelock import FileLock

    s = cfg.serve
    record_path = _record_path(cfg, mode, key)
    record_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(record_path.parent / ".lock")):
        record = cached_record(cfg, mode, key)
        have = (record or {}).get("passes", {})
        missing = {str(c): s.repeats - len(have.get(str(c), [])) for c in s.concurrency}
        if record is not None and all(n <= 0 for n in missing.values()):
            print(f"[serve] {mode}: cached, measured by {_who(record['measured_by'])} ({record_path})")
            started[mode] = False
        else:
            fresh = start(have)
            here = {"mlflow_run_id": run[0], "run_dir": run[1], "host": socket.gethostname()}
            here["hardware"] = hardware(s.resources.gpus_per_node > 0)
            here |= {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "passes": missing}
            here["seconds"] = fresh["seconds"]
            record = {k: v for k, v in fresh.items() if k != "passes"} | {
                "key": key,
                "passes": fresh["passes"],
                "measured_by": ([] if s.force else (record or {}).get("measured_by", [])) + [here],
            }
            write_json(record_path, record)
            started[mode] = True
    runs = [_median_pass(record["passes"][str(c)][: s.repeats], c, exact_arithmetic(cfg)) for c in s.concurrency]
    return {k: v for k, v in record.items() if k != "passes"} | {"runs": runs}


def passes_cached(cfg: RootConfig, plan) -> bool:
    """Whether every pass this run's serve stage would measure, both servers', is in the cache under its key
    (`measurement_keys`): then the stage starts no server and only reads them, and a blocking run (cluster=local)
    runs it in its own process, without a job's start-up (pipeline.run_pipeline). False where the keys cannot be
    known here yet (no target copied, no engine environment): the job then finds out, and says why."""
    engine = engines.get(cfg.serve.engine, engines.SERVE)
    try:
        installed = engine.check_installed(cfg, cfg.serve.python, "serve.python", cfg.serve.resources.gpus_per_node)
        prompts = _prompts(cfg, Path(plan.target_dir))
    except (ConfigError, OSError, ValueError):
        return False
    keys = measurement_keys(plan.stage_keys, engine.measuring(installed), prompts, cfg.serve.prompts)
    return not any(_to_measure(cfg, mode, key) for mode, key in keys.items())


def _to_measure(cfg: RootConfig, mode: str, key: str) -> bool:
    """Whether `mode`'s server lacks passes under `key` (`measure` will start it, unless another run measures it
    first)."""
    have = (cached_record(cfg, mode, key) or {}).get("passes", {})
    return any(len(have.get(str(c), [])) < cfg.serve.repeats for c in cfg.serve.concurrency)


def cached_record(cfg: RootConfig, mode: str, key: str) -> dict[str, Any] | None:
    """`mode`'s cached measurement under `key` (as many passes as it holds), or None (`serve.force`: none)."""
    path = _record_path(cfg, mode, key)
    return read_json(path, f"{mode} measurement") if path.exists() and not cfg.serve.force else None


def _record_path(cfg: RootConfig, mode: str, key: str) -> Path:
    return cfg.outputs / "cache" / "serve" / mode / key / "measured.json"


def _who(measured_by: list[dict[str, Any]]) -> str:
    def one(m: dict[str, Any]) -> str:
        on = f" ({m['hardware']})" if m.get("hardware") else ""
        return f"run {m['mlflow_run_id']} on {m['host']}{on} at {m['at']}"

    return "; ".join(one(m) for m in measured_by)


# Passes measured further apart than this are not divided or pooled without a word: a CPU's or a shared node's
# speed moves within the hour (docs/measurements.md).
APART_S = 600


def measured_apart(servers: dict[str, dict[str, Any]], within_s: float = APART_S) -> str | None:
    """Where the speedup divides passes measured at different times (a cached baseline, passes added to cached ones
    by a higher serve.repeats): when, in words, if they span more than `within_s`; else None."""
    at = {mode: sorted(m["at"] for m in servers[mode]["measured_by"]) for mode in servers}
    moments = [datetime.fromisoformat(t) for times in at.values() for t in times]
    if (max(moments) - min(moments)).total_seconds() <= within_s:
        return None
    when = "; ".join(f"{mode} at {', '.join(times)}" for mode, times in at.items())
    return (
        f"the passes were measured {(max(moments) - min(moments)).total_seconds() / 60:.0f} minutes apart ({when}): "
        "the machine's speed may differ between them; serve.force=true measures both servers now"
    )


def measured_elsewhere(measured_by: list[dict[str, Any]], run_id: str, hardware_here: str) -> str | None:
    """Where passes this run did not measure came from another machine or another day: which, in words. Another
    machine is another host name or, under one host name, other hardware (`compute.hardware`): machines that share
    a host name (containers and VMs often do) can have other processors. A record from before hardware was
    recorded is judged by host and day."""
    here, today = socket.gethostname(), datetime.now(timezone.utc).date().isoformat()
    other = [m for m in measured_by if m["mlflow_run_id"] != run_id]
    away = [
        m for m in other
        if m["host"] != here or not m["at"].startswith(today) or m.get("hardware", hardware_here) != hardware_here
    ]  # fmt: skip
    return f"measured by {_who(away)}" if away else None


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


def _median_pass(passes: list[dict[str, Any]], concurrency: int, exact: bool) -> dict[str, Any]:
    """The median of `serve.repeats` passes over the prompt set by tok/s, with every pass's tok/s and the rate of
    tokens that differ from the first pass. Each pass is the engine's own benchmark: its API, and where it counts
    them (vLLM), its own counters for what the draft achieved."""
    between = max(differing_token_rate(passes[0]["output_ids"], p["output_ids"]) for p in passes)
    if between and exact:
        raise client.ServerError(
            f"greedy outputs differ between passes at concurrency {concurrency} ({between:.2%} of tokens), in float32 "
            "on the reference engine, which computes them exactly: the server is not deterministic"
        )
    median = sorted(passes, key=lambda p: p["output_tok_s"])[len(passes) // 2]
    return median | {"output_tok_s_passes": [p["output_tok_s"] for p in passes], "pass_differing_token_rate": between}


def _refuse_or_flag(cfg: RootConfig, draft: Path, loaded: dict[str, Any] | None, flags: list[str]) -> None:
    """The engine's loader check's verdict: a draft it would serve without all its weights is refused; one it would
    feed other layers than it was trained on is refused by the guard, or flagged with the guard off."""
    s = cfg.serve
    if loaded is not None and loaded["problems"]:
        raise guard.ServingRefused(
            f"{s.engine} {loaded['version']} would serve the draft {draft} ({loaded['model_class']}) "
            "without all of its weights:\n  - "
            + "\n  - ".join(loaded["problems"])
            + f"\nThe export's weight names are not the ones {s.engine}'s loader takes (docs/engines.md)"
        )
    if loaded is not None and loaded["layer_problems"]:
        refusal = f"{s.engine} {loaded['version']} would feed the draft {draft} other layers than it was trained on:"
        refusal += "\n  - " + "\n  - ".join(loaded["layer_problems"])
        if s.guard:
            raise guard.ServingRefused(refusal)
        flags.append(f"serve: guard off, serving anyway: {refusal}")


def run(cfg: RootConfig, plan, tracker, compute: Compute) -> ServeResult:
    """The target served without and with the draft on the same prompts, each server's passes measured once per
    key (`measure`), their outputs and speeds compared, and what the engine counted held to eval's prediction."""
    s = cfg.serve
    out = plan.dir("serve")
    out.mkdir(parents=True, exist_ok=True)
    target = Path(plan.target_dir)
    engine = engines.get(s.engine, engines.SERVE)
    # this node's environment, as installed, before anything starts: its version's id rule is the one that applies
    installed = engine.check_installed(cfg, s.python, "serve.python", s.resources.gpus_per_node)
    draft = served_draft_dir(cfg, plan)
    flags: list[str] = []
    ids = _guarded_ids(cfg, draft, target, flags)
    tracker.tags({"serve.eagle_aux_hidden_state_layer_ids": json.dumps(ids)})  # the layers' param is aux_layers
    prompts = _prompts(cfg, target)
    keys = measurement_keys(plan.stage_keys, engine.measuring(installed), prompts, s.prompts)
    servers, started, loaded = _measure_servers(cfg, plan, tracker, compute, (target, draft), prompts, keys, flags)
    # the result's stored keys, in their order, as the measurements give them
    measured = _compared(cfg, servers, flags)
    counts = servers["speculative"].get("request_counts")
    measured |= accept_interval(counts) if counts else {}
    measured |= _on_eval_prompts(cfg, plan, counts)
    measured |= _how_measured(cfg, installed, servers, started, keys, tracker.run_id)
    measured |= {"eagle_aux_hidden_state_layer_ids": ids, "compute": compute.describe()}
    measured |= _engine_counts(cfg, loaded, servers)
    served = measured.get("accept_length_eval_prompts") or measured.get("accept_length_counted")
    measured |= _against_eval(cfg, plan, served or measured["accept_length"], flags)
    measured |= {"mismatch": bool(flags), "mismatch_flags": flags}
    result = ServeResult.from_dict(measured)
    result.headline = result.make_headline()
    _record(plan, tracker, out, result, servers)
    return result


def _guarded_ids(cfg: RootConfig, draft: Path, target: Path, flags: list[str]) -> list[int]:
    """The draft config's ids, once the guard passes them; with serve.guard=false a refused draft is served
    anyway, and flagged."""
    try:
        return guard.check_draft_for_serving(cfg, draft, target_config_json(target))
    except guard.ServingRefused as exc:
        if cfg.serve.guard:
            raise
        flags.append(f"serve: guard off, serving anyway a draft the guard refuses: {exc}")
        return read_json(draft / "config.json", "draft config")["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def _prompts(cfg: RootConfig, target: Path) -> list[list[int]]:
    """The first validation conversations' prompts, as the target's tokenizer renders them: serve.prompts for the
    timed passes, serve.accept_prompts for the per-request count, whichever is more. A prompt needs no states, so
    they may run past data.max_val_conversations (the conversations extract, train and eval use), further along the
    same split: its first conversations are theirs."""
    tokenizer = load_tokenizer(target, cfg.target.trust_remote_code, cfg.data.chat_template)
    n = max(cfg.serve.prompts, accept_prompts(cfg))
    data = copy.copy(cfg.data)
    data.max_val_conversations = max(n, data.max_val_conversations)
    _, val_convs = conversations(data, cfg.seed)
    if len(val_convs) < n:
        raise ConfigError(
            f"serve.prompts={cfg.serve.prompts}, serve.accept_prompts={cfg.serve.accept_prompts}: the data set's "
            f"validation split has {len(val_convs)} conversations; ask for at most that many"
        )
    return [prompt_ids(tokenizer, c, cfg.data.max_seq_len) for c in val_convs[:n]]


def _measure_servers(
    cfg: RootConfig, plan, tracker, compute: Compute, paths: tuple[Path, Path], prompts, keys, flags: list[str]
) -> tuple[dict[str, dict[str, Any]], dict[str, bool], dict | None]:
    """Each server's measurement (`measure`: cached per key, else started and measured), whether this run
    started it, and the engine's own loader check on the draft (None where it has none).

    The loader check (the engine's own loader on the draft, where it has one: vLLM's; nothing it reads and drops,
    nothing unloaded, every runner feeding the draft the states it was trained on) is a function of the draft, the
    target's config and the engine as installed, all in the speculative passes' key: where those passes are cached,
    so is it. It runs beside the baseline server's start-up (a CPU process of its own; the baseline never depends
    on the draft) and ends before the baseline's first request; its verdict comes before the speculative server's
    first request.

    On a machine without GPUs, where both servers are to be measured, the speculative server starts beside the
    baseline's (`together`): a start-up there is mostly Python importing the engine on one core, and both are
    healthy before the baseline's first timed request, so neither's passes share the CPUs with a start-up. On GPUs
    they start one after the other: a starting server sizes its KV cache from the device memory it finds free."""
    s, (target, draft) = cfg.serve, paths
    engine = engines.get(s.engine, engines.SERVE)
    out = plan.dir("serve")
    trained = draft_export.provenance(draft).get("aux_layers")
    spec_cached = cached_record(cfg, "speculative", keys["speculative"]) or {}
    pool = ThreadPoolExecutor(max_workers=1)
    check = pool.submit(
        (lambda: spec_cached["load_check"])
        if "load_check" in spec_cached
        else (lambda: engine.check_draft(cfg, target, draft, trained))
    )
    if s.resources.gpus_per_node:
        # On GPUs a starting server sizes its KV cache from the device memory it finds free; the check's process
        # (vLLM's engine config and loader, building on the CPU) is not proven never to open a device context, so
        # there it ends before any server starts: seconds beside a start-up of minutes.
        check.result()
    run = (tracker.run_id, plan.run_dir)
    servers: dict[str, dict[str, Any]] = {}
    started: dict[str, bool] = {}
    together = not s.resources.gpus_per_node and all(_to_measure(cfg, m, keys[m]) for m in keys)
    spec = server_process(cfg, "speculative", target, draft, out, compute) if together else None

    def baseline_ready() -> None:  # the loader check's verdict, and the speculative server up where it started too
        check.result()
        if spec is not None:
            spec.wait_healthy()

    try:
        if spec is not None:
            spec.launch()
        servers["baseline"] = measure(
            cfg, run, "baseline", keys["baseline"], started,
            lambda have: run_server(cfg, "baseline", target, None, prompts, out, compute, have, ready=baseline_ready),
        )  # fmt: skip
        loaded = check.result()
        _refuse_or_flag(cfg, draft, loaded, flags)
        servers["speculative"] = measure(
            cfg, run, "speculative", keys["speculative"], started,
            lambda have: run_server(cfg, "speculative", target, draft, prompts, out, compute, have, launched=spec)
            | {"load_check": loaded},
        )  # fmt: skip
    finally:
        if spec is not None:  # measured (stopped already), or not needed after all: another run measured it first
            spec.stop()
        pool.shutdown()
        for mode in ("baseline", "speculative"):
            log = out / f"{mode}_server.log"
            if log.exists():
                tracker.artifact(log, "serve")
    return servers, started, loaded


def _compared(cfg: RootConfig, servers: dict[str, dict[str, Any]], flags: list[str]) -> dict[str, Any]:
    """Speed and outputs side by side per concurrency level: the first level's figures, the greedy outputs'
    agreement (exact in float32 on the reference engine, else held to serve.greedy_token_tolerance), and every
    level's row."""
    s = cfg.serve
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
    result: dict[str, Any] = {k: head[k] for k in ("baseline_tok_s", "spec_tok_s", "speedup", "accept_length")}
    result |= {k: v for k, v in head.items() if k.endswith(("ttft_mean_s", "itl_mean_s"))}
    return result | {
        "greedy_outputs_identical": identical,
        "greedy_differing_token_rate": worst,
        "greedy_check": "exact" if exact else f"tolerance {s.greedy_token_tolerance:g}",
        "decoding": GREEDY,
        "per_concurrency": per_concurrency,
    }


def _how_measured(
    cfg: RootConfig, installed: str | None, servers: dict, started: dict[str, bool], keys: dict, run_id: str
) -> dict[str, Any]:
    """The engine that measured and its version, which passes this run measured and who measured the others (a
    sweep's points share one baseline), each started server's seconds (start-up, warm-up, measurement), the keys."""
    s = cfg.serve
    pinned, rules = engines.engine_version(s), engines.id_rules(s)
    result: dict[str, Any] = {
        "engine": s.engine,
        "engine_version": servers["speculative"]["server_info"].get("version") or installed or pinned,
        "id_rules": f"{rules} ({pinned}, installed)" if installed else rules,
    }
    if s.fallback_reason:
        result["engine_fallback"] = s.fallback_reason
    result["servers_started"] = started
    result["server_seconds"] = {mode: servers[mode]["seconds"] for mode in servers if started[mode]}
    result["measured_by"] = {mode: servers[mode]["measured_by"] for mode in servers}
    result["serve_keys"] = keys
    elsewhere = measured_elsewhere(servers["baseline"]["measured_by"], run_id, hardware(s.resources.gpus_per_node > 0))
    if elsewhere:
        result["baseline_from"] = elsewhere
    apart = measured_apart(servers)
    if apart:
        result["passes_apart"] = apart
    return result


def _engine_counts(cfg: RootConfig, loaded: dict | None, servers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the engine itself reports: its loader's verdict on the draft, the accepted tokens per position (from
    the first pass's histogram or the server's own), and the serve cycle's profile where it has one (the reference
    engine's phases, mean ms each)."""
    result: dict[str, Any] = {}
    if loaded is not None:
        result[f"{cfg.serve.engine}_load_check"] = {
            k: loaded[k] for k in ("model_class", "unused", "missing", "runners", "fed", "runner_here")
        }
    spec_head = servers["speculative"]["runs"][0]
    state = (servers["speculative"]["server_info"].get("internal_states") or [{}])[0]
    histogram = spec_head.get("accept_histogram") or state.get("spec_accept_histogram")
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
    for mode in ("baseline", "speculative"):
        for phase, ms in (servers[mode]["server_info"].get("phase_ms") or {}).items():
            result[f"{mode}_{phase}_ms"] = ms
    return result


def _on_eval_prompts(cfg: RootConfig, plan, counts: list[list[int]] | None) -> dict[str, Any]:
    """The served accept length over the prompts eval predicts it on (the first eval.prompts of those counted, no
    more than data.max_val_conversations, as eval takes them; where the count reached that far and eval ran), with
    its interval: the figure held to eval's."""
    n = min(cfg.eval.prompts, cfg.data.max_val_conversations)
    if not counts or len(counts) < n or not (plan.dir("eval") / "manifest.json").exists():
        return {}
    on = accept_interval(counts[:n])
    if not on:
        return {}
    return {
        "accept_length_eval_prompts": on["accept_length_counted"],
        "accept_length_eval_prompts_ci95": on["accept_length_ci95"],
    }


def _against_eval(cfg: RootConfig, plan, accept_length: float, flags: list[str]) -> dict[str, Any]:
    """The served accept length (over eval's own prompts where the count covers them, else over the counted
    requests, else the first timed pass's) against eval's expected one, where eval ran: apart by more than
    serve.accept_length_tolerance, serving feeds the draft differently from the standalone eval. Eval's is over the
    first eval.prompts validation prompts, counted as the engines count a request: its tokens over its verify
    passes."""
    s = cfg.serve
    eval_manifest = plan.dir("eval") / "manifest.json"
    if not eval_manifest.exists():
        return {}
    expected = EvalResult.from_dict(read_json(eval_manifest, "eval manifest")["result"]).expected_accept_length
    result: dict[str, Any] = {"eval_expected_accept_length": expected}
    if expected and accept_length:
        rel = abs(accept_length - expected) / expected
        result["accept_length_rel_diff"] = rel
        if rel > s.accept_length_tolerance:
            flags.append(
                f"serve: served accept length {accept_length:.3f} differs from eval's expected "
                f"{expected:.3f} by {rel:.1%} (> serve.accept_length_tolerance={s.accept_length_tolerance:.0%}): "
                "serving feeds the draft differently from the standalone eval (layer ids, capture points, dtype)"
            )
    return result


def _record(plan, tracker, out: Path, result: ServeResult, servers: dict[str, dict[str, Any]]) -> None:
    """The result in MLflow (who measured each server, the metrics, the mismatch tag), serve.json with each
    server's passes (less their token ids), and the manifest, last."""
    tracker.tags(
        {f"serve.{mode}_measured_by": ", ".join(m["mlflow_run_id"] for m in servers[mode]["measured_by"])
         for mode in servers}
    )  # fmt: skip
    tracker.stage_result("serve", result)
    tracker.tags({"serve.mismatch": str(result.mismatch).lower()})
    detail = {
        "result": result.to_dict(),
        "servers": {
            m: {k: v for k, v in srv.items() if k != "runs"}
            | {"runs": [{k: v for k, v in r.items() if k != "output_ids"} for r in srv["runs"]]}
            for m, srv in servers.items()
        },
    }
    write_json(out / "serve.json", detail)
    write_manifest(out, {"stage": "serve", "key": plan.stage_keys["serve"], "result": result.to_dict()})
    for flag in result.mismatch_flags:
        print(f"[serve] MISMATCH: {flag}")
