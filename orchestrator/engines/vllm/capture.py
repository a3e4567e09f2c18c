"""vLLM's capture for the extract stage: every sequence of a task's shards through vLLM's extractor in one engine
run (orchestrator/engines/vllm/side/capture.py in vLLM's environment), then each shard assembled from its files."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from orchestrator.artifacts import atomic_path
from orchestrator.config.schema import one_pass
from orchestrator.data import prompt_ids
from orchestrator.engines import CaptureJob
from orchestrator.engines.vllm import cli
from orchestrator.engines.vllm.ids import capture_ids
from orchestrator.regenerate import Rendered, keep_regenerated, one_pass_rendered
from orchestrator.states.assemble import Assembler
from orchestrator.states.shards import pack
from orchestrator.states.teacher import TeacherHead
from orchestrator.targets import load_head_tensors, load_tokenizer, target_config_json


class VLLMCapture:
    """The task's states, computed in one engine run when it opens and left in vLLM's files, one per sequence:
    `shard` reads one shard's files, assembles the shard, and deletes them, so a rank holds one shard's states in
    memory at a time (at Kimi's scale a rank's states are hundreds of GB), and its work folder goes when the last
    shard is done."""

    model = None

    def __init__(self, cfg, job: CaptureJob):
        self.tokenizer = load_tokenizer(job.target_path, cfg.target.trust_remote_code, cfg.data.chat_template)
        self.files, self.work = capture_all(cfg, job, self.tokenizer)
        self.layers = len(job.layers)
        self.assemble = assembler(cfg, job.target_path)

    def shard(self, split, index, rendered):
        """One shard's tensors (as the HF capture writes them) from vLLM's captured states: the aux layers, and
        the last layer's output as the teacher's source (`extract.teacher`)."""
        files = self.files.pop((split, index))
        sequences = read_states(self.assemble, rendered, files, self.layers, f"vLLM's capture of a {split} sequence")
        if not self.files:  # the task's last shard
            shutil.rmtree(self.work)
            with contextlib.suppress(OSError):  # left while another task's folder is in it
                self.work.parent.rmdir()
        return pack(sequences)


def assembler(cfg, target_path) -> Assembler:
    """vLLM captures the last layer's output (id N) before the final norm: the assembler norms it for post_norm."""
    post_norm = cfg.extract.teacher == "post_norm"
    norm = load_head_tensors(target_path, cfg.target.family)["norm"] if post_norm else None
    eps = target_config_json(target_path).get("rms_norm_eps", 1e-6)
    return Assembler(cfg.extract.dtype, norm, eps)


def read_states(assemble: Assembler, rendered, files: list[str], layers: int, what: str) -> list:
    """The sequences' states from vLLM's files (`hidden_states` [T, K+1, H] in the order of the capture's ids: the
    aux layers, then id N for the teacher), checked against the tokens sent; the files are deleted once read."""
    sequences = []
    for seq, path in zip(rendered, files, strict=True):
        captured = load_file(path)
        hs = captured["hidden_states"]
        where = f"{what} ({path})"
        sequences.append(assemble.sequence(seq, hs[:, :layers], hs[:, -1], captured["token_ids"], where))
    for path in files:
        os.remove(path)
    return sequences


class VLLMStream:
    """vLLM's extractor kept up for a capture service (train.states=stream, orchestrator/states/stream.py): each
    batch one request to the engine (side/capture.py --serve, answering the requests written to `work/queue`), its
    files assembled as the extract stage assembles a shard's."""

    def __init__(self, cfg, target_path, layers, compute, work: Path, engine_args: list[str] | None = None):
        self.work, self.layers, self.sent = Path(work), len(layers), 0
        self.queue = self.work / "queue"
        self.queue.mkdir(parents=True, exist_ok=True)
        self.assemble = assembler(cfg, target_path)
        gpus = sum(d.type == "cuda" for d in compute.devices)
        if engine_args is None:  # the extraction's engine: its layers and precision
            engine_args = cli.extract_engine_args(cfg, target_path, self.work / "engine", gpus)
        command = cli.capture_service_command(cfg.extract.python, self.queue, engine_args)
        self.log = self.work / "vllm.log"
        print(f"[stream] vLLM capture engine: {shlex.join(command)} (log {self.log})", flush=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=cli.side_env())

    def states(self, rendered) -> list:
        report, out = self.ask([r.input_ids for r in rendered])
        sequences = read_states(self.assemble, rendered, report["files"], self.layers, "vLLM's capture service")
        shutil.rmtree(out)
        return sequences

    def ask(self, prompts: list[list[int]], include_output_tokens: bool = False, max_tokens: int = 1):
        """One request to the engine: its report (the files of each prompt's states, the generated ids, vLLM's
        version) and the folder that holds the files."""
        self.sent += 1
        request = self.queue / f"req-{self.sent:08d}.json"
        out = self.work / "out" / str(self.sent)
        body = {"prompts": prompts, "out": str(out), "max_tokens": max_tokens,
                "include_output_tokens": include_output_tokens}  # fmt: skip
        with atomic_path(request) as tmp:
            tmp.write_text(json.dumps(body))
        done = request.with_suffix(".done")
        while not done.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM's capture engine (pid {self.proc.pid}) exited with code {self.proc.returncode}; its log: "
                    f"{self.log}\n{_tail(self.log)}"
                )
            time.sleep(0.005)
        report = json.loads(done.read_text())
        done.unlink()
        if "error" in report:
            raise RuntimeError(f"vLLM's capture engine failed a request: {report['error']}; its log: {self.log}")
        return report, out

    def close(self) -> None:
        (self.queue / "stop").touch()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class VLLMEval:
    """The live target for the eval stage (eval.engine=vllm): vLLM's extractor kept up at the served layers, so
    that eval reads the states serving captures, and the target's greedy tokens and continuations, from the
    engine that loads the checkpoint as shipped (INT4 included) and never from HF transformers. The greedy token at
    each position is the target's head (final norm and lm_head, read by name from the checkpoint) on the last
    layer's output the engine captures; a continuation is the engine's own greedy generation, captured in the same
    request (one pass)."""

    def __init__(self, cfg, target_path, layers, compute, work: Path):
        self.device = compute.device
        self.tokenizer = load_tokenizer(target_path, cfg.target.trust_remote_code, cfg.data.chat_template)
        gpus = sum(d.type == "cuda" for d in compute.devices)
        engine_args = cli.eval_engine_args(cfg, target_path, layers, Path(work) / "engine", gpus)
        self.stream = VLLMStream(cfg, target_path, layers, compute, work, engine_args=engine_args)
        tensors = load_head_tensors(target_path, cfg.target.family)
        eps = target_config_json(target_path).get("rms_norm_eps", 1e-6)
        self.head = TeacherHead(tensors, cfg.extract.teacher, eps).to(compute.device)
        self.version = None

    def served(self, sequences: list[list[int]]):
        """Per sequence: the served states [L, K*H] and the target's greedy token at each position [L]."""
        report, out = self.stream.ask(sequences)
        self.version = report["vllm_version"]
        rendered = [Rendered(list(ids), [1] * len(ids)) for ids in sequences]
        states = read_states(self.stream.assemble, rendered, report["files"], self.stream.layers, "vLLM's eval capture")
        shutil.rmtree(out)
        kept = torch.zeros(1, dtype=torch.long, device=self.device)
        for s in states:
            with torch.no_grad():
                _, best = self.head(s.teacher.float().to(self.device), kept)
            yield s.aux, best.cpu()

    def continuations(self, prompts: list[list[int]], max_new: int):
        """Per prompt: its length, the prompt and the engine's greedy continuation (at most `max_new` tokens, through
        the end token), and the served states of all its tokens but the last, generated and captured in one request."""
        eos = self.tokenizer.eos_token_id
        # one token past the budget, so that a continuation cut at max_new has a state for each of its tokens
        report, out = self.stream.ask(prompts, include_output_tokens=True, max_tokens=max_new + 1)
        self.version = report["vllm_version"]
        for prompt, generated, path in zip(prompts, report["generated"], report["files"], strict=True):
            answer = list(generated[:max_new])
            if eos is not None and eos in answer:
                answer = answer[: answer.index(eos) + 1]
            sequence = list(prompt) + answer
            captured = sequence[: len(prompt) + len(generated) - 1]
            (states,) = read_states(
                self.stream.assemble, [Rendered(captured, [1] * len(captured))], [path], self.stream.layers,
                "vLLM's eval capture",
            )  # fmt: skip
            yield len(prompt), sequence, states.aux
        shutil.rmtree(out)

    def describe(self) -> str:
        return f"vllm {self.version} extract_hidden_states"

    def close(self) -> None:
        self.stream.close()


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def capture_all(cfg, job: CaptureJob, tokenizer) -> tuple[dict[tuple[str, int], list[str]], Path]:
    """Every sequence of the task's `todo` shards through vLLM's extractor in one engine run, at the ids of vLLM's
    rule: the aux layers, then the last layer's output. Returns vLLM's file for each sequence, per shard, and the
    work folder that holds them (read by `VLLMCapture.shard`).

    With data.regenerate.engine=one_pass, each request is the prompt alone: vLLM answers it greedily, then
    captures the states of prompt plus answer in the same request (`include_output_tokens`). The sequences are
    kept as a regeneration's are (`<split>/regenerated_NNNNN.safetensors`), so the shard loop reads them back."""
    ids = capture_ids(cfg, job.layers)  # the layers, then the last layer's output for the teacher
    r = cfg.data.regenerate
    answers_too = one_pass(cfg)
    max_len = cfg.data.max_seq_len
    shards, todo, out = job.shards, job.todo, job.out
    if answers_too:  # the prompts only: vLLM answers each, then captures prompt plus answer, in the same request
        prompts = [prompt_ids(tokenizer, c, max(1, max_len - 1)) for split, i in todo for c in shards[split][i]]
        counts = [len(shards[split][index]) for split, index in todo]
    else:
        rendered = [job.sequences(tokenizer, split, index) for split, index in todo]
        prompts = [seq.input_ids for seqs in rendered for seq in seqs]
        counts = [len(seqs) for seqs in rendered]
    work = out / "vllm_states" / f"rank{job.compute.rank}"
    if work.exists():  # an interrupted run's
        shutil.rmtree(work)
    gpus = sum(d.type == "cuda" for d in job.compute.devices)
    engine_args = cli.extract_engine_args(cfg, job.target_path, work, gpus)
    command = cli.capture_command(cfg.extract.python, work / "request.json", engine_args)
    print(f"[extract] {shlex.join(command)}")
    report = cli.capture_states(
        cfg.extract.python, engine_args, prompts, work, include_output_tokens=answers_too,
        # one token past the budget, so that a response cut at max_new_tokens has a state for every token
        max_tokens=r.max_new_tokens + 1 if answers_too else 1,
    )  # fmt: skip
    mode = "generated and captured in one pass" if answers_too else "captured"
    print(f"[extract] vLLM {report['vllm_version']} {mode}: ids {ids} for {len(prompts)} sequences")
    if answers_too:
        answers = iter(zip(prompts, report["generated"]))
        for (split, index), count in zip(todo, counts):
            kept = [
                one_pass_rendered(*next(answers), r.max_new_tokens, tokenizer.eos_token_id, max_len)
                for _ in range(count)
            ]
            keep_regenerated(out / split / f"regenerated_{index:05d}.safetensors", kept)
    files, paths = {}, iter(report["files"])
    for key, count in zip(todo, counts):
        files[key] = [next(paths) for _ in range(count)]
    return files, work
