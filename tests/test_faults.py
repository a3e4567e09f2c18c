"""Faults a multi-node run meets, each injected on CPU (the local executor) and survived: a rank that dies in a
collective, a submission rejected partway, an upstream artifact that is corrupt, work left to do that is none,
two runs on one cache, a tracking server that does not answer."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, compose_config, copy_cache
from mlflow.tracking import MlflowClient

from orchestrator.artifacts import ArtifactError, file_sha256
from orchestrator.compute import cpu
from orchestrator.config import ConfigError
from orchestrator.pipeline import make_plan, run_pipeline
from orchestrator.preflight import PreflightError, node_limit_findings
from orchestrator.runner import StageFailed
from orchestrator.stages.serve import differing_token_rate, exact_arithmetic
from orchestrator.states import shards as state_shards
from orchestrator.targets import ensure_target, load_target
from orchestrator.tracking import SPOOL, Tracker, TrackingUnreachable, tracking_uri
from orchestrator.tracking import check_reachable as tracking_check

FAULTS = Path(__file__).resolve().parent / "faults"


@pytest.fixture
def inject(monkeypatch):
    """inject(target, rank, call, kind): the fault of tests/faults/sitecustomize.py in every job started after."""

    def set_fault(target: str, rank: int, call: int = 1, kind: str = "raise") -> None:
        path = os.pathsep.join([str(FAULTS), *filter(None, [os.environ.get("PYTHONPATH")])])
        monkeypatch.setenv("PYTHONPATH", path)
        for key, value in {"FAULT_TARGET": target, "FAULT_RANK": rank, "FAULT_CALL": call, "FAULT_KIND": kind}.items():
            monkeypatch.setenv(key, str(value))

    return set_fault


def test_a_rank_failing_mid_training_ends_the_job_at_once_naming_its_error(tiny_config, fast_cache, tmp_path, inject):
    """Rank 1 of two raises at its third step while rank 0 waits for it in the gradient all-reduce: rank 1 aborts
    the process group, rank 0's collective fails at once (not after collective_timeout_min, 15 here), and the
    error the run reports is rank 1's, the cause, not rank 0's broken connection."""
    cfg = tiny_config(
        "cluster=local",
        "stages=[extract,train]",
        "train.resources.tasks_per_node=2",
        "train.resources.cpus_per_task=1",
        "train.seed=11",  # a training of its own: never a cached one
    )
    fast_cache("extract")  # the shared extraction: only training runs
    inject("orchestrator.stages.train:optimizer_step", rank=1, call=3)
    started = time.monotonic()
    with pytest.raises(StageFailed) as failed:
        run_pipeline(cfg, tmp_path / "run")
    seconds = time.monotonic() - started
    message = str(failed.value)
    assert "rank 1 failed first: RuntimeError: injected fault: orchestrator.stages.train:optimizer_step" in message
    assert seconds < 5 * 60, f"the job took {seconds:.0f} s to end"
    client = MlflowClient(tracking_uri(cfg.tracking.uri, cfg.outputs))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    last = client.search_runs([experiment.experiment_id], order_by=["attribute.start_time DESC"], max_results=1)[0]
    assert last.info.status == "FAILED" and "rank 1 failed first: RuntimeError: injected" in last.data.tags["error"]


def test_a_request_no_node_meets_is_refused_by_the_dry_run(tiny_config, tmp_path):
    """Where the cluster says what one node has, a stage asking more is refused before any job: sbatch would
    reject it only after the chain's earlier stages were queued."""
    cfg = tiny_config("cluster=slurm", "cluster.cpus_per_node=2", "train.resources.cpus_per_task=64", "dry_run=true")
    refused = _refused_before_any_job(cfg, tmp_path)
    assert "[node limits] train asks 64 CPUs per node; a node has 2 (cluster.cpus_per_node)" in refused
    assert "lower train.resources.cpus_per_task" in refused


def _refused_before_any_job(cfg, tmp_path) -> str:
    """The dry run's refusal of `cfg`, once no job folder was made."""
    with pytest.raises(PreflightError) as refused:
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "jobs").exists()
    return str(refused.value)


def test_a_job_longer_than_the_partition_allows_is_split_where_it_resumes_and_refused_where_it_does_not(
    tiny_config, tmp_path, capsys
):
    """Where the cluster says the partition's longest job (cluster.max_time_min, Slurm's MaxTime), a training asking
    more is planned as several allocations of that length, each requeued at its limit and resuming from its
    checkpoint; its Slurm job asks the partition's longest, with submitit's requeue budget for every allocation. An
    eval, which starts over, asking more is refused before any job, naming both keys (sbatch would refuse it or
    leave it PENDING on PartitionTimeLimit). kimi_eagle3_vllm on a 24-hour partition: every job fits, its training
    in 3 allocations, its capture service in 3, with their GPU-hours."""
    import submitit

    from orchestrator import runner
    from orchestrator.pipeline import print_train_time
    from orchestrator.preflight import time_limit_findings

    cfg = tiny_config("cluster=slurm", "cluster.max_time_min=60", "train.resources.timeout_min=150", "dry_run=true")
    (train,) = [f for f in time_limit_findings(cfg) if f.message.startswith("train")]
    assert (
        train.ok
        and "train asks 150 min; the partition allows 60 (cluster.max_time_min=60): 3 allocations of 60 min"
        in train.message
    )
    assert "up to 4 requeues (cluster.spare_requeues)" in train.message, train.message
    ex = runner.executor(cfg.cluster, tmp_path / "jobs", "t", cfg.train.resources, 1, resumes=True)
    assert isinstance(ex, submitit.SlurmExecutor) and ex.max_num_timeout == 4
    assert ex.parameters["time"] == 60 and ex.parameters["signal_delay_s"] == 120, ex.parameters
    whole = runner.executor(cfg.cluster, tmp_path / "jobs", "t", cfg.train.resources, 1)  # a job that starts over
    assert whole.parameters["time"] == 150 and whole.max_num_timeout == 2

    cfg = tiny_config("cluster=slurm", "cluster.max_time_min=60", "eval.resources.timeout_min=120", "dry_run=true")
    refused = _refused_before_any_job(cfg, tmp_path)
    assert "[time limits] eval asks 120 min; the partition allows 60 (cluster.max_time_min=60)" in refused
    assert "lower eval.resources.timeout_min to 60 or less" in refused

    kimi = tiny_config("cluster=example_site", "cluster.max_time_min=1440", experiment="kimi_eagle3_vllm", fast=False)
    findings = {f.message.split(" asks")[0]: f for f in time_limit_findings(kimi)}
    assert sorted(findings) == ["eval", "extract", "serve", "the capture service", "train"]
    assert all(f.ok for f in findings.values()), [f.message for f in findings.values() if not f.ok]
    assert findings["train"].message.startswith(
        "train asks 3840 min, 512 GPU-hours at most; the partition allows 1440 (cluster.max_time_min=1440): "
        "3 allocations of 1440 min"
    ), findings["train"].message
    assert "4080 min, 544 GPU-hours at most" in findings["the capture service"].message
    assert "3 allocations of 1440 min" in findings["the capture service"].message
    # the training on paper: 600,000 conversations x 1.1 answered turns a conversation in the sample file, one
    # pass, 8 sequences a step, at 0.37 samples/s on each of 8 training GPUs (2.96/s) against the service's 3.0/s
    capsys.readouterr()
    print_train_time(kimi)
    out = capsys.readouterr().out
    steps = -(-round(600_000 * 1.1) // 8)
    hours = steps * 8 / (0.37 * 8) / 3600
    assert (
        f"[train time] {steps:,} steps, {steps * 8:,} samples, at most {steps * 8 * 8192 / 1e9:,.2f} B tokens, at "
        f"2.96 samples/s, paced by the trainers (train.stream.train_samples_per_s): {hours:,.1f} h, "
        f"{hours * 16:,.0f} GPU-hours (the trainers and the capture service)" in out
    ), out
    assert "[train time] 3 allocations of at most 1440 min, each resuming where the last stopped:" in out, out
    spans = re.findall(r"^  \d: steps ([\d,]+)\.\.([\d,]+), at most [\d.]+ B tokens, ([\d.]+) h$", out, re.M)
    assert [(int(a.replace(",", "")), int(b.replace(",", ""))) for a, b, _ in spans] == [
        (0, 27_500), (27_500, 55_000), (55_000, 82_500)
    ] and all(float(h) * 60 <= 1440 for _, _, h in spans), out  # fmt: skip


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("60", 60), ("30:00", 30), ("1:00:00", 60), ("2-00:00:00", 2880), ("1-12", 2160), ("1-12:30", 2190),
     ("infinite", None), ("UNLIMITED", None)],
)  # fmt: skip
def test_slurms_time_formats(text, minutes):
    """Every format of `sinfo -o %l` (sbatch(1)), read where cluster.max_time_min is not set
    (tests/slurm/test_partition_limits.py reads a real partition's)."""
    from orchestrator.preflight import slurm_minutes

    assert slurm_minutes(text) == minutes
    with pytest.raises(ValueError, match="not a Slurm time limit"):
        slurm_minutes("1:2:3:4")


def test_kimi_requests_fit_a_dgx_node(tiny_config):
    """kimi_eagle3 on the example site (a DGX H100 node: 224 threads, 8 GPUs): every stage fits one node. Its
    training asked 8 tasks x 32 CPUs = 256 before, which sbatch refuses there."""
    cfg = tiny_config("cluster=example_site", experiment="kimi_eagle3", fast=False)
    limits = node_limit_findings(cfg)
    assert len(limits) == 3 * len(cfg.stages) and all(f.ok for f in limits), [str(f) for f in limits if not f.ok]
    assert any("train asks 192 CPUs per node (8 tasks x 24)" in f.message for f in limits)


def test_a_tracking_server_that_does_not_answer_is_refused_before_any_job(tiny_config, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tiny_config("cluster=local", "stages=[extract]", f"tracking.uri=http://127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(TrackingUnreachable, match=rf"tracking.uri=http://127.0.0.1:{port}: no tracking server"):
        run_pipeline(cfg, tmp_path / "run")
    assert time.monotonic() - started < 30  # MLflow's client alone retries for minutes
    assert not (tmp_path / "run" / "jobs").exists()


def test_collective_timeout_is_checked_against_the_job_limit(tiny_config):
    with pytest.raises(ConfigError, match="train.collective_timeout_min=200.0: expected > 0 and at most"):
        tiny_config("train.collective_timeout_min=200", "train.resources.timeout_min=120")


@pytest.fixture
def extraction(fast_cache, tmp_path):
    """(config, folder) of a finished tiny extraction copied into an outputs folder of its own, with the target
    (and without any verification stamp: hidden files stay behind)."""
    shared = fast_cache("extract")
    root = tmp_path / "outputs"
    for part in ("targets", "extract"):
        shutil.copytree(shared / "cache" / part, root / "cache" / part, ignore=shutil.ignore_patterns("*.lock", ".*"))
    cfg = compose_config(root, "cluster=debug", "stages=[extract]")
    return cfg, make_plan(cfg, tmp_path / "run").dir("extract")


def test_an_extraction_with_no_shard_left_does_not_load_the_target(extraction, tmp_path, monkeypatch):
    """Killed after its last shard, before the manifest: the rerun writes the manifest without loading the
    target (at Kimi's size, an hour of reads for nothing)."""
    cfg, folder = extraction
    before = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").unlink()
    loads = []
    # the HF engine's capture loads it (orchestrator.engines.hf, from orchestrator.targets when it opens)
    monkeypatch.setattr("orchestrator.targets.load_target", lambda *a, **k: loads.append(a) or load_target(*a, **k))
    summary = run_pipeline(cfg, tmp_path / "again")
    assert loads == [] and summary["stages"]["extract"]["tokens_extracted_now"] == 0
    after = json.loads((folder / "manifest.json").read_text())
    assert after["splits"] == before["splits"] and after["key"] == before["key"]


def test_shards_are_verified_once_and_a_corrupt_one_is_refused_naming_the_fix(extraction, monkeypatch):
    cfg, folder = extraction
    manifest = json.loads((folder / "manifest.json").read_text())
    hashed = []
    monkeypatch.setattr(state_shards, "file_sha256", lambda p: hashed.append(p) or file_sha256(p))
    shards = [r["file"] for s in ("train", "val") for r in manifest["splits"][s]["shards"]]
    state_shards.verify_shards(folder, manifest, cpu()).finish()
    assert len(hashed) == len(shards) + 1  # each shard, and the manifest the stamp is of
    hashed.clear()
    state_shards.verify_shards(folder, manifest, cpu()).finish()
    assert len(hashed) == 1, "a second training trusts the stamp: only the manifest is hashed"

    victim = folder / shards[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, in place: same size
    victim.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as corrupt:
        state_shards.verify_shards(folder, manifest, cpu()).finish()
    assert f"{victim}: its sha256 differs" in str(corrupt.value)
    assert f"Delete the extraction ({folder}), or run with extract.force=true" in str(corrupt.value)

    victim.write_bytes(bytes(data[:-100]))  # truncated: refused by its size alone, on every rank
    with pytest.raises(ArtifactError, match=rf"{victim}: {len(data) - 100} bytes, but the extraction manifest says"):
        state_shards.load_split(folder, manifest, "train", verify=False)


def test_shards_are_hashed_beside_training_and_a_bad_one_fails_it_at_a_check(extraction, monkeypatch):
    """verify_shards returns at once: the hashing runs in a thread while training runs (here it is held until
    released, so a wait for it before training would hang). A bad shard found there fails the next `check()`, the
    one every rank reaches together at a logging step, naming the shard; `finish()` waits for the rest."""
    import threading

    cfg, folder = extraction
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / state_shards.VERIFIED).unlink(missing_ok=True)
    release = threading.Event()
    original = state_shards.file_sha256

    def held(path):
        if path.name.startswith("shard_"):
            release.wait(timeout=60)
        return original(path)

    monkeypatch.setattr(state_shards, "file_sha256", held)
    verification = state_shards.verify_shards(folder, manifest, cpu())  # returns with every shard still to hash
    assert verification.thread.is_alive() and not release.is_set()
    verification.check()  # nothing found yet: training goes on
    victim = folder / manifest["splits"]["train"]["shards"][0]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x01
    victim.write_bytes(bytes(data))
    release.set()
    verification.thread.join(timeout=60)
    with pytest.raises(ArtifactError, match=rf"{victim}: its sha256 differs"):
        verification.check()
    assert not (folder / state_shards.VERIFIED).exists(), "no stamp for a corrupt extraction"


def test_extract_force_extracts_again_over_a_corrupt_extraction(extraction, tmp_path):
    cfg, folder = extraction
    manifest = json.loads((folder / "manifest.json").read_text())
    shard = folder / manifest["splits"]["val"]["shards"][0]["file"]
    good = shard.read_bytes()
    shard.write_bytes(good[:-7] + b"corrupt")
    forced = compose_config(cfg.outputs, "cluster=debug", "stages=[extract]", "extract.force=true")
    assert make_plan(forced, tmp_path / "p").stage_keys == make_plan(cfg, tmp_path / "p").stage_keys
    summary = run_pipeline(forced, tmp_path / "forced")
    assert summary["stages"]["extract"]["tokens_extracted_now"] == summary["stages"]["extract"]["tokens"]
    assert shard.read_bytes() == good  # the same states again, bit for bit
    state_shards.verify_shards(folder, json.loads((folder / "manifest.json").read_text()), cpu())


def test_two_runs_started_together_on_one_cache_extract_once(outputs, tiny_config, tmp_path):
    """Two local runs with the same extraction key, started at the same moment in one outputs folder: one
    extracts, the other waits on the stage's lock and then takes the finished extraction as cached."""
    ensure_target(tiny_config(), progress=False)
    root = tmp_path / "outputs"
    shutil.copytree(outputs / "cache" / "targets", root / "cache" / "targets", ignore=shutil.ignore_patterns("*.lock"))
    small = ["data.regenerate.enabled=false", "data.max_train_conversations=48", "data.max_val_conversations=8"]
    command = [sys.executable, "-m", "orchestrator", "+experiment=tiny_eagle3", f"outputs_dir={root}", *FAST]
    command += ["cluster=local", "stages=[extract]", *small]
    runs = [
        subprocess.Popen(
            [*command, f"hydra.run.dir={tmp_path / f'run{i}'}"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    outs = [run.communicate(timeout=900)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    submitted = [o for o in outs if "[extract] submitted job" in o]
    waited = [o for o in outs if "another run is computing" in o and "completed by another run meanwhile" in o]
    assert len(submitted) == 1 and len(waited) == 1, "\n---\n".join(o[-2000:] for o in outs)
    folders = list((root / "cache" / "extract").iterdir())
    assert len(folders) == 1 and (folders[0] / "manifest.json").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(port: int, store: Path, log: Path):
    """A real `mlflow server` on `port` over the sqlite `store`, until the block ends."""
    mlflow = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{store}", "--host", "127.0.0.1"]
    command += ["--artifacts-destination", str(store.parent / "artifacts"), "--port", str(port), "--workers", "1"]
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("a") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                tracking_check(f"http://127.0.0.1:{port}", timeout_s=2)
                break
            except TrackingUnreachable:
                assert time.monotonic() < deadline and server.poll() is None, log.read_text()[-3000:]
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its workers
        server.wait(30)


def test_a_tracking_server_gone_mid_run_loses_nothing(tmp_path):
    """The server goes away after the run started: the writes meanwhile neither fail the stage nor wait MLflow's
    minutes of retries; they are kept in the run folder's spool and logged, in order, by the first write after
    the server is back. A spool can also be replayed by hand, into the server it names or another."""
    port, store, log, run_dir = _free_port(), tmp_path / "mlflow.db", tmp_path / "server.log", tmp_path / "run"
    with mlflow_server(port, store, log) as uri:
        client = MlflowClient(uri)
        run_id = client.create_run(client.create_experiment("faults")).info.run_id
        tracker = Tracker(uri, run_id, spool=run_dir / SPOOL)
        tracker.metrics({"train/loss": 1.5}, step=1)
    started = time.monotonic()
    tracker.metrics({"train/loss": 1.25}, step=2)
    tracker.tags({"phase": "while the server was away"})
    tracker.finish()
    assert time.monotonic() - started < 60, "each write gave up in seconds"
    assert len((run_dir / SPOOL).read_text().splitlines()) == 3

    orphan = Tracker(f"http://127.0.0.1:{_free_port()}", run_id, spool=tmp_path / "other" / SPOOL)
    orphan.metrics({"eval/acc_0": 0.5})  # a server that never answered: replayed by hand below

    with mlflow_server(port, store, log) as uri:
        tracker.metrics({"train/loss": 1.0}, step=3)  # replays the spool first
        assert not (run_dir / SPOOL).exists()
        replayed = subprocess.run(
            [sys.executable, "-m", "orchestrator.tracking", "replay", str(tmp_path / "other"), "--uri", uri],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert replayed.returncode == 0 and "logged 1 kept write(s)" in replayed.stdout, replayed.stdout
        client = MlflowClient(uri)
        history = client.get_metric_history(run_id, "train/loss")
        assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(1, 1.5), (2, 1.25), (3, 1.0)]
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.tags["phase"] == "while the server was away"
        assert run.data.metrics["eval/acc_0"] == 0.5


def test_greedy_identity_is_exact_in_float32_and_a_measured_rate_elsewhere(tiny_config):
    """The reference engine in float32 computes verify passes and decode steps alike: any differing token is a
    bug. In bf16 (and on engines that batch) the rate of differing tokens is held to serve.greedy_token_tolerance."""
    assert differing_token_rate([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 0.0
    assert differing_token_rate([[1, 2, 3, 4], [5, 6]], [[1, 9, 3, 4], [5, 6]]) == 3 / 6  # all after a difference
    assert differing_token_rate([[1, 2]], [[1, 2, 3, 4]]) == 2 / 4  # a shorter output differs in what it lacks
    assert exact_arithmetic(tiny_config())
    assert not exact_arithmetic(tiny_config("serve.precision=bfloat16"))
    assert not exact_arithmetic(tiny_config("serve=sglang", "serve.fallback=null"))


def test_a_full_disk_fails_extraction_naming_the_bytes_and_a_rerun_resumes(outputs, tiny_config, tmp_path):
    """The extraction folder on a 6 MB filesystem (a tmpfs of its own): the stage fails naming the shard, the
    bytes it needed and the space left; no file is left under a final name that its record does not vouch for;
    once the filesystem has room, the same command extracts the rest and the shards verify."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root (scripts/test.sh runs as root in CI)")
    ensure_target(tiny_config(), progress=False)
    root = copy_cache(outputs, tmp_path / "outputs", ("targets",))
    small = ["data.regenerate.enabled=false", "data.max_train_conversations=64", "extract.shard_conversations=16"]
    cfg = compose_config(root, "cluster=local", "stages=[extract]", *small)
    folder = make_plan(cfg, tmp_path / "plan").dir("extract")
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
    try:
        with pytest.raises(StageFailed) as full:
            run_pipeline(cfg, tmp_path / "full")
        message = str(full.value)
        assert "DiskFull" in message and "no space left on the device" in message, message[-3000:]
        assert "bytes free there" in message and re.search(r"shard_\d{5}\.safetensors: no space", message)
        needed = int(re.search(r"writing it needs ([\d,]+) bytes", message).group(1).replace(",", ""))
        assert needed > 0
        written = sorted(folder.glob("*/shard_*.safetensors"))
        assert written, "some shards fitted before the disk was full"
        for shard in written:  # each one whole: its record written after it, its size the recorded one
            record = json.loads(shard.with_suffix(".json").read_text())
            assert record["bytes"] == shard.stat().st_size
        assert not list(folder.rglob("*.tmp")) and not (folder / "manifest.json").exists()

        subprocess.run(["mount", "-o", "remount,size=256m", str(folder)], check=True)  # space freed
        summary = run_pipeline(cfg, tmp_path / "again")
        extract = summary["stages"]["extract"]
        assert 0 < extract["tokens_extracted_now"] < extract["tokens"], "the rerun resumed after the shards that fitted"
        state_shards.verify_shards(folder, json.loads((folder / "manifest.json").read_text()), cpu())
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_an_error_in_a_job_ends_the_command_in_one_line_naming_the_stage_the_key_and_the_log(tiny_config, tmp_path):
    """A malformed JSONL row is refused before any job, in one line naming the file and the line. An error that only
    the extract job can find (its rendered shard's loss tokens under data.min_loss_fraction) ends the command in
    one line (the stage, the error naming the key, the log's path) with exit status 1, not a traceback of its own."""
    ensure_target(tiny_config(), progress=False)
    outputs = copy_cache(tiny_config().outputs, tmp_path / "outputs", ("targets",))
    chats = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    chats.write_text(json.dumps(good) + "\n" + '{"messages": [oops\n')
    argv = ["+experiment=tiny_eagle3", *FAST, "cluster=local", "stages=[extract]", "data=jsonl",
            f"data.train_files=[{chats}]"]  # fmt: skip

    def command(*extra: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "EAGLE_ORCH_OUTPUTS": str(outputs)}
        return subprocess.run([sys.executable, "-m", "orchestrator", *argv, *extra], capture_output=True, text=True,
                              timeout=600, env=env, cwd=tmp_path)  # fmt: skip

    refused = command()
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.rstrip().splitlines()[-1].startswith(f"error: {chats}:2: invalid JSON"), refused.stderr
    assert "(job " not in refused.stderr and "[data]" not in refused.stdout, "refused after planning"

    chats.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    proc = command("data.min_loss_fraction=0.99")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.rstrip().splitlines()[-1]
    expected = (r"error: stage extract \(job \d+\) failed: ArtifactError: train shard 0: "
                r".*data\.min_loss_fraction=0\.99.*; log: (\S+)")  # fmt: skip
    match = re.fullmatch(expected, last)
    assert match, last
    assert Path(match[1]).is_file() and "ArtifactError" in Path(match[1]).read_text()
    assert "orchestrator/app.py" not in proc.stderr, "the command's own traceback"
