"""The only module that talks to MLflow.

One MLflow run per pipeline run. Stage jobs log into it by run id from their own processes (on Slurm, from
other machines), so everything here goes through an `MlflowClient` with an explicit tracking URI; the fluent
"active run" API is never used. A sweep's runs are children of one parent run (the `mlflow.parentRunId` tag).

What a researcher compares in the UI is decided here too: the run's name (`run_label`), its note
(`run_note`), the few params that decide a result (`CURATED_PARAMS`) and each stage's MLflow metric names
(`stage_metrics`, `train_step_metrics`, `train_val_metrics`), which docs/experiments.md#mlflow defines.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
# A tracking server that went away costs a write a few seconds, not MLflow's default minutes of retries: what
# could not be written is kept on disk and logged later (`Tracker`, `replay`).
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")

from filelock import FileLock  # noqa: E402
from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from orchestrator import results  # noqa: E402
from orchestrator.results import EvalResult, ServeResult, StageResult  # noqa: E402

PARAM_VALUE_LIMIT = 6000
BATCH_LIMIT = 100  # params/tags per log_batch call


def tracking_uri(uri: str | None, outputs: Path) -> str:
    """The configured URI, or a sqlite store under the outputs folder (never MLflow's cwd default)."""
    if uri:
        return uri
    outputs = Path(outputs).resolve()
    outputs.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{outputs / 'mlflow.db'}"


def artifact_root(uri: str, experiment: str) -> str | None:
    """Artifacts of a sqlite store live beside it (`<store dir>/mlartifacts/<experiment>`), one root per store,
    never in MLflow's default `./mlruns` under whatever folder the run started from. A server keeps its own."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///") :]).parent / "mlartifacts" / experiment).resolve().as_uri()


SPOOL = "tracking_spool.jsonl"


class Tracker:
    """Logs into one existing MLflow run by id.

    With a `spool` file, a write the tracking store refuses (a server gone away, a store that errors) does not
    fail the stage: it is appended to the spool, one JSON line per write, and the run's jobs go on. The next write
    that succeeds first replays the spool in order; `python -m orchestrator.tracking replay <run_dir>` does it by
    hand. Without one, a refused write raises."""

    def __init__(self, uri: str, run_id: str, spool: Path | None = None):
        self.uri = uri
        self.run_id = run_id
        self.client = MlflowClient(tracking_uri=uri)
        self.spool = Path(spool) if spool is not None else None

    def _write(self, kind: str, **payload: Any) -> None:
        if self.spool is None:
            _apply(self.client, self.run_id, kind, payload)
            return
        try:
            if self.spool.exists():
                replay_spool(self.spool, self.client)
            _apply(self.client, self.run_id, kind, payload)
        except Exception as exc:
            if not store_unavailable(exc):  # a write the store refuses on its merits fails as before
                raise
            first = not self.spool.exists()
            self.spool.parent.mkdir(parents=True, exist_ok=True)
            with self.spool.open("a") as f:  # one short line per write: appends of ranks do not interleave
                f.write(json.dumps({"run_id": self.run_id, "kind": kind, "payload": payload}) + "\n")
            if first:
                print(
                    f"[tracking] WARNING: {self.uri} refused a write ({type(exc).__name__}: {str(exc)[:200]}); the run "
                    f"goes on, and its records wait in {self.spool} (logged at the next write that succeeds, or by "
                    f"python -m orchestrator.tracking replay {self.spool.parent})",
                    flush=True,
                )

    def metrics(self, metrics: Mapping[str, float], step: int | None = None, prefix: str = "") -> None:
        now = int(time.time() * 1000)
        batch = [
            [f"{prefix}{k}", float(v), now, step or 0]
            for k, v in metrics.items()
            if v is not None and not (isinstance(v, float) and math.isnan(v))
        ]
        for i in range(0, len(batch), 1000):
            self._write("metrics", metrics=batch[i : i + 1000])

    def params(self, params: Mapping[str, Any]) -> None:
        items = [[k[:250], _param_value(v)] for k, v in params.items()]
        for i in range(0, len(items), BATCH_LIMIT):
            self._write("params", params=items[i : i + BATCH_LIMIT])

    def tags(self, tags: Mapping[str, Any]) -> None:
        items = [[k, _param_value(v)] for k, v in tags.items()]
        for i in range(0, len(items), BATCH_LIMIT):
            self._write("tags", tags=items[i : i + BATCH_LIMIT])

    def artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._write("artifact", path=str(path), artifact_path=artifact_path)

    def stage_result(self, stage: str, result: StageResult | Mapping[str, Any]) -> None:
        """A finished stage's metrics, under the names `stage_metrics` gives them."""
        self.metrics(stage_metrics(stage, result))

    def train_step(self, step: int, loss: float, lr: float, tokens_per_s: float, stats: Mapping[str, float]) -> None:
        self.metrics(train_step_metrics(loss, lr, tokens_per_s, stats), step=step)

    def train_validation(self, step: int, val: Mapping[str, Any]) -> None:
        self.metrics(train_val_metrics(val), step=step)

    def note(self, markdown: str) -> None:
        """The run's description in the UI (MLflow's note)."""
        self.tags({NOTE_TAG: markdown})

    def rename(self, name: str) -> None:
        self._write("rename", name=name)

    def url(self) -> str:
        try:
            return run_url(self.uri, self.client.get_run(self.run_id).info.experiment_id, self.run_id)
        except Exception:  # the store does not answer: the run is still named
            return f"{self.uri} (run {self.run_id})"

    def finish(self, status: str = "FINISHED") -> None:
        self._write("terminated", status=status)

    def fail(self, error: str) -> None:
        if len(error) > PARAM_VALUE_LIMIT:  # the head names the cause (the first failing rank), the tail the log's end
            error = error[: PARAM_VALUE_LIMIT // 3] + "\n...\n" + error[-(PARAM_VALUE_LIMIT * 2 // 3 - 5) :]
        self.tags({"error": error})
        self._write("terminated", status="FAILED")

    def get_metrics(self) -> dict[str, float]:
        return dict(self.client.get_run(self.run_id).data.metrics)


def store_unavailable(exc: BaseException) -> bool:
    """Whether an MLflow client error says the store could not be reached (worth keeping the write for later),
    not that it refused the write itself (a bad value: raised as before)."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, MlflowException):
        # MLflow's REST client wraps a request that never got an answer as "API request to ... failed with
        # exception ..." (mlflow/utils/rest_utils.py); an overloaded server answers with these codes.
        busy = exc.error_code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED")
        return busy or "failed with exception" in str(exc)
    return type(exc).__module__.startswith(("requests", "urllib3"))


def _apply(client: MlflowClient, run_id: str, kind: str, payload: dict[str, Any]) -> None:
    """One write of a `Tracker`, as it was asked or as its spool line recorded it."""
    if kind == "metrics":
        client.log_batch(run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in payload["metrics"]])
    elif kind == "params":
        client.log_batch(run_id, params=[Param(k, v) for k, v in payload["params"]])
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in payload["tags"]])
    elif kind == "artifact":
        client.log_artifact(run_id, payload["path"], payload["artifact_path"])
    elif kind == "rename":
        client.update_run(run_id, name=payload["name"])
    elif kind == "terminated":
        client.set_terminated(run_id, payload["status"])
    else:
        raise ValueError(f"unknown tracking write {kind!r}")


def replay_spool(spool: Path, client: MlflowClient) -> int:
    """Logs a spool's writes in their order and removes it; the writes not logged stay (the first failure
    raises). Returns how many were logged. The spool is moved aside first, so writes spooled meanwhile start a
    new one."""
    spool = Path(spool)
    taken = spool.with_name(f"{spool.name}.{os.getpid()}.replaying")
    try:
        os.replace(spool, taken)
    except FileNotFoundError:
        return 0
    lines = taken.read_text().splitlines()
    for done, line in enumerate(lines):
        record = json.loads(line)
        try:
            _apply(client, record["run_id"], record["kind"], record["payload"])
        except Exception:
            with spool.open("a") as f:  # what is left goes back, before anything spooled meanwhile is lost
                f.write("".join(f"{rest}\n" for rest in lines[done:]))
            taken.unlink()
            raise
    taken.unlink()
    return len(lines)


def _param_value(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return s if len(s) <= PARAM_VALUE_LIMIT else s[: PARAM_VALUE_LIMIT - 3] + "..."


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested dict; lists stay values (`aux_layers` reads as [-1, 2, 30])."""
    out: dict[str, Any] = {}
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = tree
    return out


def ensure_store(uri: str, experiment: str) -> str:
    """Creates the store and experiment once (sqlite migrations race when several processes do it)."""
    lock = None
    if uri.startswith("sqlite:///"):
        lock = FileLock(uri[len("sqlite:///") :] + ".lock")
        lock.acquire()
    try:
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        experiment_id = (
            exp.experiment_id
            if exp
            else client.create_experiment(experiment, artifact_location=artifact_root(uri, experiment))
        )
        if not exp or exp.tags.get(RUNS_VIEW_TAG) != RUNS_VIEW:
            client.set_experiment_tag(experiment_id, RUNS_VIEW_TAG, RUNS_VIEW)
        return experiment_id
    finally:
        if lock:
            lock.release()


class TrackingUnreachable(RuntimeError):
    """The configured tracking server does not answer: refused before any job is submitted."""


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """A tracking server (http/https URI) must answer its health endpoint within `timeout_s`; MLflow's own client
    would retry for minutes before saying anything. A file or sqlite store needs no server."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:  # it answered, if not with 200: a server is there
        if exc.code >= 500:
            raise TrackingUnreachable(
                f"tracking.uri={uri}: the tracking server answered {url} with HTTP {exc.code}. Check the server, or "
                "set tracking.uri=null to log into a sqlite store under outputs_dir"
            ) from None
    except (OSError, ValueError) as exc:
        raise TrackingUnreachable(
            f"tracking.uri={uri}: no tracking server answers at {url} within {timeout_s:g} s ({exc}); nothing was "
            "submitted. Start the server (mlflow server ...), fix tracking.uri, or set tracking.uri=null to log into "
            "a sqlite store under outputs_dir"
        ) from None


def start_pipeline_run(
    uri: str,
    experiment: str,
    run_name: str,
    resolved_config: dict[str, Any],
    aux_layers: list[int],
    run_dir: Path,
    parent_run_id: str | None = None,
    cached: Sequence[str] = (),
) -> Tracker:
    """Creates the pipeline's run, named by what differs between runs (`run_label`), with the curated params,
    aux_layers as a tag, a note saying what runs, and the full resolved config as an artifact. `run_name` (the
    config's name) stays a tag; `cached` are the stages reused from the cache."""
    experiment_id = ensure_store(uri, experiment)
    client = MlflowClient(tracking_uri=uri)
    tags = {"aux_layers": json.dumps(aux_layers), "run_dir": str(run_dir), "run_name": run_name}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment_id, tags=tags)
    tracker = Tracker(uri, run.info.run_id, spool=Path(run_dir) / SPOOL)
    label = run_label(aux_layers, resolved_config.get("seed"), run.info.run_id, cached) if aux_layers else run_name
    tracker.rename(label)
    tracker.params(curated_params(resolved_config))
    tracker.note(f"### {label}\n\nRunning; cached: {', '.join(cached) or 'none'}. `{run_dir}`")
    config_file = Path(run_dir) / "config.yaml"
    if config_file.exists():
        tracker.artifact(config_file)
    return tracker


def sweep_parent_run(uri: str, experiment: str, sweep_dir: Path, name: str) -> str:
    """The parent run shared by every point of a sweep, created by whichever point comes first."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    record = sweep_dir / "mlflow_parent_run.json"
    with FileLock(str(record) + ".lock"):
        if record.exists():
            return json.loads(record.read_text())["run_id"]
        experiment_id = ensure_store(uri, experiment)
        run = MlflowClient(tracking_uri=uri).create_run(
            experiment_id, run_name=f"{name}-sweep", tags={"sweep_dir": str(sweep_dir)}
        )
        from orchestrator.artifacts import write_json

        write_json(record, {"run_id": run.info.run_id})
        return run.info.run_id


def run_url(uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """The UI's page for the experiment's runs table, with the comparison's columns (`RUNS_VIEW`), or one run's
    page. MLflow 3.17's UI opens an experiment on its GenAI pages unless `workflowType=machine_learning` is in
    the URL. A sqlite store is served by `mlflow ui`, at 127.0.0.1:5000 by default."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else UI_DEFAULT
    if run_id:
        return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{UI_WORKFLOW}"
    return f"{base}/#/experiments/{experiment_id}/runs?{UI_WORKFLOW}&viewStateShareKey={RUNS_VIEW_KEY}"


def resolved_container(cfg: Any) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


# ---- What a researcher compares in the UI -----------------------------------------------------------------

NOTE_TAG = "mlflow.note.content"  # the run's description in the UI
UI_DEFAULT = "http://127.0.0.1:5000"
UI_WORKFLOW = "workflowType=machine_learning"
# The runs table's columns for comparing layer choices, as an MLflow UI "shared view" (an experiment tag that
# `?viewStateShareKey=` loads): the layers, the draft's accuracy as served, accept length and speedup.
RUNS_VIEW_KEY = "compare-layers"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
RUNS_VIEW_COLUMNS = [
    "params.`aux_layers`",
    "metrics.`eval/acc_0`",
    "metrics.`train/val_acc_0`",
    "metrics.`serve/accept_length`",
    "metrics.`eval/expected_accept_length`",
    "metrics.`serve/speedup`",
    "metrics.`serve/speedup_min`",
    "metrics.`serve/speedup_max`",
    "metrics.`eval/mismatch`",
]
RUNS_VIEW = json.dumps({"selectedColumns": RUNS_VIEW_COLUMNS, "columnOrder": RUNS_VIEW_COLUMNS})

# The config keys that decide a result, logged as params under their config path; the full resolved config is
# the `config.yaml` artifact. The layer list appears once (`aux_layers`): every stage takes it.
CURATED_PARAMS = (
    "aux_layers",
    "target.name",
    "data.name",
    "data.regenerate.enabled",
    "data.max_seq_len",
    "draft.draft_vocab_size",
    "train.ttt_steps",
    "train.lr",
    "train.epochs",
    "train.max_steps",
    "train.batch_size",
    "serve.engine",
    "serve.num_steps",
    "serve.eagle_topk",
    "serve.num_draft_tokens",
    "serve.repeats",
    "seed",
)


def layers_label(layers: Iterable[int]) -> str:
    """`L1-4-6`; the embedding output (-1) reads `emb`: `Lemb-2-30`."""
    return "L" + "-".join("emb" if k == -1 else str(k) for k in layers)


def run_label(aux_layers: list[int], seed: Any, run_id: str, cached: Sequence[str] = ()) -> str:
    """`L1-4-6 · s0 · 3f9a2c`, then `· cached extract+train` when stages were reused: what differs between the
    points of a sweep, and a short id that tells identical configurations apart."""
    parts = [layers_label(aux_layers), f"s{seed}", run_id[:6]]
    if cached:
        parts.append("cached " + "+".join(cached))
    return " · ".join(parts)


def curated_params(resolved: Mapping[str, Any]) -> dict[str, str]:
    """The CURATED_PARAMS found in the resolved config; lists read `1, 4, 6` (the UI draws JSON lists as trees)."""
    flat = flatten(resolved)
    return {
        k: ", ".join(map(str, flat[k])) if isinstance(flat[k], list) else flat[k] for k in CURATED_PARAMS if k in flat
    }


def _numbers(values: Mapping[str, Any], keys: Iterable[str]) -> dict[str, float]:
    return {
        k: float(values[k])
        for k in keys
        if isinstance(values.get(k), (int, float)) and not isinstance(values.get(k), bool)
    }


def _positions(values: Mapping[str, Any], stem: str) -> list[str]:
    return sorted(
        (k for k in values if k.startswith(stem) and k[len(stem) :].isdigit()), key=lambda k: int(k[len(stem) :])
    )


def train_step_metrics(loss: float, lr: float, tokens_per_s: float, stats: Mapping[str, float]) -> dict[str, float]:
    """`train/*` at a training step: the loss and the teacher-forced accuracies of that batch."""
    tf = {f"train/teacher_forced_{k}": v for k, v in stats.items() if k in _positions(stats, "acc_")}
    return {"train/loss": loss, "train/lr": lr, "train/tokens_per_s": tokens_per_s} | tf


def train_val_metrics(val: Mapping[str, Any]) -> dict[str, float]:
    """`train/val_*` at a validation step: the draft drafting from its own tokens, as served."""
    keys = ["loss", *_positions(val, "acc_"), "expected_accept_length"]
    return {f"train/val_{k}": v for k, v in _numbers(val, keys).items()}


def stage_metrics(stage: str, result: StageResult | Mapping[str, Any]) -> dict[str, float]:
    """A stage's MLflow metrics from its result (typed, or the dict in its manifest), each quantity once: the live
    stage and a cached extraction's re-log (`relog_cached`) log the same names. Training logs as it goes
    (`train_step_metrics`, `train_val_metrics`)."""
    if stage not in ("extract", "eval", "serve"):
        raise ValueError(f"no MLflow metrics defined for stage {stage!r}")
    r = results.typed(stage, result)
    if stage == "extract":
        keys = ("tokens", "tokens_per_s", "bytes_per_token", "regenerate_s", "loss_tokens_per_sequence")
        out = _numbers({k: getattr(r, k) for k in keys}, keys)
    elif stage == "eval":
        out = _eval_metrics(r)
    else:
        out = _serve_metrics(r)
    return {f"{stage}/{k}": v for k, v in out.items()}


def _by_position(stem: str, values: Sequence[Any]) -> dict[str, Any]:
    """A per-position list under its metric names: `<stem>0`, `<stem>1`, ..."""
    return {f"{stem}{k}": v for k, v in enumerate(values)}


def _eval_metrics(r: EvalResult) -> dict[str, float]:
    scalars = {
        k: getattr(r, k) for k in ("expected_accept_length", "sequences", "verify_passes", "served_states_rel_diff")
    }
    values = (
        _by_position("acc_", r.acc)
        | _by_position("trained_states_acc_", r.trained_states_acc)
        | _by_position("acc_gap_", r.acc_gap)
        | _by_position("acc_gap_se_", r.acc_gap_se)
        | scalars
    )
    return _numbers(values, values) | {"mismatch": float(bool(r.mismatch))}


def _serve_metrics(r: ServeResult) -> dict[str, float]:
    rows = r.per_concurrency or []
    keys = ("baseline_tok_s", "spec_tok_s", "speedup", "accept_length", "accept_length_rel_diff")
    out = _numbers({k: getattr(r, k) for k in keys}, keys)
    if r.accept_length_counted is not None:  # each request's own count: the figure and its 95% interval
        out["accept_length_counted"] = float(r.accept_length_counted)
        out["accept_length_requests"] = float(r.accept_length_requests)
        out["accept_length_ci95_low"], out["accept_length_ci95_high"] = map(float, r.accept_length_ci95)
    if r.accept_length_eval_prompts is not None:  # the same over eval's prompts
        out["accept_length_eval_prompts"] = float(r.accept_length_eval_prompts)
        low, high = map(float, r.accept_length_eval_prompts_ci95)
        out["accept_length_eval_prompts_ci95_low"], out["accept_length_eval_prompts_ci95_high"] = low, high
    if rows:
        head = rows[0]
        out |= _numbers(head, ("baseline_latency_mean_s", "spec_latency_mean_s")) | _spread(head)
    out |= {k: float(v) for k, v in r.phase_ms.items() if isinstance(v, (int, float))}
    out |= _by_position("accept_rate_", r.accept_rate_by_position or [])
    out |= _by_position("acceptance_", r.acceptance_by_position or [])
    out |= _numbers(
        r.engine_latency, tuple(f"{m}_{k}" for m in ("baseline", "spec") for k in ("ttft_mean_s", "itl_mean_s"))
    )
    for row in rows[1:]:  # the headline is the first concurrency; others get their own names
        out |= {
            f"c{row['concurrency']}_{k}": v
            for k, v in _numbers(row, ("baseline_tok_s", "spec_tok_s", "speedup", "accept_length")).items()
        }
    out["greedy_outputs_identical"] = float(bool(r.greedy_outputs_identical))
    out |= _numbers({"greedy_differing_token_rate": r.greedy_differing_token_rate}, ("greedy_differing_token_rate",))
    out["mismatch"] = float(bool(r.mismatch))
    return out


def _spread(row: Mapping[str, Any]) -> dict[str, float]:
    """Min and max of tok/s over the `serve.repeats` passes, and the speedup's range from them (slowest
    speculative pass over fastest baseline pass, and the reverse): a layer difference inside it is noise."""
    base, spec = row.get("baseline_tok_s_passes") or [], row.get("spec_tok_s_passes") or []
    if not base or not spec:
        return {}
    return {
        "baseline_tok_s_min": min(base),
        "baseline_tok_s_max": max(base),
        "spec_tok_s_min": min(spec),
        "spec_tok_s_max": max(spec),
        "speedup_min": min(spec) / max(base),
        "speedup_max": max(spec) / min(base),
    }


def compute_params(described: Mapping[str, Any]) -> dict[str, Any]:
    """A stage's `Compute.describe()` as MLflow params: device, devices, dtype, world size, backend."""
    return {k: v for k, v in described.items() if v is not None}


def relog_cached(tracker: Tracker, stage: str, stage_dir: Path, result: StageResult | Mapping[str, Any]) -> None:
    """A cached extraction, draft or evaluation gives this run the metrics (and the training's validation curve and
    accuracy plot, and eval's mismatch tags) that the run which produced it logged, so the compare view shows no
    hole for it."""
    stage_dir = Path(stage_dir)
    result = results.typed(stage, result)
    if result.compute:  # how the cached stage ran, as a live one records it (pipeline.run_stage)
        tracker.params({f"{stage}.{k}": v for k, v in compute_params(result.compute).items()})
    if stage == "train":  # training writes metrics.json and the plot before its manifest
        for entry in json.loads((stage_dir / "metrics.json").read_text())["history"]:
            tracker.train_validation(entry["step"], entry)
        tracker.artifact(stage_dir / "accuracy_by_position.png", "train")
    else:
        tracker.stage_result(stage, result)
    if isinstance(result, (EvalResult, ServeResult)) and result.mismatch is not None:  # as a live eval tags it
        flags = result.mismatch_flags or []
        tracker.tags(
            {f"{stage}.mismatch": str(result.mismatch).lower()}
            | ({f"{stage}.mismatch_flags": " | ".join(flags)} if flags else {})
        )


def run_note(summary: Mapping[str, Any]) -> str:
    """The run's description: a markdown headline of what the run measured, and any mismatch in full."""
    stages = {s: results.typed(s, r) for s, r in summary["stages"].items()}
    train, ev, serve = (stages.get(s) or results.load(s, {}) for s in ("train", "eval", "serve"))
    rows = [("layers (aux_layers)", ", ".join(map(str, summary["aux_layers"])))]
    own = ev.acc or train.val_acc
    if own:
        source = "eval, exported draft on the live target" if ev.acc else "training validation"
        rows.append((f"acc_0..{len(own) - 1} (own tokens; {source})", " / ".join(f"{a:.3f}" for a in own)))
    if serve.engine is not None:
        version = f" {serve.engine_version}" if serve.engine_version else ""
        fallback = f" (**in place of the engine asked for**: {serve.engine_fallback})" if serve.engine_fallback else ""
        rows.append(("served by", f"{serve.engine}{version}{fallback}"))
    if serve.accept_length is not None:  # None: the target ended every answer before a verify pass
        rows.append(("accept length, served (tokens per verify pass, bonus included)", f"{serve.accept_length:.2f}"))
    if serve.accept_length_counted is not None:
        low, high = serve.accept_length_ci95
        rows.append(
            (
                f"accept length, {serve.accept_length_requests} requests counted (95% interval)",
                f"{serve.accept_length_counted:.2f} ({low:.2f}-{high:.2f})",
            )
        )
    if serve.accept_length_eval_prompts is not None:
        low, high = serve.accept_length_eval_prompts_ci95
        rows.append(
            (
                "accept length, served on the prompts eval predicts it on (95% interval)",
                f"{serve.accept_length_eval_prompts:.2f} ({low:.2f}-{high:.2f})",
            )
        )
    expected = ev.expected_accept_length if ev.expected_accept_length is not None else train.val_expected_accept_length
    if expected is not None:
        rows.append(
            (
                "expected accept length (eval)"
                if ev.expected_accept_length is not None
                else "expected accept length (training)",
                f"{expected:.2f}",
            )
        )
    if serve.speedup is not None:
        spread = _spread((serve.per_concurrency or [{}])[0])
        span = f" (range {spread['speedup_min']:.2f}-{spread['speedup_max']:.2f} over the passes)" if spread else ""
        rows.append(("speedup, speculative / baseline tok/s (median pass)", f"**{serve.speedup:.2f}x**{span}"))
        rows.append(("tok/s baseline / speculative", f"{serve.baseline_tok_s:.0f} / {serve.spec_tok_s:.0f}"))
    cached = [s for s, r in stages.items() if r.cached]
    rows.append(("cached stages", ", ".join(cached) or "none"))
    flags = summary.get("mismatch_flags") or []
    rows.append(("mismatch", "**yes**, see below" if flags else "none"))
    table = "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])
    details = "".join(f"\n- {f}" for f in flags)
    return f"{table}\n{details}".rstrip() + "\n"


# ---- Layer search: one parent run per study, one child run per trial ------------------------------------------

SEARCH_OBJECTIVE = "search/objective"


def search_started(
    uri: str,
    parent_run_id: str,
    study_name: str,
    storage: str,
    folder: Path,
    objective: str,
    slots: Sequence[Sequence[int]],
    union: Sequence[int],
) -> None:
    """The study's parent run, (re)opened: named by the study, with where it lives and what it searches."""
    tracker = Tracker(uri, parent_run_id)
    tracker.client.update_run(parent_run_id, status="RUNNING", name=f"{study_name} · layer search")
    tracker.tags(
        {
            "search.study_name": study_name,
            "search.storage": storage,
            "search.folder": str(folder),
            "search.objective": objective,
            "search.slots": json.dumps([list(s) for s in slots]),
            "search.union": json.dumps(list(union)),
        }
    )


def union_extracted(uri: str, run_id: str, union: Sequence[int]) -> None:
    """The study's extraction run, named for what it extracted (not its nominal point) and marked as no trial."""
    tracker = Tracker(uri, run_id)
    tracker.rename(f"union extraction {layers_label(union)}")
    tracker.tags({"search.role": "union extraction", "search.union": json.dumps(list(union))})


def child_run_id(uri: str, parent_run_id: str, run_dir: Path) -> str | None:
    """The pipeline run of a sweep or search point, found by its parent and run folder (a failed pipeline
    returns no summary to read it from)."""
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    runs = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'", max_results=10000)
    return next((r.info.run_id for r in runs if r.data.tags.get("run_dir") == str(Path(run_dir).resolve())), None)


def trial_ended(
    uri: str,
    run_id: str | None,
    number: int,
    state: str,
    objective: str | None = None,
    value: float | None = None,
    pruned_at_step: int | None = None,
) -> None:
    """A trial's child run: its state (complete, pruned, failed, interrupted) as a tag, its value as
    `search/objective`; a pruned trial's run ends KILLED (MLflow has no pruned status), as does one whose driver
    was killed (its point runs again in a new trial); a failed one stays FAILED."""
    if run_id is None:
        return
    tracker = Tracker(uri, run_id)
    tags = {"search.trial": number, "search.trial_state": state}
    if objective:
        tags["search.objective"] = objective
    if pruned_at_step is not None:
        tags["search.pruned_at_step"] = pruned_at_step
    tracker.tags(tags)
    if value is not None:
        tracker.metrics({SEARCH_OBJECTIVE: value})
    if state in ("pruned", "interrupted"):
        tracker.finish("KILLED")


def search_progress(uri: str, parent_run_id: str, summary: Mapping[str, Any], plot: Path, finished: bool) -> None:
    """The study so far on its parent: the best point as a tag, the best value per finished trial as a metric,
    the trials' table as its note, the plot and search.json as artifacts; closed when `finished`."""
    tracker = Tracker(uri, parent_run_id)
    rows, best, baseline = summary["trials"], summary["best"], summary["baseline"]
    counts = {state: sum(r["state"] == state for r in rows) for state in ("complete", "pruned", "fail")}
    tags: dict[str, Any] = {f"search.trials_{k}": v for k, v in counts.items()}
    if best:
        tags |= {"search.best_aux_layers": json.dumps(best["aux_layers"]), "search.best_trial": best["number"]}
        tracker.metrics({"search/best_objective": best["value"]}, step=max(r["number"] for r in rows))
    if baseline:
        tracker.metrics({"search/baseline_objective": baseline["value"]})
    tracker.tags(tags)
    tracker.note(search_note(summary))
    tracker.artifact(plot)
    if finished:
        tracker.artifact(plot.parent / "search.json")
        tracker.finish()


def search_note(summary: Mapping[str, Any]) -> str:
    """The parent run's description: the best point, the baseline and every trial, best first."""
    name = summary["objective"]
    rows = sorted(summary["trials"], key=lambda r: (r["value"] is None, -(r["value"] or 0.0), r["number"]))
    lines = [f"### layer search `{summary['study_name']}`: {name}, maximised", ""]
    if summary["best"]:
        lines.append(
            f"best: **{layers_label(summary['best']['aux_layers'])}** = {summary['best']['value']:.4f}"
            f" (trial {summary['best']['number']})"
        )
    if summary["baseline"]:
        lines.append(
            f"; baseline {layers_label(summary['baseline']['aux_layers'])} = {summary['baseline']['value']:.4f}"
        )
    lines += ["", f"| trial | layers | state | {name} |", "|---|---|---|---|"]
    for r in rows:
        layers = layers_label(r["aux_layers"]) if r["aux_layers"] else "-"
        state = r["state"] + (" (baseline)" if r["baseline"] else "")
        state += f" (= trial {r['duplicate_of']})" if r.get("duplicate_of") is not None else ""
        value = "" if r["value"] is None else f"{r['value']:.4f}"
        lines.append(f"| {r['number']} | {layers} | {state} | {value} |")
    return "\n".join(lines) + "\n"


def replay(run_dir: Path, uri: str | None = None) -> int:
    """Logs what a run's jobs could not (`<run_dir>/tracking_spool.jsonl`, and any replay cut short) into the
    run's tracking store (`plan.json`'s, or `uri`). Returns how many writes were logged."""
    run_dir = Path(run_dir)
    spool = run_dir / SPOOL
    for cut_short in sorted(run_dir.glob(f"{SPOOL}.*.replaying")):  # a replay that died: its lines come first
        rest = spool.read_text() if spool.exists() else ""
        spool.write_text(cut_short.read_text() + rest)
        cut_short.unlink()
    if uri is None:
        plan = run_dir / "plan.json"
        if not plan.exists():
            raise SystemExit(f"{plan} does not exist: give the tracking URI with --uri")
        uri = json.loads(plan.read_text())["tracking_uri"]
    check_reachable(uri)
    return replay_spool(spool, MlflowClient(tracking_uri=uri))


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m orchestrator.tracking")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("replay", help="log a run's records kept on disk while its tracking server was away")
    cmd.add_argument("run_dir", type=Path)
    cmd.add_argument("--uri", help="the tracking URI (default: the run's, from its plan.json)")
    args = parser.parse_args(argv)
    try:
        logged = replay(args.run_dir, args.uri)
    except TrackingUnreachable as exc:
        print(f"error: {exc}")
        return 3
    print(f"logged {logged} kept write(s) from {args.run_dir / SPOOL}" if logged else f"nothing kept in {args.run_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
