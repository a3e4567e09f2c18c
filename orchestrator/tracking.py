"""The only module that talks to MLflow.

One MLflow run per pipeline run. Stage jobs log into it by run id from their own processes (on Slurm, from
other machines), so everything here goes through an `MlflowClient` with an explicit tracking URI; the fluent
"active run" API is never used. A sweep's runs are children of one parent run (the `mlflow.parentRunId` tag).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

from filelock import FileLock  # noqa: E402
from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

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


class Tracker:
    """Logs into one existing MLflow run by id."""

    def __init__(self, uri: str, run_id: str):
        self.uri = uri
        self.run_id = run_id
        self.client = MlflowClient(tracking_uri=uri)

    def metrics(self, metrics: Mapping[str, float], step: int | None = None, prefix: str = "") -> None:
        import time

        now = int(time.time() * 1000)
        batch = [
            Metric(f"{prefix}{k}", float(v), now, step or 0)
            for k, v in metrics.items()
            if v is not None and not (isinstance(v, float) and math.isnan(v))
        ]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def params(self, params: Mapping[str, Any]) -> None:
        items = [Param(k[:250], _param_value(v)) for k, v in params.items()]
        for i in range(0, len(items), BATCH_LIMIT):
            self.client.log_batch(self.run_id, params=items[i : i + BATCH_LIMIT])

    def tags(self, tags: Mapping[str, Any]) -> None:
        items = [RunTag(k, _param_value(v)) for k, v in tags.items()]
        for i in range(0, len(items), BATCH_LIMIT):
            self.client.log_batch(self.run_id, tags=items[i : i + BATCH_LIMIT])

    def artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)

    def fail(self, error: str) -> None:
        self.tags({"error": error[-PARAM_VALUE_LIMIT:]})
        self.client.set_terminated(self.run_id, "FAILED")

    def get_metrics(self) -> dict[str, float]:
        return dict(self.client.get_run(self.run_id).data.metrics)


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
        return exp.experiment_id if exp else client.create_experiment(experiment, artifact_location=artifact_root(uri, experiment))
    finally:
        if lock:
            lock.release()


def start_pipeline_run(
    uri: str,
    experiment: str,
    run_name: str,
    resolved_config: dict[str, Any],
    aux_layers: list[int],
    run_dir: Path,
    parent_run_id: str | None = None,
) -> Tracker:
    """Creates the pipeline's run: flattened config as params, aux_layers as a tag, the config as an artifact."""
    experiment_id = ensure_store(uri, experiment)
    client = MlflowClient(tracking_uri=uri)
    tags = {"aux_layers": json.dumps(aux_layers), "run_dir": str(run_dir)}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    tracker = Tracker(uri, run.info.run_id)
    tracker.params(flatten(resolved_config))
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


def resolved_container(cfg: Any) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
