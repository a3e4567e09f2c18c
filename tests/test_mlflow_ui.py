"""What a researcher sees in MLflow: run names, notes, curated params and metric names (unit), and the UI itself,
opened in Debian's chromium on the store of a 2-point `aux_layers` sweep whose second point reused its
extraction and draft from the cache.

The store is built with the pipeline's own tracking calls (`start_pipeline_run`, the stages' `stage_result` and
`train_validation`, `pipeline.finish`) on stage folders holding the manifests the stages write, so it takes
seconds, not a pipeline run. The browser is driven through chromedriver's W3C WebDriver protocol (what selenium
speaks to it), over plain HTTP.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import compose_config
from mlflow.tracking import MlflowClient

from orchestrator import tracking
from orchestrator.artifacts import write_json, write_manifest
from orchestrator.compute import cpu
from orchestrator.engines.client import free_port
from orchestrator.pipeline import finish, make_plan

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
POINTS = ([1, 4, 6], [0, 3, 6])  # the sweep's aux_layers


# ---- unit: names, params, metrics, notes ---------------------------------------------------------------------


def test_run_label_says_what_differs():
    run_id = "3f9a2c5be01d4c7a"
    assert tracking.run_label([1, 4, 6], 0, run_id) == "L1-4-6 · s0 · 3f9a2c"
    assert (
        tracking.run_label([-1, 2, 30], 7, run_id, ["extract", "train"])
        == "Lemb-2-30 · s7 · 3f9a2c · cached extract+train"
    )


def test_params_are_the_few_that_decide_a_result(tmp_path):
    params = tracking.curated_params(tracking.resolved_container(compose_config(tmp_path, "aux_layers=[1,4,6]")))
    assert set(params) == set(tracking.CURATED_PARAMS), set(tracking.CURATED_PARAMS) ^ set(params)
    assert params["aux_layers"] == "1, 4, 6", "a list reads as text, not as a JSON tree"
    assert params["train.ttt_steps"] > 0 and params["serve.engine"] == "reference"


def test_serve_metrics_log_each_quantity_once_with_its_spread():
    metrics = tracking.stage_metrics("serve", _serve_result(speedup=1.30))
    assert metrics["serve/speedup"] == pytest.approx(1.30)
    assert metrics["serve/speedup_min"] == pytest.approx(390 / 330) and metrics["serve/speedup_max"] == pytest.approx(
        430 / 300
    )
    assert metrics["serve/baseline_tok_s_min"] == 300 and metrics["serve/spec_tok_s_max"] == 430
    assert metrics["serve/c4_speedup"] == pytest.approx(1.5), "other concurrencies keep their own names"
    assert not [k for k in metrics if k.startswith("serve/c1_") or "eval_expected" in k], metrics


def test_eval_metrics_drop_duplicates_and_constants():
    result = {
        "acc_0": 0.9,
        "full_acc_0": 0.9,
        "acc_1": 0.8,
        "full_acc_1": 0.7,
        "trained_states_acc_0": 0.91,
        "acc_gap_0": 0.01,
        "acc_gap_se_0": 0.02,
        "positions_0": 400,
        "draft_steps": 3,
        "sequences": 8,
        "expected_accept_length": 2.7,
        "mean_accepted_per_cycle": 1.66,
        "verify_passes": 40,
        "mismatch": False,
    }
    assert tracking.stage_metrics("eval", result) == {
        "eval/acc_0": 0.9,
        "eval/acc_1": 0.8,
        "eval/trained_states_acc_0": 0.91,
        "eval/acc_gap_0": 0.01,
        "eval/acc_gap_se_0": 0.02,
        "eval/expected_accept_length": 2.7,
        "eval/sequences": 8.0,
        "eval/verify_passes": 40.0,
        "eval/mismatch": 0.0,
    }


def test_training_names_teacher_forced_and_own_token_accuracies_apart():
    step = tracking.train_step_metrics(
        13.1, 1e-3, 4200.0, {"acc_0": 0.8, "full_acc_0": 0.8, "expected_accept_length": 3.1}
    )
    assert step == {
        "train/loss": 13.1,
        "train/lr": 1e-3,
        "train/tokens_per_s": 4200.0,
        "train/teacher_forced_acc_0": 0.8,
    }
    val = tracking.train_val_metrics(
        {"step": 8, "loss": 14.0, "acc_0": 0.7, "full_acc_0": 0.7, "expected_accept_length": 2.5}
    )
    assert val == {"train/val_loss": 14.0, "train/val_acc_0": 0.7, "train/val_expected_accept_length": 2.5}


def test_note_is_a_headline_with_the_mismatch_in_full():
    flag = (
        "eval: the draft fed what serving captures scores acc_0=0.483, 0.420 below the 0.903 it scores "
        "on the states it was trained on"
    )
    summary = {
        "aux_layers": [-1, 1, 4],
        "mismatch_flags": [flag],
        "stages": {
            "train": {"val_acc_0": 0.9, "cached": True},
            "eval": {"acc_0": 0.483, "acc_1": 0.2, "expected_accept_length": 1.37},
            "serve": _serve_result(speedup=0.72) | {"accept_length": 1.37},
        },
    }
    note = tracking.run_note(summary)
    assert "| layers (aux_layers) | -1, 1, 4 |" in note
    assert "0.483 / 0.200" in note and "1.37" in note
    assert "**0.72x** (range 1.18-1.43 over the passes)" in note
    assert "| cached stages | train |" in note and f"- {flag}" in note
    # the engine that served, and why where it stood in for the one asked for; the counted accept length's interval
    summary["stages"]["serve"] |= {
        "engine": "reference", "engine_version": "0.1.0", "engine_fallback": "no vLLM at serve.python",
        "accept_length_counted": 1.4, "accept_length_requests": 100, "accept_length_ci95": [1.31, 1.52],
    }  # fmt: skip
    note = tracking.run_note(summary)
    assert "| served by | reference 0.1.0 (**in place of the engine asked for**: no vLLM at serve.python) |" in note
    assert "| accept length, 100 requests counted (95% interval) | 1.40 (1.31-1.52) |" in note
    assert "eval predicts it on" not in note, "no row for a figure the run did not measure"
    # and over the prompts eval predicts it on, where the count reached them
    summary["stages"]["serve"] |= {"accept_length_eval_prompts": 1.375, "accept_length_eval_prompts_ci95": [1.2, 1.5]}
    note = tracking.run_note(summary)
    assert "| accept length, served on the prompts eval predicts it on (95% interval) | 1.38 (1.20-1.50) |" in note


def test_run_url_opens_the_runs_table():
    assert tracking.run_url("sqlite:////x/mlflow.db", "3") == (
        "http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning&viewStateShareKey=compare-layers"
    )
    assert (
        tracking.run_url("http://mlflow:5000/", "3", "ab")
        == "http://mlflow:5000/#/experiments/3/runs/ab?workflowType=machine_learning"
    )


# ---- a 2-point sweep's store, built with the pipeline's tracking calls ------------------------------------------


def _serve_result(speedup: float, accept_length: float = 3.2) -> dict:
    head = {
        "concurrency": 1,
        "baseline_tok_s": 320.0,
        "spec_tok_s": 320.0 * speedup,
        "speedup": speedup,
        "baseline_tok_s_passes": [300.0, 320.0, 330.0],
        "spec_tok_s_passes": [400.0, 390.0, 430.0],
        "accept_length": accept_length,
        "baseline_latency_mean_s": 0.3,
        "spec_latency_mean_s": 0.2,
    }
    other = {
        "concurrency": 4,
        "baseline_tok_s": 600.0,
        "spec_tok_s": 900.0,
        "speedup": 1.5,
        "accept_length": accept_length,
    }
    return {
        "baseline_tok_s": head["baseline_tok_s"],
        "spec_tok_s": head["spec_tok_s"],
        "speedup": speedup,
        "accept_length": accept_length,
        "eval_expected_accept_length": accept_length,
        "accept_length_rel_diff": 0.0,
        "accept_rate_by_position": [0.9, 0.8, 0.7],
        "greedy_outputs_identical": True,
        "per_concurrency": [head, other],
        "mismatch": False,
        "mismatch_flags": [],
    }


def _accuracies(acc0: float) -> dict:
    acc = {f"acc_{k}": round(acc0 - 0.07 * k, 3) for k in range(3)}
    full = {f"full_acc_{k}": round(acc0 - 0.1 * k, 3) for k in range(3)}
    return acc | full | {"expected_accept_length": 1 + sum(full.values())}


# where a one-process CPU stage runs, as `Compute.describe()` gives it
CPU = cpu().describe()


def _run_point(outputs: Path, layers: list[int], acc0: float, speedup: float, reuse_from: Path | None) -> str:
    """One pipeline run's MLflow record: the stages' manifests (and training's metrics.json and plot) in the
    plan's folders, the metrics each stage logs when it runs, and `finish`. With `reuse_from`, extraction and
    training are already in the cache, as in a re-run: the plan marks them cached and `finish` re-logs them."""
    from orchestrator.stages.train import plot_accuracy

    cfg = compose_config(outputs, f"aux_layers=[{','.join(map(str, layers))}]", "run_name=tiny_eagle3")
    run_dir = outputs / "runs" / layers_name(layers)
    extract = {
        "tokens": 96_000,
        "tokens_extracted_now": 96_000,
        "tokens_per_s": 17_500.0,
        "regenerate_s": 44.0,
        "bytes_per_token": 1029.0,
        "loss_tokens_per_sequence": 78.0,
        "output": "x",
        "compute": CPU,
    }
    val = _accuracies(acc0) | {"loss": 13.2}
    history = [{"step": 8, **_accuracies(acc0 - 0.1), "loss": 14.1}, {"step": 16, **val}]

    def write_cached_stages(plan) -> None:
        write_manifest(plan.dir("extract"), {"stage": "extract", "key": plan.stage_keys["extract"], "result": extract})
        plan.dir("train").mkdir(parents=True, exist_ok=True)
        write_json(plan.dir("train") / "metrics.json", {"history": history, "final": val})
        plot_accuracy(val, 3, plan.dir("train") / "accuracy_by_position.png")
        train = {f"val_{k}": v for k, v in val.items()} | {"draft_dir": "x", "compute": CPU}
        write_manifest(plan.dir("train"), {"stage": "train", "key": plan.stage_keys["train"], "result": train})

    if reuse_from is not None:
        write_cached_stages(make_plan(cfg, run_dir))
    plan = make_plan(cfg, run_dir)
    assert [e["cached"] for e in plan.stages] == [reuse_from is not None] * 2 + [False] * 2
    tracker = tracking.start_pipeline_run(
        plan.tracking_uri,
        cfg.tracking.experiment,
        cfg.run_name,
        tracking.resolved_container(cfg),
        layers,
        run_dir,
        cached=[e["stage"] for e in plan.stages if e["cached"]],
    )

    def ran(stage: str) -> None:  # how a live stage records where it ran (pipeline.run_stage)
        tracker.params({f"{stage}.{k}": v for k, v in tracking.compute_params(CPU).items()})

    if reuse_from is None:  # the stages run and log as they go
        write_cached_stages(plan)
        ran("extract")
        tracker.stage_result("extract", extract)
        ran("train")
        for entry in history:
            tracker.train_validation(entry["step"], entry)
    ev = _accuracies(acc0 - 0.005) | {
        "trained_states_acc_0": acc0,
        "acc_gap_0": 0.005,
        "acc_gap_se_0": 0.01,
        "sequences": 8,
        "verify_passes": 40,
        "mismatch": False,
        "mismatch_flags": [],
    }
    serve = _serve_result(speedup, accept_length=ev["expected_accept_length"])
    for stage, result in (("eval", ev), ("serve", serve)):
        ran(stage)
        tracker.stage_result(stage, result)
        write_manifest(plan.dir(stage), {"stage": stage, "key": plan.stage_keys[stage], "result": result})
    finish(cfg, plan, tracker)
    return tracker.run_id


def layers_name(layers: list[int]) -> str:
    return "_".join(map(str, layers))


@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory):
    """(store uri, {aux_layers name: run id}) of a 2-point sweep; the second point reuses cached stages."""
    outputs = tmp_path_factory.mktemp("ui_outputs")
    first = _run_point(outputs, POINTS[0], acc0=0.909, speedup=1.32, reuse_from=None)
    second = _run_point(outputs, POINTS[1], acc0=0.871, speedup=1.18, reuse_from=outputs)
    return f"sqlite:///{outputs / 'mlflow.db'}", {layers_name(POINTS[0]): first, layers_name(POINTS[1]): second}


def test_a_cached_rerun_shows_its_training_and_extraction(sweep_store):
    uri, runs = sweep_store
    client = MlflowClient(uri)
    fresh, cached = (client.get_run(runs[layers_name(p)]) for p in POINTS)
    assert set(fresh.data.metrics) == set(cached.data.metrics), set(fresh.data.metrics) ^ set(cached.data.metrics)
    assert cached.data.metrics["train/val_acc_0"] == pytest.approx(0.871)
    assert [m.step for m in client.get_metric_history(cached.info.run_id, "train/val_acc_0")] == [8, 16]
    assert "train/accuracy_by_position.png" in [a.path for a in client.list_artifacts(cached.info.run_id, "train")]
    assert cached.info.run_name.endswith("· cached extract+train") and "cached" not in fresh.info.run_name
    assert "| cached stages | extract, train |" in cached.data.tags[tracking.NOTE_TAG]
    # artifacts beside the store, readable by another user running the UI
    artifacts = Path(cached.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts")
    assert (artifacts / "summary.json").stat().st_mode & 0o777 == 0o644


# ---- the UI in a real browser ---------------------------------------------------------------------------------


class Browser:
    """Headless chromium driven by chromedriver over the W3C WebDriver protocol."""

    def __init__(self, profile: Path):
        self.port = free_port()
        self.driver = subprocess.Popen(
            [CHROMEDRIVER, f"--port={self.port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_until(lambda: self._call("GET", "/status")["value"]["ready"], 30, "chromedriver to start")
        args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--window-size=1800,1000",
        ]
        caps = {"browserName": "chrome", "goog:chromeOptions": {"binary": CHROMIUM, "args": args}}
        self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["value"]["sessionId"]

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def command(self, method: str, path: str, body: dict | None = None):
        return self._call(method, f"/session/{self.session}{path}", body)["value"]

    def open(self, url: str) -> None:
        self.command("POST", "/url", {"url": url})

    def script(self, source: str, *args):
        return self.command("POST", "/execute/sync", {"script": source, "args": list(args)})

    def text(self) -> str:
        return self.script("return document.body.innerText")

    def wait_for_text(self, *needles: str, timeout: float = 60) -> str:
        _wait_until(lambda: all(n in self.text() for n in needles), timeout, f"the page to show {needles}", self.text)
        return self.text()

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.command("GET", "/screenshot")))
        return path

    def close(self) -> None:
        try:
            self._call("DELETE", f"/session/{self.session}")
        finally:
            self.driver.terminate()
            self.driver.wait(10)


def _wait_until(predicate, timeout: float, what: str, describe=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except (urllib.error.URLError, ConnectionError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what}; last seen:\n{str(describe())[:3000]}"
            )
        time.sleep(0.5)


@pytest.fixture
def mlflow_ui(sweep_store, tmp_path):
    """`mlflow ui` on the sweep's store, as docs/experiments.md starts it, on a free port."""
    uri, _ = sweep_store
    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    log = (tmp_path / "mlflow_ui.log").open("w")
    # one worker and no job runner (nothing here runs server-side jobs): light on a 2-core CI machine
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(
        [str(mlflow), "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        _wait_until(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200,
            120,
            "mlflow ui to start",
            lambda: (tmp_path / "mlflow_ui.log").read_text(),
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the workers it started
        server.wait(30)
        log.close()


@pytest.fixture
def browser(tmp_path):
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip(
            f"no {CHROMIUM} and {CHROMEDRIVER}: as root, "
            "`apt-get install chromium chromium-driver` (scripts/test.sh does)"
        )
    session = Browser(tmp_path / "chromium-profile")
    yield session
    session.close()


def test_runs_table_and_compare_view_tell_the_layer_choices_apart(sweep_store, mlflow_ui, browser, tmp_path):
    uri, runs = sweep_store
    client = MlflowClient(uri)
    fresh, cached = (client.get_run(runs[layers_name(p)]) for p in POINTS)
    assert fresh.info.run_name != cached.info.run_name
    experiment_id = fresh.info.experiment_id

    # the URL the pipeline prints, on this server: the runs table, in the "Model training" UI, with the
    # comparison's columns (the layers first), each run's values in its row
    browser.open(tracking.run_url(mlflow_ui, experiment_id))
    table = browser.wait_for_text(fresh.info.run_name, cached.info.run_name, "serve/speedup", "0, 3, 6")
    browser.screenshot(tmp_path / "runs_table.png")
    assert "Evaluation runs" not in table, "the GenAI sidebar: the experiment did not open as model training"
    header = table.split(fresh.info.run_name)[0].split(cached.info.run_name)[0]
    for column in ("aux_layers", "eval/acc_0", "train/val_acc_0", "serve/accept_length", "serve/speedup"):
        assert column in header, (column, header)
    for run in (fresh, cached):  # each run's values in its row, as the UI writes a number (JavaScript's shortest form)
        for key in ("eval/acc_0", "train/val_acc_0", "serve/accept_length", "serve/speedup"):
            assert f"\n{run.data.metrics[key]!r}\n" in table, (run.info.run_name, key)
        assert f"\n{run.data.params['aux_layers']}\n" in table

    # one run's page: its note (layers, acc_0.., accept length, speedup with its spread) and curated params
    browser.open(tracking.run_url(mlflow_ui, experiment_id, cached.info.run_id))
    page = browser.wait_for_text("layers (aux_layers)", "accept length, served", "speedup, speculative / baseline")
    browser.screenshot(tmp_path / "run_page.png")
    assert "0, 3, 6" in page and "cached stages\textract, train" in page and "1.18x (range" in page, page[:3000]
    # every param the run logged (the curated config values, and where each stage ran), as a real run logs them
    logged = len(tracking.CURATED_PARAMS) + 4 * len(tracking.compute_params(CPU))  # 17 + 4 stages x 5: 37
    assert len(cached.data.params) == len(fresh.data.params) == logged
    assert f"Parameters ({len(cached.data.params)})" in page

    # the compare view: the layers and the metrics that differ, side by side (URL order), no NaN for the cached run
    ids = json.dumps([fresh.info.run_id, cached.info.run_id], separators=(",", ":"))
    browser.open(f"{mlflow_ui}/#/compare-runs?runs={ids}&experiments={json.dumps([experiment_id])}")
    browser.wait_for_text(fresh.info.run_name, cached.info.run_name, "Show diff only")
    browser.script("document.querySelector('button[aria-label=\"Metrics - Show diff only\"]').click()")
    compare = browser.wait_for_text("serve/speedup", "train/val_acc_0")
    browser.screenshot(tmp_path / "compare.png")
    assert "NaN" not in compare
    assert f"aux_layers\t{fresh.data.params['aux_layers']}\t{cached.data.params['aux_layers']}" in compare
    lines = compare.split("Metrics\nShow diff only\n")[1].split("\nArtifacts")[0].splitlines()
    names = [line for line in lines if "/" in line]
    values = lines[len(names) :]
    shown = {name: values[2 * i : 2 * i + 2] for i, name in enumerate(names)}
    for key in ("eval/acc_0", "train/val_acc_0", "serve/accept_length", "serve/speedup"):
        assert shown[key] == [repr(fresh.data.metrics[key]), repr(cached.data.metrics[key])], (key, shown)
