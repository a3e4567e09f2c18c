"""The pipeline: plans the four stages, runs them as jobs, and records one MLflow run for the whole.

`make_plan` is pure (no model, no job, no MLflow): it names every stage's folder, cache key, resources and the
layer ids each stage will use in its own convention, which is what `dry_run=true` prints. `run_pipeline`
executes a plan.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import json
import math
import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from omegaconf import OmegaConf

from orchestrator import compute as compute_mod
from orchestrator import engines, preflight, results, runner, tracking
from orchestrator.artifacts import CODE_VERSION, MANIFEST, file_sha256, stable_hash, write_json
from orchestrator.config import (
    STAGES,
    ConfigError,
    RootConfig,
    captured_layers,
    tasks_per_node,
    world_size,
)
from orchestrator.data import data_identity
from orchestrator.estimates import extract_storage, storage_terms, stream_cost
from orchestrator.states import stream as stream_mod
from orchestrator.targets import target_dir, tiny_weights_source, weights_fingerprint

# The stages whose output is a pure function of their key: kept under outputs/cache/<stage>/<key> and reused by every
# run and sweep point with that key. Serve measures timings, which are not.
CONTENT_ADDRESSED = ("extract", "train", "eval")


# serve.* that decides no measurement: checks and their tolerances, waits, where the engine lives (its installed
# version is in the key instead), how many passes (more are added to the cached ones), and the pins, which the
# installed version must equal
SERVE_DECIDES_NOTHING = (
    "python", "fallback", "fallback_reason", "repeats", "startup_timeout_s", "request_timeout_s", "guard", "force",
    "accept_length_tolerance", "greedy_token_tolerance", "sglang_version", "vllm_version", "startup_estimate_min",
)  # fmt: skip
# serve.* that only the speculative server reads
SERVE_SPECULATIVE_ONLY = (
    "layers", "num_steps", "eagle_topk", "num_draft_tokens", "accept_prompts", "accept_concurrency",
)  # fmt: skip


@dataclass
class Plan:
    run_dir: str
    target_dir: str
    stage_dirs: dict[str, str]
    stage_keys: dict[str, str]
    tracking_uri: str
    stages: list[dict[str, Any]] = field(default_factory=list)
    # Set by a layer search: where the trial's training reports to the study's pruner (orchestrator/pruning.py).
    search_trial: dict[str, Any] | None = None

    def dir(self, stage: str) -> Path:
        return Path(self.stage_dirs[stage])


def _subtree(cfg: RootConfig, name: str) -> dict[str, Any]:
    """What of a config node decides its stage's output: not where it runs, but what it computes in (resolved,
    so that `auto` on a GPU job and on a CPU job key different outputs)."""
    tree = asdict(getattr(cfg, name))
    resources = tree.pop("resources", None)
    tree.pop("collective_timeout_min", None)  # how long to wait for a peer decides nothing computed
    if "precision" in tree and resources is not None:
        tree["precision"] = compute_mod.resolve_precision(tree["precision"], resources["gpus_per_node"])
    return tree


def stage_keys(cfg: RootConfig) -> dict[str, str]:
    """Cache keys: a hash of what determines each stage's output, chained through its upstream keys."""
    target = _subtree(cfg, "target") | {"seed": cfg.seed}
    if cfg.target.quantization is None:  # the keys of runs made before the key existed stay the same
        target.pop("quantization")
    if cfg.target.path:  # a real checkpoint's weights as they are now; a tiny one's are its recipe's (above)
        target["weights"] = weights_fingerprint(Path(cfg.target.path))
    elif cfg.target.tiny is not None:  # ... and where they come from: the kept build's, or this machine's
        target["tiny"].pop("rebuild")
        target |= tiny_weights_source(cfg.target, cfg.seed)
    extract = _subtree(cfg, "extract")
    extract["layers"] = captured_layers(cfg)  # what is captured decides the output, however it is split
    extract.pop("extra_layers")
    extract.pop("max_bytes")  # a budget, not an input: the same shards whatever it is
    extract.pop("force")  # how, not what: the same shards again
    extract.pop("python")  # where vLLM lives; its version is the engine's (below)
    for key in ("startup_timeout_s", "request_timeout_s", "write_timeout_s", "engine_restarts"):
        extract.pop(key)  # how long to wait for the engine, and how often to start it again, decide nothing computed
    extract = engines.get(cfg.extract.engine, engines.CAPTURE).capture_key(cfg, extract)
    if cfg.train.states == "stream":  # the train split's shards hold its token ids alone
        extract["train_states"] = "stream"
    data = _subtree(cfg, "data")
    # a user's file edited in place is another data set: its content, not its path, keys the extraction
    data["file_sha256"] = [file_sha256(Path(f)) for f in [*cfg.data.train_files, *cfg.data.val_files]]
    if cfg.data.name == "hf":  # a data set's files, or a hub name's revision (orchestrator.data.data_identity)
        data["hf"] = data_identity(cfg.data)
    else:  # data=hf's keys, at their defaults elsewhere: the keys of runs made before they existed stay the same
        for key in ("path", "subset", "data_files", "revision", "train_split", "val_split", "column", "streaming"):
            data.pop(key)
    if cfg.data.chat_template is not None:  # the template's text renders the sequences, not where it lies
        data["chat_template"] = file_sha256(Path(cfg.data.chat_template))
    else:  # the target's own template is part of the target's identity
        data.pop("chat_template")
    data.pop("min_loss_fraction")  # a check, not an input
    if not cfg.data.regenerate.enabled:  # the settings of a regeneration that does not run decide nothing
        data["regenerate"] = {"enabled": False}
    else:
        if cfg.data.regenerate.turns == 1:  # the first turn alone: the keys of runs made before turns existed stay
            data["regenerate"].pop("turns")
        if cfg.data.regenerate.top_p == 1.0:  # the whole distribution: the keys of runs made before top_p stay
            data["regenerate"].pop("top_p")
    keys: dict[str, str] = {}
    keys["extract"] = stable_hash(
        {"target": target, "data": data, "extract": extract, "seed": cfg.seed, "code": CODE_VERSION["extract"]}
    )
    if cfg.data.regenerate.enabled:
        # The target's answers: which states an extraction captures, and whether it stores the train split's, decide
        # nothing of them. Another extraction of the same data by the same target (a layer search's union of layers,
        # a streamed train split) reads them instead of generating them again (stages/extract.py).
        answers = {k: v for k, v in extract.items() if k not in ("layers", "train_states")}
        keys["regenerated"] = stable_hash(
            {"target": target, "data": data, "extract": answers, "seed": cfg.seed, "code": CODE_VERSION["extract"]}
        )
    train = _subtree(cfg, "train")
    train.pop("stream")  # how the states travel (buffer, spool, timeout), not what they are
    if cfg.train.states == "offline":  # the keys of drafts trained before streaming existed stay the same
        train.pop("states")
    if cfg.train.from_draft is None:  # the keys of drafts trained before imports existed stay the same
        train.pop("from_draft")
    else:  # an imported draft is its files' content, not its folder's name
        folder = Path(cfg.train.from_draft)
        train["from_draft"] = {f.name: file_sha256(f) for f in sorted(folder.iterdir()) if f.is_file()}
    keys["train"] = stable_hash(
        {"extract": keys["extract"], "draft": _subtree(cfg, "draft"), "train": train, "code": CODE_VERSION["train"]}
    )
    # Eval runs the draft as serve.engine reads it: that engine's id rule and a deliberate serve.layers decide the
    # states it is fed; the rest of serve (its prompts, its servers) decides nothing eval computes.
    served = {"engine": cfg.serve.engine, "id_rules": engines.id_rules(cfg.serve), "layers": list(cfg.serve.layers)}
    ev = _subtree(cfg, "eval")
    if cfg.eval.engine == "hf":  # the keys of evals run before eval engines were chosen stay the same
        ev.pop("engine")
    else:  # the engine's version computes the live target's states and tokens
        ev["engine_version"] = engines.get(cfg.eval.engine).version(cfg.serve)
    keys["eval"] = stable_hash({"train": keys["train"], "eval": ev, "served": served, "code": CODE_VERSION["eval"]})
    keys["serve"] = stable_hash(
        {"train": keys["train"], "serve": _subtree(cfg, "serve"), "code": CODE_VERSION["serve"]}
    )
    # The serving measurements, less what only the job knows (the engine's installed version, the prompts' token
    # ids; stages/serve.py adds them): the baseline is the target served as configured, whatever the draft; the
    # speculative passes are that with the draft.
    serve = {k: v for k, v in _subtree(cfg, "serve").items() if k not in SERVE_DECIDES_NOTHING}
    spec = {k: serve.pop(k) for k in SERVE_SPECULATIVE_ONLY}
    # unlike what a stage computes, its timings depend on where it runs: the devices and CPUs it has
    serve["resources"] = {k: v for k, v in asdict(cfg.serve.resources).items() if k not in ("mem_gb", "timeout_min")}
    keys["serve_baseline"] = stable_hash({"target": target, "serve": serve, "code": CODE_VERSION["serve"]})
    keys["serve_speculative"] = stable_hash({"baseline": keys["serve_baseline"], "train": keys["train"], "spec": spec})
    return keys


def stage_layer_ids(cfg: RootConfig, stage: str) -> dict[str, Any]:
    """The layer ids a stage uses, in that stage's own convention."""
    n = cfg.target.num_hidden_layers
    if stage == "extract":  # in the capture engine's convention
        return engines.get(cfg.extract.engine, engines.CAPTURE).capture_ids(cfg, captured_layers(cfg))
    if stage == "train":
        return {"convention": "canonical", "aux_layers": list(cfg.train.layers)}
    engine = f"{cfg.serve.engine} ({engines.id_rules(cfg.serve)} rules, family {cfg.target.family})"
    if stage == "eval":
        return {
            "convention": "draft config ids, read as serving reads them",
            "engine": engine,
            "eagle_aux_hidden_state_layer_ids": preflight.serve_ids(cfg, cfg.eval.layers),
        }
    ids = preflight.serve_ids(cfg, cfg.serve.layers)
    return {
        "convention": engine,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "captures_canonical": engines.from_engine_ids(
            cfg.serve.engine, ids, n, cfg.target.family, engines.engine_version(cfg.serve)
        ),
    }


def print_serve_commands(cfg: RootConfig, plan: Plan) -> None:
    """The dry run: the serve job's two server commands (the port is the job's), each checked by the serving engine's
    own parser where its environment has one (SGLang's `ServerArgs`); a command it refuses fails the dry run."""
    engine = engines.get(cfg.serve.engine, engines.SERVE)
    for mode, draft in (("baseline", None), ("speculative", plan.dir("train") / "draft")):
        command = engines.server_command(cfg, Path(plan.target_dir), draft, 30000)
        print(f"[serve] {mode} server: {shlex.join(command)}")
        parsed = engine.check_command(cfg, command)
        print(f"[serve] {engine.name}'s parser in serve.python {'accepts' if parsed else 'is not there to check'} it")


def print_regenerate_command(cfg: RootConfig, plan: Plan) -> None:
    """The dry run: the server the extract job starts to regenerate the answers (data.regenerate.engine=server with
    no url: the serve stage's command without a draft, on a free port), checked by the serving engine's own parser
    where its environment has one; or the endpoint it is given."""
    from orchestrator.families import served_sampling

    r = cfg.data.regenerate
    if not r.enabled:
        return
    temperature, top_p, source = served_sampling(cfg.target)
    how = "greedy" if r.temperature == 0 else f"temperature {r.temperature}, top_p {r.top_p}"
    why = source if (r.temperature, r.top_p) == (temperature, top_p) else "data.regenerate.temperature and top_p"
    print(f"[regenerate] the target's answers are decoded {how}: {why}")
    if r.engine != "server":
        return
    turns = "every turn in turn" if r.turns is None else f"{r.turns} turn(s)"
    if r.url is not None:
        print(f"[regenerate] answers ({turns}, {r.max_new_tokens} new tokens at most) from data.regenerate.url={r.url}")
        return
    engine = engines.get(cfg.serve.engine, engines.SERVE)
    command = engines.server_command(cfg, Path(plan.target_dir), None, 30000)
    print(f"[regenerate] the extract job serves the target ({turns}, {r.max_new_tokens} new tokens at most): "
          f"{shlex.join(command)}")  # fmt: skip
    parsed = engine.check_command(cfg, command)
    print(f"[regenerate] {engine.name}'s parser in serve.python {'accepts' if parsed else 'is not there to check'} it")


def make_plan(cfg: RootConfig, run_dir: Path) -> Plan:
    run_dir = Path(run_dir).resolve()
    keys = stage_keys(cfg)
    cache = cfg.outputs / "cache"
    dirs = {
        "extract": cache / "extract" / keys["extract"],
        "train": cache / "train" / keys["train"],
        "eval": cache / "eval" / keys["eval"],
        "serve": run_dir / "serve",
    }
    if "regenerated" in keys:  # the target's answers, which every extraction of the same data shares
        dirs["regenerated"] = cache / "regenerated" / keys["regenerated"]
    plan = Plan(
        run_dir=str(run_dir),
        target_dir=str(target_dir(cfg)),
        stage_dirs={k: str(v) for k, v in dirs.items()},
        stage_keys=keys,
        tracking_uri=tracking.tracking_uri(cfg.tracking.uri, cfg.outputs),
    )
    inputs = {
        "extract": {"target": plan.target_dir},
        "train": {"extract": str(dirs["extract"])},
        "eval": {
            "draft": str(dirs["train"] / "draft"),
            "target": plan.target_dir,
            "train_metrics": str(dirs["train"] / MANIFEST),
        },
        "serve": {"draft": str(dirs["train"] / "draft"), "target": plan.target_dir, "eval": str(dirs["eval"])},
    }
    for stage in cfg.stages:
        plan.stages.append(
            {
                "stage": stage,
                "job_name": f"{cfg.run_name}-{stage}",
                "key": keys[stage],
                "resources": asdict(getattr(cfg, stage).resources) | {"tasks_per_node": tasks_per_node(cfg, stage)},
                "world_size": world_size(cfg, stage),
                "precision": compute_mod.resolve_precision(
                    getattr(cfg, stage).precision, getattr(cfg, stage).resources.gpus_per_node
                ),
                "inputs": inputs[stage],
                "output": str(dirs[stage]),
                "cached": (dirs[stage] / MANIFEST).exists()
                and stage in CONTENT_ADDRESSED
                and not (stage == "extract" and cfg.extract.force),
                "layer_ids": stage_layer_ids(cfg, stage),
            }
            | ({"storage": extract_storage(cfg)} if stage == "extract" else {})
            | ({"stream": stream_cost(cfg)} if stage == "train" and cfg.train.states == "stream" else {})
        )
    return plan


def serve_stage():
    """orchestrator.stages.serve, imported when asked (it imports the engines' clients)."""
    return importlib.import_module("orchestrator.stages.serve")


def run_stage(stage: str, cfg: RootConfig, plan: Plan, run_id: str, finalize: bool = False) -> dict[str, Any]:
    """Job entry point: runs one stage, logging to the pipeline's MLflow run. A failure marks the run failed
    (with the error) from inside the job, so that it shows even when nobody waits on the job; the last stage
    of the pipeline also writes the summary and closes the run. Returns the stage's result as its manifest stores
    it (`{}` on a rank other than 0): what the job hands back is plain data."""
    import torch

    module = importlib.import_module(f"orchestrator.stages.{stage}")
    node = getattr(cfg, stage)
    # Before any parallel operation: torch's threads take the mode from the thread that starts them.
    compute_mod.flush_denormals()
    # The job's CPUs decide torch's thread count, not the machine it lands on: float reductions, and so the
    # stage's numbers, are the same on a laptop, a local job and a Slurm job with the same resources.
    torch.set_num_threads(node.resources.cpus_per_task)
    tracker = tracking.Tracker(plan.tracking_uri, run_id, spool=Path(plan.run_dir) / tracking.SPOOL)
    started = time.time()
    compute = None
    try:
        compute = compute_mod.setup(
            node.precision, node.resources.gpus_per_node, node.collective_timeout_min, f"{stage}.resources"
        )
        if compute.is_main:
            tracker.params({f"{stage}.{k}": v for k, v in tracking.compute_params(compute.describe()).items()})
        result = module.run(cfg, plan, tracker, compute)
        if compute.is_main:
            seconds = time.time() - started
            tracker.metrics({"seconds": seconds}, prefix=f"{stage}/")
            # this run's own record of the stage's time (its manifest is shared with every run of the same key)
            write_json(Path(plan.run_dir) / STAGE_SECONDS / f"{stage}.json", {"seconds": round(seconds, 3)})
            if finalize:
                finish(cfg, plan, tracker)
    except BaseException as exc:
        rank = f" (rank {compute.rank})" if compute and compute.distributed else ""
        if compute is not None:
            compute.close(failed=True)  # peers waiting on this rank in a collective fail now, not at the timeout
            compute = None
        tracker.fail(f"stage {stage}{rank}: {type(exc).__name__}: {exc}")
        raise
    finally:
        if compute is not None:
            compute.close()
    return result.to_dict() if result is not None else {}


def finish(cfg: RootConfig, plan: Plan, tracker: tracking.Tracker) -> dict[str, Any]:
    """Writes `summary.json` from the stages' manifests, gives the MLflow run the metrics of its cached stages
    and its note, and closes it."""
    typed: dict[str, results.StageResult] = {}
    for entry in plan.stages:
        stage = entry["stage"]
        manifest = plan.dir(stage) / MANIFEST
        typed[stage] = results.load(
            stage, json.loads(manifest.read_text()).get("result", {}) if manifest.exists() else {}
        )
        if entry["cached"]:
            tracking.relog_cached(tracker, stage, plan.dir(stage), typed[stage])
            typed[stage].cached = True
    summary = build_summary(cfg, plan, typed, tracker.run_id)
    summary["seconds"] = stage_seconds(plan)
    summary["mlflow_url"] = tracker.url()
    write_json(Path(plan.run_dir) / "summary.json", summary)
    tracker.artifact(Path(plan.run_dir) / "summary.json")
    tracker.tags({"mismatch": str(bool(summary["mismatch_flags"])).lower()})
    tracker.note(tracking.run_note(summary))
    tracker.finish()
    return summary


STAGE_SECONDS = "seconds"  # <run_dir>/seconds/<stage>.json: each stage's time in its job, written by the job


def stage_seconds(plan: Plan) -> dict[str, float | str]:
    """Each stage's time in its job (from the run's folder), or "cached" where the run took it from the cache."""
    out: dict[str, float | str] = {}
    for entry in plan.stages:
        path = Path(plan.run_dir) / STAGE_SECONDS / f"{entry['stage']}.json"
        # a stage another run completed meanwhile (pipeline.run_pipeline) has no time of this run's
        out[entry["stage"]] = json.loads(path.read_text())["seconds"] if path.exists() else "cached"
    return out


def print_plan(plan: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"plan  ({plan.run_dir})")
    for col in ("stage", "job", "resources", "output", "layer ids (stage convention)"):
        table.add_column(col, overflow="fold")
    for s in plan.stages:
        r = s["resources"]
        res = (
            f"{r['nodes']}x{r['gpus_per_node']} GPU, {s['world_size']} rank(s), {s['precision']}, "
            f"{r['cpus_per_task']} CPU/task, "
            f"{r['mem_gb']} GB, {r['timeout_min']} min"
        )
        table.add_row(
            s["stage"],
            s["job_name"],
            res,
            s["output"] + (" (cached)" if s["cached"] else ""),
            json.dumps(s["layer_ids"]),
        )
    Console(width=200).print(table)
    for s in plan.stages:
        if "storage" in s:
            st = s["storage"]
            print(
                f"extract writes at most {st['max_bytes'] / 1e9:,.1f} GB: {storage_terms(st)} "
                f"({st['states_per_token']} states); extract.max_bytes="
                f"{st['limit_bytes'] / 1e9:,.1f} GB"
            )
        if s.get("stream"):
            print_stream_cost(s["stream"], s["resources"])


def print_stream_cost(st: dict[str, Any], resources: dict[str, Any]) -> None:
    """train.states=stream on paper (`estimates.stream_cost`): what the stream carries, what each choice of epochs
    costs, the link each side needs where its rate is estimated, and where the capture service runs."""
    print(
        f"train streams its states (train.states=stream; docs/streaming.md): {st['bytes_per_token']:,} bytes/token, "
        f"an epoch at most {st['epoch_tokens']:,} tokens = {st['epoch_bytes'] / 1e9:,.1f} GB through the stream, "
        f"none stored; the service runs ahead by {st['buffer_sequences']} sequences and {st['buffer_bytes']:,} bytes "
        "at most (train.stream.buffer_sequences, buffer_bytes)"
    )
    re, rp = st["recapture"], st["replay"]
    print(
        f"  {st['epochs']:g} epochs: capture every epoch = {re['capture_passes']:g} capture passes, 0 GB kept; "
        f"replay the first (train.stream.replay_bytes) = {rp['capture_passes']:.2f} passes, "
        f"{rp['bytes_kept'] / 1e9:,.1f} GB kept"
    )
    rates = []
    if "trainers_bytes_per_s" in st:
        rates.append(f"the trainers consume up to {st['trainers_bytes_per_s'] / 1e9:,.2f} GB/s")
    if "capture_bytes_per_s" in st:
        rates.append(
            f"the capture service delivers up to {st['capture_bytes_per_s'] / 1e9:,.2f} GB/s (its engine's rate x "
            f"{st['capture_ratio']:.2f}: {st['capture_ratio_source']})"
        )
    if rates:
        print("  link (train.stream.*_samples_per_s x data.max_seq_len tokens a sample): " + "; ".join(rates))
        for name, rate in st["links"]:
            print(f"    {name}: {rate / 1e9:,.2f} GB/s")
        if st["service_job"] and any(name.startswith("the spool's") for name, _ in st["links"]):
            print(
                "    the states cross the shared file system twice (train.stream.transport=file); "
                "train.stream.transport=mooncake sends them over the network once (docs/streaming.md#the-transport)"
            )
    else:
        print("  link: not priced (set train.stream.train_samples_per_s and train.stream.capture_samples_per_s)")
    if st["service_job"]:
        r = st["service_resources"]
        print(
            f"  capture service: a Slurm job of its own after extract, with extract.resources ({r['nodes']} node(s) x "
            f"{r['gpus_per_node']} GPU(s)); the train job ({resources['nodes']} node(s) x "
            f"{resources['gpus_per_node']} GPU(s)) starts once it has started (--dependency=after:)"
        )
    else:
        print(
            f"  capture service: beside rank 0 of the train job, on its node's devices ({resources['gpus_per_node']} "
            "GPU(s))"
        )


def print_train_time(cfg: RootConfig) -> None:
    """The training's time on paper (`estimates.train_time`), in allocations of the partition's longest job."""
    from orchestrator.estimates import train_time

    most = runner.site_max_time(cfg.cluster)[0] if cfg.cluster.kind == "slurm" else None
    tt = train_time(cfg, most)
    if tt is None:
        print("[train time] not priced (set train.stream.train_samples_per_s, a training GPU's samples/s)")
        return
    print(
        f"[train time] {tt['steps']:,} steps, {tt['samples']:,} samples, at most {tt['tokens'] / 1e9:,.2f} B tokens, "
        f"at {tt['samples_per_s']:,.2f} samples/s, paced by {tt['paced_by']}: {tt['hours']:,.1f} h, "
        f"{tt['gpu_hours']:,.0f} GPU-hours (the trainers and the capture service)"
    )
    if len(tt["allocations"]) > 1:
        print(f"[train time] {len(tt['allocations'])} allocations of at most {most} min, each resuming where the "
              "last stopped:")  # fmt: skip
        for i, a in enumerate(tt["allocations"], 1):
            print(f"  {i}: steps {a['steps'][0]:,}..{a['steps'][1]:,}, at most {a['tokens'] / 1e9:,.2f} B tokens, "
                  f"{a['hours']:,.1f} h")  # fmt: skip


def print_mask_preview(cfg: RootConfig, target: Path) -> None:
    """One training conversation rendered as extraction will render it: the fraction of its tokens the loss
    covers and the text it covers. A template whose mask is empty shows here, before any job."""
    from orchestrator import data, targets

    if "extract" not in cfg.stages:
        return
    if cfg.data.regenerate.enabled:
        print("[mask] the loss covers the target's own responses (data.regenerate.enabled=true)")
        return
    if not (target / "tokenizer_config.json").exists():
        print(f"[mask] no tokenizer at {target} yet (it is built by the extract stage): no sample rendered")
        return
    tokenizer = targets.load_tokenizer(target, cfg.target.trust_remote_code, cfg.data.chat_template)
    train, _ = data.conversations(cfg.data, cfg.seed)
    source = targets.template_source(target, cfg.data.chat_template)
    try:
        fraction, text = data.masked_text(tokenizer, train[0], source)
    except data.ChatTemplateError as exc:
        print(f"[mask] {exc}")
        return
    print(f"[mask] sample conversation (train[0], {len(train[0])} turns): {fraction:.1%} of its tokens are loss tokens")
    print(f"[mask] loss text: {text[:400]!r}" + (" ..." if len(text) > 400 else ""))
    if fraction < cfg.data.min_loss_fraction:
        print(
            f"[mask] below data.min_loss_fraction={cfg.data.min_loss_fraction}: extraction would refuse it ({source})"
        )


def check_data_rows(cfg: RootConfig, plan: Plan) -> None:
    """data=jsonl's every line parsed before an extract job reads them (one pass, nothing kept): a malformed line
    is refused here, naming its file and line."""
    from orchestrator import data

    if cfg.data.name != "jsonl" or not any(e["stage"] == "extract" and not e["cached"] for e in plan.stages):
        return
    try:
        count = data.check_rows(cfg.data)
    except data.DataFileError as exc:
        raise ConfigError(f"{exc} (data=jsonl, checked before any job)") from None
    print(f"[data] {count:,} conversations in data.train_files and data.val_files, every line parsed")


def write_run_files(cfg: RootConfig, plan: Plan) -> None:
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    write_json(run_dir / "plan.json", asdict(plan))


def run_pipeline(
    cfg: RootConfig, run_dir: Path, sweep_dir: Path | None = None, search_trial: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Submits the configured stage prefix as a chain of jobs. Local and debug runs block and return the
    summary (also in `<run_dir>/summary.json`); Slurm runs return once the chain is queued, unless
    `cluster.wait=true`. `search_trial`: the layer-search trial this run is (`orchestrator.pruning.SearchTrial`)."""
    begun = time.time()
    plan = make_plan(cfg, run_dir)
    plan.search_trial = search_trial
    if cfg.check:
        findings = preflight.run_checks(cfg, plan, cfg.check_draft)
        preflight.print_report(findings)
        bad = preflight.failures(findings)
        return {"check": True, "ok": not bad, "failures": [str(f) for f in bad]}
    memory = preflight.memory_findings(cfg, Path(plan.target_dir))
    found = preflight.config_findings(cfg)
    bad = preflight.failures(found + memory)
    if bad and not (not cfg.serve.guard and all(f.category == "layer ids" for f in bad)):
        raise preflight.PreflightError(bad)
    check_data_rows(cfg, plan)
    write_run_files(cfg, plan)
    print_plan(plan)
    for finding in memory:
        print(f"[memory] {finding.message}")
    if cfg.dry_run:
        for finding in found:  # each environment a job runs, what it holds, and the tokenizer loaded in each
            if finding.category in ("engine environment", "tokenizer"):
                print(f"[{finding.category}] {finding.message}")
        for finding in preflight.time_limit_findings(cfg):
            print(f"[time limits] {finding.message}")
        if "train" in cfg.stages:
            print_train_time(cfg)
        print_mask_preview(cfg, Path(plan.target_dir))
        if "extract" in cfg.stages:  # what each extract task runs, checked by the engine where it can
            print_regenerate_command(cfg, plan)
            engines.get(cfg.extract.engine, engines.CAPTURE).print_capture(cfg, plan)
        answers_eval = "eval" in cfg.stages and eval_in_service(cfg, list(cfg.stages))
        if cfg.train.states == "stream" and ("train" in cfg.stages or answers_eval):
            engines.get(cfg.extract.engine, engines.CAPTURE).print_stream(cfg, plan, answers_eval)
        if answers_eval:
            print("[eval] live target: the capture service that streams train's states answers eval after training "
                  "(the target is loaded once; docs/streaming.md#eval-through-the-service)")  # fmt: skip
        elif "eval" in cfg.stages:  # what the eval job runs as its live target, checked by the engine where it can
            engines.get(cfg.eval.engine, engines.CAPTURE).print_eval(cfg, plan)
        if "serve" in cfg.stages:
            print_serve_commands(cfg, plan)
        print(f"dry run: nothing submitted; plan written to {Path(plan.run_dir) / 'plan.json'}")
        return {"dry_run": True, "plan": asdict(plan)}

    tracking.check_reachable(plan.tracking_uri)  # before any job: a run that cannot record its results does not start
    parent = None
    if sweep_dir is not None:
        parent = tracking.sweep_parent_run(plan.tracking_uri, cfg.tracking.experiment, sweep_dir, cfg.run_name)
    tracker = tracking.start_pipeline_run(
        plan.tracking_uri,
        cfg.tracking.experiment,
        cfg.run_name,
        tracking.resolved_container(cfg),
        list(cfg.aux_layers),
        Path(plan.run_dir),
        parent_run_id=parent,
        cached=[e["stage"] for e in plan.stages if e["cached"]],
    )
    blocking = cfg.cluster.kind in ("local", "debug")
    job_seconds: dict[str, float] = {}  # blocking runs: each stage's job from submission to its end
    todo = [e for e in plan.stages if not e["cached"]]
    asks_service = eval_in_service(cfg, [e["stage"] for e in todo])  # eval asks the service training streams from
    jobs: list[tuple[str, Any]] = []
    dependency: str | None = None
    finalizer = None  # the job that writes the summary and closes the MLflow run, once submitted
    # the capture service this process started for a local run's training and eval (`_service_for_eval`); a Slurm
    # run's is a job of its own, which stops with its consumers
    service = None
    eval_cfg = None  # the config with which the eval job asks the capture service (`eval_in_service`)
    try:
        for entry in plan.stages:
            stage = entry["stage"]
            if entry["cached"]:
                print(f"[{stage}] cached: {entry['output']}")
                tracker.tags({f"{stage}.cached": "true"})
                continue
            if stage == "serve" and blocking and not jobs and serve_stage().passes_cached(cfg, plan):
                # both servers' passes are in the cache: the stage starts no server, only reads them; here, not in a
                # job (whose start-up, seconds, would be most of a warm run). Looked for only where no stage before
                # ran: after a stage's job, the serve job costs little more, and the look, seconds, delays it.
                print("[serve] every pass cached: the stage runs in this process, no job")
                submitted = time.time()
                run_stage(stage, cfg, plan, tracker.run_id)
                job_seconds[stage] = round(time.time() - submitted, 3)
                continue
            with _submission_lock(plan, stage, blocking):
                # Under the lock, another run's job for the same cached output is seen, or this run's is recorded
                # before the other looks: two runs (or two trials of a search) never both submit it. A blocking
                # run holds the lock until its job ends, so a second one waits, then finds the output complete.
                if (plan.dir(stage) / MANIFEST).exists() and not (stage == "extract" and cfg.extract.force):
                    print(f"[{stage}] completed by another run meanwhile: {entry['output']}")
                    entry["cached"] = True
                    tracker.tags({f"{stage}.cached": "true"})
                    continue
                in_flight = None if blocking else _in_flight(cfg, plan, stage)
                if in_flight:
                    print(f"[{stage}] already queued by another run: job {in_flight}")
                    dependency = in_flight
                    continue
                submitted = time.time()
                stage_cfg, after_start = cfg, None
                if stage in ("train", "eval") and blocking and asks_service:
                    # a local run's service, started here for its training and its eval
                    if service is None:
                        service, eval_cfg = _service_for_eval(cfg, plan, [e["stage"] for e in todo])
                    stage_cfg = eval_cfg
                if stage == "train" and own_stream_job(cfg):  # the capture service as a Slurm job of its own
                    # kept up for the eval job too
                    stream_job, stage_cfg = _submit_stream_service(cfg, plan, jobs, dependency, asks_service)
                    jobs.append(("stream", stream_job))
                    eval_cfg = stage_cfg if asks_service else None
                if stage == "eval" and eval_cfg is not None and not blocking:  # asks the service job (registered)
                    stage_cfg = eval_cfg
                joined_job = _joined_service_job(stage_cfg)  # the service's Slurm job: this run's, or a search's
                if stage == "train" and joined_job:
                    after_start = [joined_job]
                job = _submit_or_cancel(
                    stage,
                    jobs,
                    blocking,
                    cfg.cluster,
                    Path(plan.run_dir) / "jobs",
                    entry["job_name"],
                    getattr(cfg, stage).resources,
                    entry["resources"]["tasks_per_node"],
                    run_stage,
                    stage,
                    stage_cfg,
                    plan,
                    tracker.run_id,
                    entry is todo[-1],
                    dependency=[dependency] if dependency else None,
                    after_start=after_start,
                    resumes=stage in runner.RESUMING,
                )
                finalizer = job if entry is todo[-1] else finalizer
                if after_start:  # the service watches the job that will read from it
                    stream_mod.note_job(Path(stage_cfg.train.stream.join), Path(plan.run_dir).name,
                                        Path(plan.run_dir) / "jobs", job.job_id)  # fmt: skip
                evaluating = eval_cfg is not None or (
                    joined_job and _registered(stage_cfg, stream_mod.eval_consumer(plan))
                )
                if stage == "eval" and evaluating and not blocking:  # and the eval job that will ask it
                    stream_mod.note_job(Path(stage_cfg.train.stream.join), stream_mod.eval_consumer(plan),
                                        Path(plan.run_dir) / "jobs", job.job_id)  # fmt: skip
                jobs.append((stage, job))
                print(f"[{stage}] submitted job {job.job_id} ({cfg.cluster.kind})")
                if not blocking:
                    dependency = job.job_id
                    _record_in_flight(cfg, plan, stage, job.job_id)
                if blocking:
                    runner.wait(job, stage)
                    job_seconds[stage] = round(time.time() - submitted, 3)
        if not jobs:
            summary = finish(cfg, plan, tracker)
            if job_seconds:  # a stage ran in this process (serve, every pass cached): its time and the run's
                summary["job_seconds"] = job_seconds
                summary["total_seconds"] = round(time.time() - begun, 3)
                write_json(Path(plan.run_dir) / "summary.json", summary)
        elif blocking or cfg.cluster.wait:
            for stage, job in jobs:
                # Blocking runs followed each log as the job ran; a second follow would print it again.
                runner.wait(job, stage, follow_log=not blocking)
            if finalizer is None:  # the last stage was completed by another run meanwhile
                summary = finish(cfg, plan, tracker)
            else:
                summary = json.loads((Path(plan.run_dir) / "summary.json").read_text())
            if blocking:  # the job's overhead beside the stage's own time: start-up, imports, submitit's pickles
                summary["job_seconds"] = job_seconds
                summary["total_seconds"] = round(time.time() - begun, 3)
                write_json(Path(plan.run_dir) / "summary.json", summary)
        else:
            return _report_submitted(plan, jobs, tracker.run_id, tracker.url())
    except runner.StageFailed as exc:
        tracker.fail(str(exc))
        raise
    except BaseException as exc:
        tracker.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if service is not None:
            service.stop()
    print_summary(summary)
    return summary


def eval_in_service(cfg: RootConfig, stages: list[str]) -> bool:
    """Whether this run's eval asks the capture service that streams its training's states, rather than loading the
    target again: train.states=stream with eval to run, by the capture engine (eval.engine = extract.engine), one
    that can answer it (`Capturing.answers_eval`: HF's always, vLLM's where it captures the served layers), where
    the run owns its service (not one it joins)."""
    capture = engines.get(cfg.extract.engine, engines.CAPTURE)
    return (
        cfg.train.states == "stream"
        and cfg.train.stream.join is None
        and "eval" in stages
        and cfg.eval.engine == cfg.extract.engine
        and capture.answers_eval(cfg)
    )


def _service_for_eval(cfg: RootConfig, plan: Plan, stages: list[str]):
    """The run's capture service, started by this process (it stops when this process ends): the training job reads
    its states from it (when it runs), then the eval job asks it for the live target. Returns the service and the
    config both jobs run with (`train.stream.join`)."""
    spool = stream_mod.spool_dir(cfg, Path(plan.run_dir) / "stream")
    spec = stream_mod.StreamSpec.of(cfg, plan, os.getpid())
    trainers = [Path(plan.run_dir).name] if "train" in stages else []
    service = stream_mod.CaptureService(spool, spec).start(consumers=trainers, evals=[stream_mod.eval_consumer(plan)])
    joined = copy.deepcopy(cfg)
    joined.train.stream.join = str(spool)
    return service, joined


def own_stream_job(cfg: RootConfig) -> bool:
    """Whether training's capture service runs as a Slurm job of its own (train.states=stream on Slurm, unless the
    training joins a service already running): the target's capture needs nodes of its own, as large as the
    extraction's (`extract.resources`), which the training's nodes are not."""
    return cfg.cluster.kind == "slurm" and cfg.train.states == "stream" and cfg.train.stream.join is None


def _submit_stream_service(cfg: RootConfig, plan: Plan, jobs: list, dependency: str | None, evals: bool = False):
    """The capture service as a job with the extraction's resources, after the extraction (it reads the token ids),
    and the training's config joining it (`train.stream.join`) as its one registered consumer. The training job
    waits for it to start (`--dependency=after:`), so that its GPUs never idle in the queue while the service's
    wait; the two are dependent jobs, not one heterogeneous job, because submitit submits one job per call, and a
    chain of dependent jobs is what the rest of the pipeline is. The service stops when its consumer unregisters,
    or gives no heartbeat for train.stream.stall_timeout_s (a trainer killed or cancelled). With `evals`, the eval
    job is registered too (`eval_in_service`), and the service answers it after the training, for as long as both
    jobs may run."""
    spool = stream_mod.spool_dir(cfg, plan.dir("train") / "stream")
    evaluating = [stream_mod.eval_consumer(plan)] if evals else []
    try:
        service = submit_stream_service(
            cfg, plan, spool, Path(plan.run_dir) / "jobs", [Path(plan.run_dir).name], evaluating, dependency
        )
    except Exception as exc:
        _cancel_queued(jobs)
        raise runner.SubmissionFailed(f"submitting the capture service failed: {exc}") from exc
    print(f"[stream] submitted the capture service as job {service.job_id} ({spool}); train starts once it has")
    joined = copy.deepcopy(cfg)
    joined.train.stream.join = str(spool)
    return service, joined


def submit_stream_service(
    cfg: RootConfig, plan: Plan, spool: Path, folder: Path, consumers: list[str], evals: list[str],
    dependency: str | None = None,
):  # fmt: skip
    """The capture service of `plan`'s extraction as a Slurm job of its own (`stream.serve_job`), with the
    extraction's resources for as long as its trainers (and evals) may run, its `consumers` and `evals` registered
    in `spool` first. Its job id goes in the spool (`stream.SERVICE_JOB`): a joining run's train job starts after it
    has started (`--dependency=after:`), and is watched by it in the queue (`stream.note_job`)."""
    stream_mod.prepare(spool, stream_mod.StreamSpec.of(cfg, plan, None), consumers=consumers, evals=evals)
    # the extraction's nodes, for as long as the training (and the eval) may run, and, with several trainers, as
    # long as the service waits for the last to declare its steps: they wait for the service, then read from it
    served_min = cfg.train.resources.timeout_min + (cfg.eval.resources.timeout_min if evals else 0)
    if len(consumers) > 1:
        served_min += math.ceil(cfg.train.stream.declare_timeout_s / 60)
    resources = dataclasses.replace(
        cfg.extract.resources, timeout_min=max(cfg.extract.resources.timeout_min, served_min)
    )
    ex = runner.executor(
        cfg.cluster, folder, f"{cfg.run_name}-stream", resources, 1, [dependency] if dependency else None, resumes=True
    )  # fmt: skip
    service = ex.submit(runner.Requeueable(), stream_mod.serve_job, str(spool))
    (spool / stream_mod.SERVICE_JOB).write_text(str(service.job_id))
    return service


def _registered(cfg: RootConfig, consumer: str) -> bool:
    return (Path(cfg.train.stream.join) / stream_mod.CONSUMERS / f"{consumer}.json").exists()


def _joined_service_job(cfg: RootConfig) -> str | None:
    """The Slurm job of the service this run joins (`train.stream.join`, a layer search's on Slurm), if it is one."""
    join = cfg.train.stream.join
    if cfg.cluster.kind != "slurm" or join is None or not (Path(join) / stream_mod.SERVICE_JOB).exists():
        return None
    return (Path(join) / stream_mod.SERVICE_JOB).read_text().strip()


def _cancel_queued(jobs: list[tuple[str, Any]]) -> list[str]:
    cancelled = []
    for queued, job in jobs:
        try:
            job.cancel(check=False)
            cancelled.append(f"{queued} (job {job.job_id})")
        except Exception as cancel_exc:  # say so, and go on cancelling the others
            print(f"[{queued}] could not cancel job {job.job_id}: {cancel_exc}")
    return cancelled


def _submit_or_cancel(stage: str, jobs: list[tuple[str, Any]], blocking: bool, *args, **kwargs):
    """`runner.submit`; when the cluster rejects it, this run's jobs queued before it are cancelled (and named):
    without this stage they would wait for nothing, or run for a chain that cannot finish."""
    try:
        return runner.submit(*args, **kwargs)
    except Exception as exc:
        if blocking or not jobs:
            raise
        cancelled = _cancel_queued(jobs)
        raise runner.SubmissionFailed(
            f"submitting stage {stage} failed: {exc}\n"
            f"cancelled this run's jobs queued before it: {', '.join(cancelled) or 'none'}"
        ) from exc


def _in_flight_record(plan: Plan, stage: str) -> Path | None:
    # Only content-addressed stages (shared between runs) can be in flight for another run.
    return plan.dir(stage) / ".job.json" if stage in CONTENT_ADDRESSED else None


@contextlib.contextmanager
def _submission_lock(plan: Plan, stage: str, blocking: bool) -> Iterator[None]:
    """Held while a run looks for another run's job of a shared (content-addressed) stage, submits its own and
    records it; a blocking (local) run holds it until its job ends. The lock is the OS's (fcntl), so a run that
    is killed releases it."""
    record = _in_flight_record(plan, stage)
    if record is None:
        yield
        return
    from filelock import FileLock, Timeout

    record.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(record) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"[{stage}] another run is computing {record.parent}: waiting for it (lock {lock.lock_file})", flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _in_flight(cfg: RootConfig, plan: Plan, stage: str) -> str | None:
    record = _in_flight_record(plan, stage)
    if record is None or not record.exists():
        return None
    info = json.loads(record.read_text())
    state = runner.job_state(cfg.cluster, Path(info["folder"]), info["job_id"])
    return info["job_id"] if state in runner.ACTIVE_STATES else None


def _record_in_flight(cfg: RootConfig, plan: Plan, stage: str, job_id: str) -> None:
    record = _in_flight_record(plan, stage)
    if record is not None:
        write_json(record, {"job_id": job_id, "folder": str(Path(plan.run_dir) / "jobs"), "run_dir": plan.run_dir})


def _report_submitted(plan: Plan, jobs: list, run_id: str, url: str) -> dict[str, Any]:
    submitted = {stage: job.job_id for stage, job in jobs}
    write_json(Path(plan.run_dir) / "jobs.json", submitted)
    print(f"submitted {len(jobs)} jobs: " + ", ".join(f"{s}={j}" for s, j in submitted.items()))
    print(f"  follow:  squeue -j {','.join(submitted.values())}    logs: {Path(plan.run_dir) / 'jobs'}")
    print(
        f"  results: MLflow run {url} ({plan.tracking_uri}); summary at {Path(plan.run_dir) / 'summary.json'} when done"
    )
    return {
        "submitted": submitted,
        "mlflow_run_id": run_id,
        "mlflow_url": url,
        "run_dir": plan.run_dir,
        "tracking_uri": plan.tracking_uri,
    }


def build_summary(cfg: RootConfig, plan: Plan, typed: dict[str, results.StageResult], run_id: str) -> dict[str, Any]:
    """The run's summary.json: each stage's result as its manifest stores it (with "cached" where the run took it
    from the cache), and every mismatch eval and serve flagged."""
    summary: dict[str, Any] = {
        "run_name": cfg.run_name,
        "aux_layers": list(cfg.aux_layers),
        "mlflow_run_id": run_id,
        "tracking_uri": plan.tracking_uri,
        "run_dir": plan.run_dir,
        "stages": {stage: result.to_dict() for stage, result in typed.items()},
    }
    last = STAGES.index(cfg.stages[-1])  # [eval] is skipped where stages=[extract, train, serve]
    summary["skipped"] = [s for s in STAGES[:last] if s not in cfg.stages]
    flags = []
    for stage in ("eval", "serve"):
        flags += (typed[stage].mismatch_flags or []) if stage in typed else []
    summary["mismatch_flags"] = flags
    return summary


def time_row(summary: dict[str, Any]) -> str:
    """Where the run's time went: each stage in its job (and the job as a whole, where the run waited for it), each
    server serve started (start-up, warm-up, measurement), and the run's total."""
    parts = []
    for stage, seconds in summary.get("seconds", {}).items():
        job = summary.get("job_seconds", {}).get(stage)
        parts.append(f"{stage} {seconds}" if seconds == "cached" else f"{stage} {seconds:.1f} s" + (
            f" (job {job:.1f} s)" if job is not None else ""
        ))  # fmt: skip
    serve = results.load("serve", summary.get("stages", {}).get("serve", {}))
    for mode, t in (serve.server_seconds or {}).items():
        count = f", count {t['count_s']:.1f} s" if "count_s" in t else ""
        parts.append(f"{mode} server: start {t['startup_s']:.1f} s, warm-up {t['warmup_s']:.1f} s, "
                     f"passes {t['measure_s']:.1f} s{count}")  # fmt: skip
    if "total_seconds" in summary:
        parts.append(f"total {summary['total_seconds']:.1f} s")
    return "; ".join(parts)


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"summary  (MLflow run {summary['mlflow_run_id']})")
    table.add_column("stage")
    table.add_column("result", overflow="fold")
    for stage, stored in summary["stages"].items():
        result = results.load(stage, stored)
        headline = result.headline or {
            k: v for k, v in result.to_dict().items() if isinstance(v, (int, float, str, bool))
        }
        ran = result.compute
        where = (
            f"  (on {ran['device']}, {ran['dtype']}, {ran['world_size']} rank{'s' if ran['world_size'] > 1 else ''})"
            if ran
            else ""
        )
        table.add_row(stage, ", ".join(f"{k}={_fmt(v)}" for k, v in headline.items()) + where)
    for stage in summary.get("skipped", []):
        table.add_row(stage, "skipped (not in stages): nothing measured, and nothing held to its figures")
    table.add_row("mismatch", "; ".join(summary["mismatch_flags"]) or "none")
    table.add_row("time", time_row(summary))
    Console(width=200).print(table)
    print(f"MLflow run: {summary['mlflow_url']}")
    if summary["tracking_uri"].startswith("sqlite:///"):
        print(
            f"  served by: .venv/bin/mlflow ui --backend-store-uri {summary['tracking_uri']} "
            "--host 127.0.0.1 --port 5000"
        )


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
