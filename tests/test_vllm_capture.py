"""extract.engine=vllm at scale, on the tiny Kimi in Kimi's capture mode (data.regenerate.engine=one_pass): one
engine kept up for a task, one request per shard, each shard written as its answer arrives. A task killed with
SIGKILL midway leaves its finished shards, and the rerun asks the engine for the others alone; an engine that dies
is started again for the requests left, and one that stalls fails the task within extract.request_timeout_s,
naming its log."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orchestrator.engines.vllm.capture import CaptureEngine
from orchestrator.pipeline import make_plan, run_pipeline
from orchestrator.runner import StageFailed
from orchestrator.states.shards import shard_done

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ROOT / "tests" / "faults"
CAPTURED = re.compile(r"\[extract\] vLLM \S+ captured (train|val) shard (\d+): \d+ sequences(, each answer generated)?")


def _kimi(tiny_kimi_dir, vllm_python, outputs: Path) -> tuple[str, ...]:
    """The tiny Kimi's extraction by vLLM in one pass (each answer generated and captured in one request), in 5
    shards of 4 conversations (4 train, 1 val)."""
    return ("cluster=local", f"outputs_dir={outputs}", f"target.path={tiny_kimi_dir}", "target.hidden_size=64",
            "target.vocab_size=512", "draft.draft_vocab_size=256", "aux_layers=[1,2,3]",
            "data.regenerate.enabled=true", "data.regenerate.engine=one_pass", "data.regenerate.max_new_tokens=24",
            "extract.dtype=float32", "stages=[extract]", "data.max_train_conversations=16",
            "data.max_val_conversations=4", "data.max_seq_len=128",
            "extract.shard_conversations=4", "extract.engine=vllm", f"extract.python={vllm_python}")  # fmt: skip


def _captured(run: Path) -> list[tuple[str, str, str]]:
    """The shards the run's extract task had the engine capture, from its per-shard lines: (split, index, whether
    the answers were generated in the same request)."""
    return sorted(CAPTURED.findall("".join(p.read_text(errors="replace") for p in run.rglob("jobs/*_log.out"))))


def _engines(folder: Path) -> list[str]:
    """The processes whose command line names the extraction's work folder: its engines."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(folder / "vllm_states") in cmdline.read_text():
                found.append(cmdline.parent.name)
        except OSError:  # gone meanwhile
            pass
    return found


@pytest.mark.vllm
def test_a_killed_vllm_extraction_reruns_only_its_unfinished_shards(
    vllm_python,
    tiny_kimi_dir,
    tiny_config,
    tmp_path,
    monkeypatch,
):
    """The extract task is killed with SIGKILL as it writes its third shard (tests/faults: no exception, no
    failure record, as kill -9 or the OOM killer), after the engine answered it and its regenerated sequences were
    kept; its engine exits with it. The two shards written stay; the rerun's engine is asked for the three others
    alone (its per-shard lines counted), the third captured from the kept sequences rather than generated again.
    Every shard equals an uninterrupted run's: token ids and masks exactly, and the states bit for bit, but the
    third shard's, captured in one prefill rather than during generation, within float32 rounding. No work
    folder is left."""
    started = time.monotonic()
    whole = tiny_config(*_kimi(tiny_kimi_dir, vllm_python, tmp_path / "whole"), experiment="tiny_kimi_eagle3")
    run_pipeline(whole, tmp_path / "whole_run")
    uninterrupted = make_plan(whole, tmp_path / "whole_run").dir("extract")
    whole_s = time.monotonic() - started

    outputs = tmp_path / "outputs"
    cfg = tiny_config(*_kimi(tiny_kimi_dir, vllm_python, outputs), experiment="tiny_kimi_eagle3")
    folder = make_plan(cfg, tmp_path / "killed").dir("extract")
    fault = {"FAULT_TARGET": "orchestrator.stages.extract:write_shard", "FAULT_RANK": "0", "FAULT_CALL": "3",
             "FAULT_KIND": "kill"}  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAULTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for key, value in fault.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(StageFailed):
        run_pipeline(cfg, tmp_path / "killed")
    shards = [("train", i) for i in range(4)] + [("val", 0)]
    assert [s for s in shards if shard_done(folder, *s)] == [("train", 0), ("train", 1)]
    assert ("train", "2", ", each answer generated") in _captured(tmp_path / "killed"), "answered before the kill"
    deadline = time.monotonic() + 10
    while _engines(folder) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _engines(folder), "the killed task's engine outlived it"

    monkeypatch.delenv("FAULT_TARGET")
    summary = run_pipeline(cfg, tmp_path / "again")
    generated = ", each answer generated"
    assert _captured(tmp_path / "again") == [("train", "2", ""), ("train", "3", generated), ("val", "0", generated)]
    extract = summary["stages"]["extract"]
    assert 0 < extract["tokens_extracted_now"] < extract["tokens"]
    assert not (folder / "vllm_states").exists()
    for split, index in shards:
        name = f"{split}/shard_{index:05d}.safetensors"
        resumed, whole_shard = load_file(str(folder / name)), load_file(str(uninterrupted / name))
        assert resumed.keys() == whole_shard.keys()
        for key, tensor in resumed.items():
            if (split, index) == ("train", 2) and key in ("aux_hidden_states", "teacher_hidden_state"):
                error = float((tensor - whole_shard[key]).abs().max() / whole_shard[key].abs().max())
                assert error < 1e-5, (name, key, error)
                print(f"{name} {key}: captured from the kept sequences, {error:.1e} from the generated run's")
            else:
                assert torch.equal(tensor, whole_shard[key]), f"{name}: {key} differs from the uninterrupted run"
    print(f"uninterrupted run {whole_s:.0f} s; the whole test {time.monotonic() - started:.0f} s")


@pytest.mark.vllm
def test_a_dead_engine_is_restarted_and_a_stalled_one_fails_within_the_request_timeout(
    vllm_python,
    tiny_kimi_dir,
    tiny_config,
    tmp_path,
    capsys,
):
    """The task's engine answers a request; killed, it is started again and answers the next request; stopped
    (SIGSTOP: alive, silent, as a hung collective leaves it), it fails the request within
    extract.request_timeout_s, with its one restart used up, naming its log."""
    timeout_s = 20
    overrides = (f"extract.request_timeout_s={timeout_s}", "extract.engine_restarts=1")
    cfg = tiny_config(
        *_kimi(tiny_kimi_dir, vllm_python, tmp_path / "outputs"), *overrides, experiment="tiny_kimi_eagle3"
    )
    work, log = tmp_path / "work", tmp_path / "logs" / "vllm_capture.log"
    engine = CaptureEngine(cfg, tiny_kimi_dir, 0, work, log)
    try:

        def request(name: str) -> dict:
            return {"prompts": [list(range(5, 25)), list(range(30, 42))], "out": str(work / "answers" / name),
                    "include_output_tokens": False, "max_tokens": 1}  # fmt: skip

        engine.send(request("first"))
        assert len(engine.answer()["files"]) == 2

        os.kill(engine.proc.pid, signal.SIGKILL)
        engine.send(request("second"))
        report = engine.answer()
        assert len(report["files"]) == 2 and all(Path(f).is_file() for f in report["files"])
        assert (
            "starting another for the 1 request left (restart 1 of extract.engine_restarts=1" in capsys.readouterr().out
        )

        os.kill(engine.proc.pid, signal.SIGSTOP)
        engine.send(request("third"))
        sent = time.monotonic()
        with pytest.raises(RuntimeError) as stalled:
            engine.answer()
        waited = time.monotonic() - sent
    finally:
        engine.close()
    message = str(stalled.value)
    assert f"gave no answer within extract.request_timeout_s={timeout_s} s" in message, message
    assert "restarts used up (extract.engine_restarts=1)" in message and f"its log: {log}" in message, message
    assert timeout_s <= waited < timeout_s + 5, waited
    assert log.read_text().count("[extract] vLLM capture engine, start") == 2


@pytest.mark.vllm
def test_capture_waits_for_a_connector_that_writes_after_the_request_is_done(
    vllm_python, tiny_kimi_dir, tiny_config, tmp_path, monkeypatch
):
    """vLLM's GPU connector reports a request done once its states are copied to the host and writes the file
    later from a thread pool, its `.lock` held until the file is whole. The CPU connector does the same, here with
    each write 2 s late (ORCHESTRATOR_CONNECTOR_WRITE_DELAY_S): the capture takes each file only once whole, and
    one not whole within extract.write_timeout_s fails the request naming the file. (Stepping the idle engine a
    fixed number of times, as capture did before, ends in milliseconds and finds no file.)"""
    delay_s = 2.0
    monkeypatch.setenv("ORCHESTRATOR_CONNECTOR_WRITE_DELAY_S", str(delay_s))
    cfg = tiny_config(*_kimi(tiny_kimi_dir, vllm_python, tmp_path / "outputs"), experiment="tiny_kimi_eagle3")
    work, log = tmp_path / "work", tmp_path / "logs" / "vllm_capture.log"
    prompts = [list(range(5, 25)), list(range(30, 42))]
    engine = CaptureEngine(cfg, tiny_kimi_dir, 0, work, log)
    try:
        engine.send({"prompts": prompts, "out": str(work / "answers" / "whole"), "max_tokens": 1})
        sent = time.monotonic()
        report = engine.answer()
        waited = time.monotonic() - sent
        for prompt, path in zip(prompts, report["files"], strict=True):
            states = load_file(path)  # a file read half-written does not parse
            assert states["token_ids"].tolist() == prompt
            assert states["hidden_states"].shape[0] == len(prompt) and torch.isfinite(states["hidden_states"]).all()
            assert not Path(path + ".lock").exists()
        assert waited >= delay_s, waited

        late = work / "answers" / "late"
        engine.send({"prompts": prompts[:1], "out": str(late), "max_tokens": 1, "write_timeout_s": 0.5})
        with pytest.raises(RuntimeError) as failed:
            engine.answer()
    finally:
        engine.close()
    message = str(failed.value)
    assert "vLLM's connector had not finished writing" in message and "its lock still held" in message, message
    assert "0.5 s after the request was done (extract.write_timeout_s)" in message, message
    assert str(work / "raw") in message and f"its log: {log}" in message, message
