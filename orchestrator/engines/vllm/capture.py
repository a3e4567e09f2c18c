"""vLLM's capture for the extract stage: every sequence of a task's shards through vLLM's extractor in one engine
run (orchestrator/engines/vllm/side/capture.py in vLLM's environment), then each shard assembled from its files."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from pathlib import Path

from safetensors.torch import load_file

from orchestrator.config.schema import one_pass
from orchestrator.data import prompt_ids
from orchestrator.engines import CaptureJob
from orchestrator.engines.vllm import cli
from orchestrator.engines.vllm.ids import capture_ids
from orchestrator.regenerate import keep_regenerated, one_pass_rendered
from orchestrator.states.assemble import Assembler
from orchestrator.states.shards import pack
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
        # vLLM captures the last layer's output (id N) before the final norm: the assembler norms it for post_norm
        post_norm = cfg.extract.teacher == "post_norm"
        norm = load_head_tensors(job.target_path, cfg.target.family)["norm"] if post_norm else None
        eps = target_config_json(job.target_path).get("rms_norm_eps", 1e-6)
        self.assemble = Assembler(cfg.extract.dtype, norm, eps)

    def shard(self, split, index, rendered):
        """One shard's tensors (as the HF capture writes them) from vLLM's captured states: the aux layers, and
        the last layer's output as the teacher's source (`extract.teacher`)."""
        files = self.files.pop((split, index))
        sequences = []
        for seq, path in zip(rendered, files, strict=True):
            captured = load_file(path)
            hs = captured["hidden_states"]  # [T, K+1, H], in the order of the capture's ids
            where = f"vLLM's capture of a {split} sequence ({path})"
            sequences.append(self.assemble.sequence(seq, hs[:, : self.layers], hs[:, -1], captured["token_ids"], where))
        for path in files:
            os.remove(path)
        if not self.files:  # the task's last shard
            shutil.rmtree(self.work)
            with contextlib.suppress(OSError):  # left while another task's folder is in it
                self.work.parent.rmdir()
        return pack(sequences)


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
