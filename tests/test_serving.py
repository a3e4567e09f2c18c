"""Serving failures: a server that fails to start, hangs or dies mid-benchmark gives a clear error with its log
tail, leaves no process behind, and a failing serve stage marks the pipeline's MLflow run failed.

The servers are the real reference engine on the tiny target; the hang is a SIGSTOP and the death a SIGKILL
sent to it between two requests."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.engines import client
from orchestrator.pipeline import make_plan, run_pipeline
from orchestrator.stages.serve import server_command


@pytest.fixture(scope="module")
def served(tiny_config, tmp_path_factory):
    """(cfg, plan, prompts) with extract and train done (cached in the shared outputs folder)."""
    cfg = tiny_config("stages=[extract,train]", "cluster=debug")
    run_dir = tmp_path_factory.mktemp("served")
    run_pipeline(cfg, run_dir)
    plan = make_plan(cfg, run_dir)
    prompts = [[2, 40, 41, 42, 43], [2, 50, 51, 52], [2, 60, 61, 62, 63, 64]]
    return cfg, plan, prompts


def _gone(pgid: int) -> bool:
    """True when no process of the group is left (a zombie of an already-waited child does not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _start(cfg, plan, tmp_path, draft: bool = True, target: Path | None = None) -> client.ServerProcess:
    port = client.free_port()
    command = server_command(cfg, target or Path(plan.target_dir), plan.dir("train") / "draft" if draft else None, port)
    return client.ServerProcess(command, port, tmp_path / "server.log", startup_timeout=120)


def test_server_that_fails_to_start(served, tmp_path):
    cfg, plan, _ = served
    server = _start(cfg, plan, tmp_path, target=tmp_path / "no-such-model")
    with pytest.raises(client.ServerError) as err:
        server.__enter__()
    message = str(err.value)
    assert "exited with code" in message and "before becoming healthy" in message
    assert "server log tail" in message and "no-such-model" in message, message  # the engine's own error
    assert server.proc.poll() is not None
    assert _gone(server.proc.pid)


@pytest.mark.parametrize(
    "fault, expected", [(signal.SIGSTOP, "the server hangs"), (signal.SIGKILL, "server died mid-request")]
)
def test_server_that_fails_mid_benchmark(served, tmp_path, fault, expected):
    cfg, plan, prompts = served
    with pytest.raises(client.ServerError) as err:
        with _start(cfg, plan, tmp_path) as server:
            pgid = os.getpgid(server.proc.pid)
            first = client.generate(server, prompts[0], 4, timeout=60)
            assert first["meta_info"]["completion_tokens"] >= 1  # it served before the fault
            os.kill(server.proc.pid, fault)
            if fault == signal.SIGKILL:
                server.proc.wait(timeout=10)
            client.benchmark(server, prompts, 8, concurrency=1, timeout=3)
    message = str(err.value)
    assert expected in message, message
    assert "server log tail" in message and "reference engine ready" in message, message
    deadline = time.monotonic() + 60  # gone within a second alone; a busy machine's margin
    while not _gone(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pgid), "the server's process group outlived the benchmark"


def test_failing_serve_stage_marks_the_run_failed(tiny_config, served, tmp_path):
    _, plan, _ = served
    # A read timeout no generation can meet: the healthy server looks hung to the client (serve.force: passes
    # another test cached under the same key would start no server).
    cfg = tiny_config("cluster=local", "serve.request_timeout_s=0.001", "serve.force=true")
    mine = tmp_path.parent  # this pytest worker's base folder: another worker's servers are not this test's
    before = _reference_server_pids(mine)
    with pytest.raises(Exception, match="timed out"):
        run_pipeline(cfg, tmp_path / "run")
    runs = MlflowClient(plan.tracking_uri).search_runs(
        [MlflowClient(plan.tracking_uri).get_experiment_by_name(cfg.tracking.experiment).experiment_id],
        filter_string="attributes.status = 'FAILED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    assert runs and "stage serve" in runs[0].data.tags["error"] and "timed out" in runs[0].data.tags["error"]
    assert "server log tail" in runs[0].data.tags["error"]
    assert _reference_server_pids(mine) <= before, "a reference server was left running"


def _reference_server_pids(under: Path) -> set[int]:
    """Live (not zombie) processes running the reference engine on a target under `under`, from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(") ", 1)[-1][:1]
        except OSError:
            continue
        mine = any(str(under).encode() in arg for arg in cmdline)
        if b"orchestrator.engines.reference.server" in cmdline and mine and state != "Z":
            found.add(int(entry.name))
    return found
