"""vLLM's capture for the extract stage: one engine kept up for a task (orchestrator/engines/vllm/side/capture.py
--serve, in vLLM's environment), one request per shard, each shard assembled from its files and written as its
answer arrives; and the same engine for a capture service that streams states to a trainer (`VLLMStream`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from orchestrator.artifacts import atomic_path
from orchestrator.config.schema import one_pass
from orchestrator.data import prompt_ids
from orchestrator.engines import CaptureJob
from orchestrator.engines.vllm import cli
from orchestrator.engines.vllm.ids import engine_layers
from orchestrator.regenerate import (
    Rendered,
    keep_regenerated,
    one_pass_rendered,
    regenerated_path,
    through_first_end,
)
from orchestrator.states.assemble import Assembler
from orchestrator.states.shards import layer_columns, pack
from orchestrator.states.teacher import TeacherHead
from orchestrator.targets import end_token_ids, load_head_tensors, load_tokenizer, target_config_json


class VLLMCapture:
    """An extract task's capture through one vLLM engine kept up for the task (`CaptureEngine`): one request per
    shard, sent one shard ahead, so that the engine captures the next shard while this one is assembled and
    written. `start` waits for a shard's answer (with one pass, and keeps its regenerated sequences, which the
    stage then reads back), `shard` assembles it and deletes vLLM's files.

    Each shard is written as soon as its answer arrives, so a task killed midway leaves its finished shards and a
    rerun asks only for the others (the stage's `todo`). The work folder holds only answers not yet written as
    shards, two at most (a rank's states at Kimi's scale are hundreds of GB), never a finished one: a rerun clears
    what a killed run left there, and `close` removes it."""

    model = None

    def __init__(self, cfg, job: CaptureJob):
        self.cfg, self.job = cfg, job
        self.tokenizer = load_tokenizer(job.target_path, cfg.target.trust_remote_code, cfg.data.chat_template)
        self.layers = len(job.layers)
        self.assemble = assembler(cfg, job.target_path, list(job.layers))
        self.work = job.out / "vllm_states" / f"rank{job.compute.rank}"
        if self.work.exists():  # a killed run's answers, none of them written as a shard
            shutil.rmtree(self.work)
        gpus = sum(d.type == "cuda" for d in job.compute.devices)
        log = job.out / "logs" / f"rank{job.compute.rank}" / "vllm_capture.log"
        # started once there is a shard to capture (a rerun may leave only a streamed split's token ids to write)
        self.engine = CaptureEngine(cfg, job.target_path, gpus, self.work, log) if job.todo else None
        self.asked: list[tuple[str, int, list[list[int]], bool]] = []  # (split, index, prompts, one pass), in order
        self.answered = 0
        self.files: dict[tuple[str, int], list[str]] = {}
        if self.engine is not None:
            print(f"[extract] vLLM capture engine: {shlex.join(self.engine.command)} (log {log})", flush=True)

    def start(self, split: str, index: int) -> None:
        """The shard's states captured: its request and the next shard's sent, its answer awaited. With
        data.regenerate.engine=one_pass its sequences are kept as a regeneration's are
        (`<split>/regenerated_NNNNN.safetensors`), for the stage to read back."""
        todo = self.job.todo
        position = todo.index((split, index))
        while len(self.asked) < min(position + 2, len(todo)):
            self._ask(*todo[len(self.asked)])
        if position != self.answered:
            raise RuntimeError(f"{split} shard {index} started out of the task's order ({todo})")
        report = self.engine.answer()  # answers come in the order asked
        self.answered += 1
        _, _, prompts, generates = self.asked[position]
        if generates:
            r, ends = self.cfg.data.regenerate, end_token_ids(self.tokenizer)
            answers = zip(prompts, report["generated"], strict=True)
            kept = [one_pass_rendered(p, g, r.max_new_tokens, ends, self.cfg.data.max_seq_len) for p, g in answers]
            keep_regenerated(regenerated_path(self.job.out, split, index), kept)
        self.files[(split, index)] = report["files"]
        how = ", each answer generated in the same request" if generates else ""
        print(f"[extract] vLLM {report['vllm_version']} captured {split} shard {index}: {len(prompts)} sequences{how}")

    def _ask(self, split: str, index: int) -> None:
        """The shard's request: with one pass, its prompts, answered greedily and captured with the answers
        (`include_output_tokens`); else its rendered sequences, or the one-pass sequences a killed run kept."""
        r, max_len = self.cfg.data.regenerate, self.cfg.data.max_seq_len
        kept = regenerated_path(self.job.out, split, index)
        generates = one_pass(self.cfg) and not kept.exists()
        if generates:
            prompts = [prompt_ids(self.tokenizer, c, max(1, max_len - 1)) for c in self.job.shards[split][index]]
        else:
            prompts = [seq.input_ids for seq in self.job.sequences(self.tokenizer, split, index)]
        self.engine.send({
            "prompts": prompts, "out": str(self.work / "answers" / f"{split}_{index:05d}"),
            "include_output_tokens": generates,
            # one token past the budget, so that a response cut at max_new_tokens has a state for every token
            "max_tokens": r.max_new_tokens + 1 if generates else 1,
        })  # fmt: skip
        self.asked.append((split, index, prompts, generates))

    def shard(self, split, index, rendered):
        """One shard's tensors (as the HF capture writes them) from vLLM's captured states: the aux layers, and
        the last layer's output as the teacher's source (`extract.teacher`)."""
        files = self.files.pop((split, index))
        sequences = read_states(self.assemble, rendered, files, self.layers, f"vLLM's capture of a {split} sequence")
        shutil.rmtree(self.work / "answers" / f"{split}_{index:05d}")
        return pack(sequences)

    def close(self) -> None:
        """The engine stopped and the work folder removed: it holds no finished shard."""
        if self.engine is not None:
            self.engine.close()
        shutil.rmtree(self.work, ignore_errors=True)
        with contextlib.suppress(OSError):  # left while another task's folder is in it
            self.work.parent.rmdir()


class CaptureEngine:
    """vLLM's extractor kept up for one extract task (side/capture.py --serve, answering the requests written to
    `work/queue` in the order sent). A request the engine works on for longer than extract.request_timeout_s, an
    engine not up within extract.startup_timeout_s, or an engine that exits, is a failed engine: it is stopped and
    another is started, and sent the requests not answered yet, up to extract.engine_restarts times; then the
    task fails naming the engine's log. A request the engine answers with an error fails the task at once (the
    same request would fail again)."""

    def __init__(self, cfg, target_path, gpus: int, work: Path, log: Path, engine_args: list[str] | None = None):
        e = cfg.extract
        self.work, self.log, self.queue = Path(work), Path(log), Path(work) / "queue"
        self.startup_timeout_s, self.request_timeout_s = e.startup_timeout_s, e.request_timeout_s
        self.write_timeout_s = e.write_timeout_s  # each state file whole within this (side/capture.py)
        self.restarts, self.restarts_left = e.engine_restarts, e.engine_restarts
        if engine_args is None:  # the extraction's engine: its layers and precision
            engine_args = cli.extract_engine_args(cfg, target_path, self.work, gpus)
        self.command = cli.capture_service_command(e.python, self.queue, engine_args)
        self.pending: list[dict] = []  # the requests sent and not answered, oldest first
        self.sent = 0
        self.log.parent.mkdir(parents=True, exist_ok=True)  # appended to, one section per start: a rerun keeps it
        self._start()

    def _start(self) -> None:
        for stale in (self.queue, self.work / "raw"):  # a failed engine's queue and unfinished files
            shutil.rmtree(stale, ignore_errors=True)
        self.queue.mkdir(parents=True)
        with open(self.log, "a") as log:
            start = self.restarts - self.restarts_left + 1
            log.write(
                f"[extract] vLLM capture engine, start {start} of this task, {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            )
            log.flush()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=cli.side_env())
        self.started_at, self.busy_since = time.time(), None  # busy_since: when the engine took its current work
        for request in self.pending:
            self._write(request)

    def _write(self, request: dict) -> None:
        shutil.rmtree(request["out"], ignore_errors=True)  # what a failed engine wrote of its answer
        with atomic_path(self.queue / request["name"]) as tmp:
            tmp.write_text(json.dumps({k: v for k, v in request.items() if k != "name"}))

    def wait_up(self) -> None:
        """Returns once the engine is up (it has written `queue/ready`), through as many restarts as
        extract.engine_restarts allows: a capture service says it is capturing only then."""
        while (failure := self._wait(self.queue / "ready")) is not None:
            self._restart(failure)

    def send(self, request: dict) -> None:
        """Queues `request` (side/capture.py's REQUEST) behind those sent before."""
        self.sent += 1
        request = {"name": f"req-{self.sent:08d}.json", "write_timeout_s": self.write_timeout_s, **request}
        if not self.pending and self.busy_since is not None:  # an idle engine takes it now
            self.busy_since = time.time()
        self.pending.append(request)
        self._write(request)

    def answer(self) -> dict:
        """The report on the oldest request sent (side/capture.py's: its files, generated ids, vLLM's version),
        once the engine answers it, through as many restarts as extract.engine_restarts allows."""
        while True:
            failure = self._wait(self.queue / Path(self.pending[0]["name"]).with_suffix(".done"))
            if failure is None:
                break
            self._restart(failure)
        done = self.queue / Path(self.pending.pop(0)["name"]).with_suffix(".done")
        report = json.loads(done.read_text())
        done.unlink()
        self.busy_since = time.time()  # the engine takes the next request now
        if "error" in report:
            raise RuntimeError(f"vLLM's capture engine failed a request: {report['error']}; its log: {self.log}")
        return report

    def _wait(self, done: Path) -> str | None:
        """None once `done` is there; else what failed the engine."""
        while not done.exists():
            if self.proc.poll() is not None:
                return f"exited with code {self.proc.returncode}"
            now = time.time()
            if self.busy_since is None:  # still starting
                if (self.queue / "ready").exists():
                    self.busy_since = now
                elif now - self.started_at > self.startup_timeout_s:
                    return f"was not up within extract.startup_timeout_s={self.startup_timeout_s:g} s"
            elif now - self.busy_since > self.request_timeout_s:
                return f"gave no answer within extract.request_timeout_s={self.request_timeout_s:g} s"
            time.sleep(0.01)
        return None

    def _restart(self, failure: str) -> None:
        pid = self.proc.pid
        self._stop(wait_s=0)
        if not self.restarts_left:
            raise RuntimeError(
                f"vLLM's capture engine (pid {pid}) {failure}, with {_requests(len(self.pending))} left and its "
                f"restarts used up (extract.engine_restarts={self.restarts}); its log: {self.log}\n{_tail(self.log)}"
            )
        self.restarts_left -= 1
        print(
            f"[extract] WARNING: vLLM's capture engine (pid {pid}) {failure}; starting another for the "
            f"{_requests(len(self.pending))} left (restart {self.restarts - self.restarts_left} of "
            f"extract.engine_restarts={self.restarts}; log {self.log})",
            flush=True,
        )
        self._start()

    def _stop(self, wait_s: float) -> None:
        if wait_s:
            (self.queue / "stop").touch()
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Stops the engine: it finishes the request at hand (a minute at most) and exits."""
        self._stop(wait_s=60)


def assembler(cfg, target_path, layers: list[int]) -> Assembler:
    """vLLM captures the last layer's output (id N) before the final norm: the assembler norms it for post_norm.
    Where vLLM has no id for the embedding output among `layers` (`ids.engine_layers`), the assembler computes it
    from the checkpoint's embedding table, read once here (as stored: 2.3 GB for Kimi-K2.5)."""
    post_norm = cfg.extract.teacher == "post_norm"
    norm = load_head_tensors(target_path, cfg.target.family)["norm"] if post_norm else None
    eps = target_config_json(target_path).get("rms_norm_eps", 1e-6)
    _, computed = engine_layers(cfg, layers)
    embed = load_head_tensors(target_path, cfg.target.family, ("embed",), as_stored=True)["embed"] if computed else None
    return Assembler(cfg.extract.dtype, norm, eps, embed)


def read_states(assemble: Assembler, rendered, files: list[str], layers: int, what: str) -> list:
    """The sequences' states from vLLM's files (`hidden_states` [T, K'+1, H] in the order of the capture's ids: the
    aux layers vLLM captures, K' of the `layers` K, then id N for the teacher), checked against the tokens sent;
    the files are deleted once read."""
    sequences = []
    captured_aux = layers - assemble.computed
    for seq, path in zip(rendered, files, strict=True):
        captured = load_file(path)
        hs = captured["hidden_states"]
        where = f"{what} ({path})"
        sequences.append(assemble.sequence(seq, hs[:, :captured_aux], hs[:, -1], captured["token_ids"], where))
    for path in files:
        os.remove(path)
    return sequences


class VLLMStream:
    """vLLM's extractor kept up for a capture service (train.states=stream, orchestrator/states/stream.py) or for
    eval (`VLLMEval`): one `CaptureEngine`, so a stalled or dead engine is restarted or fails as the extract stage's
    does (extract.request_timeout_s, startup_timeout_s, engine_restarts); each batch one request, its files
    assembled as the extract stage assembles a shard's. `answers_eval`: a service that answers its run's eval too
    (`evaluator`): the target's head is loaded before the engine starts, and the engine has room for eval's
    continuations.

    `work` holds the engine's log (in a capture service's spool, where its consumers name it); vLLM's files, its
    queue and the answers are in a folder of this node's own (`node_local`): at Kimi's scale they are hundreds of
    MB a sequence, which a shared spool must not carry on their way to the store."""

    def __init__(
        self, cfg, target_path, layers, compute, work: Path, engine_args=None, answers_eval: bool = False,
    ):  # fmt: skip
        self.cfg, self.target_path, self.compute = cfg, target_path, compute
        self.work, self.captured, self.sent = Path(work), list(layers), 0
        self.local = node_local("vllm-capture-")
        self.assemble = assembler(cfg, target_path, self.captured)
        # the head on this process's device before the engine starts: vLLM claims gpu_memory_utilization of the
        # device for itself and refuses to start where less is free then (vllm/v1/worker/utils.py request_memory at
        # 0.32.0), so the head's memory is counted before the engine's start, not taken from under it afterwards
        self.head = teacher_head(cfg, target_path, compute) if answers_eval else None
        gpus = sum(d.type == "cuda" for d in compute.devices)
        if engine_args is None:  # a capture service's: the extraction's layers
            args = cli.extract_engine_args(cfg, target_path, self.local / "engine", gpus, answers_eval)
        else:  # the engine's arguments for its folder of vLLM's files
            args = engine_args(self.local / "engine")
        self.log = self.work / "vllm.log"
        self.engine = CaptureEngine(cfg, target_path, gpus, self.local / "engine", self.log, args)
        print(f"[stream] vLLM capture engine: {shlex.join(self.engine.command)} (log {self.log})", flush=True)
        self.engine.wait_up()

    @property
    def layers(self) -> int:
        return len(self.captured)

    def states(self, rendered) -> list:
        report, out = self.ask([r.input_ids for r in rendered])
        sequences = read_states(self.assemble, rendered, report["files"], self.layers, "vLLM's capture service")
        shutil.rmtree(out)
        return sequences

    def each_states(self, requests):
        """(rendered, states) for each of `requests` (lists of rendered sequences), in order, with the next request
        sent before the last one's files are read and assembled: the engine captures while the service reads."""
        sent: list[tuple[list, Path | None]] = []  # the requests sent, not answered yet: (rendered, out)
        requests = iter(requests)

        def send_next() -> bool:
            rendered = next(requests, None)
            if rendered is None:
                return False
            sent.append((rendered, self._send([r.input_ids for r in rendered]) if rendered else None))
            return True

        try:
            send_next()
            while sent:
                send_next()  # the one after, while this one is read
                rendered, out = sent.pop(0)
                if out is None:
                    yield rendered, []
                    continue
                report = self.engine.answer()
                what = "vLLM's capture service"
                yield rendered, read_states(self.assemble, rendered, report["files"], self.layers, what)
                shutil.rmtree(out)
        finally:  # closed early (a service starting over, or stopping): the request sent ahead is answered first,
            for _, out in sent:  # so that the engine's next answer is the next request's
                if out is not None:
                    with contextlib.suppress(Exception):  # an engine that failed fails its next request too
                        self.engine.answer()
                    shutil.rmtree(out, ignore_errors=True)

    def _send(self, prompts: list[list[int]], include_output_tokens: bool = False, max_tokens: int = 1) -> Path:
        """Queues one request; the folder its files go to."""
        self.sent += 1
        out = self.local / "out" / str(self.sent)
        self.engine.send({"prompts": prompts, "out": str(out), "max_tokens": max_tokens,
                          "include_output_tokens": include_output_tokens})  # fmt: skip
        return out

    def ask(self, prompts: list[list[int]], include_output_tokens: bool = False, max_tokens: int = 1):
        """One request to the engine: its report (the files of each prompt's states, the generated ids, vLLM's
        version) and the folder that holds the files."""
        out = self._send(prompts, include_output_tokens, max_tokens)
        return self.engine.answer(), out

    def evaluator(self, layers) -> VLLMEval:
        """The eval stage's live target at the served `layers` (`Capturing.open_eval`) on this engine: their
        columns of what it captures. A service opened without `answers_eval` has no head to answer with."""
        if self.head is None:
            raise RuntimeError("this vLLM capture service was started without eval consumers: it has no head")
        missing = [k for k in layers if k not in self.captured]
        if missing:
            raise RuntimeError(
                f"the served layers {list(layers)} are not all captured by this service ({self.captured}): "
                f"{missing} missing"
            )
        return VLLMEval(self.cfg, self.target_path, layers, self.compute, self.work, stream=self)

    def close(self) -> None:
        self.engine.close()
        shutil.rmtree(self.local, ignore_errors=True)


def node_local(prefix: str) -> Path:
    """A new folder on this node's own storage (the temporary folder, `TMPDIR`, which a Slurm site points at the
    job's node-local disk), removed by its user when done."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def teacher_head(cfg, target_path, compute) -> TeacherHead:
    """The target's final norm and lm_head, read by name from the checkpoint, on the compute's device."""
    tensors = load_head_tensors(target_path, cfg.target.family)
    eps = target_config_json(target_path).get("rms_norm_eps", 1e-6)
    return TeacherHead(tensors, cfg.extract.teacher, eps).to(compute.device)


class VLLMEval:
    """The live target for the eval stage (eval.engine=vllm): vLLM's extractor kept up at the served layers, so
    that eval reads the states serving captures, and the target's greedy tokens and continuations, from the
    engine that loads the checkpoint as shipped (INT4 included) and never from HF transformers. The greedy token at
    each position is the target's head (final norm and lm_head, read by name from the checkpoint) on the last
    layer's output the engine captures; a continuation is the engine's own greedy generation, captured in the same
    request (one pass). `stream`: a capture service's engine (`VLLMStream.evaluator`), of whose layers the served
    ones are a subset; else the job starts one of its own at the served layers."""

    def __init__(self, cfg, target_path, layers, compute, work: Path, stream: VLLMStream | None = None):
        self.device, self.version, self.owned = compute.device, None, stream is None
        self.tokenizer = load_tokenizer(target_path, cfg.target.trust_remote_code, cfg.data.chat_template)
        if stream is None:
            head = teacher_head(cfg, target_path, compute)  # before the engine starts
            gpus = sum(d.type == "cuda" for d in compute.devices)

            def engine_args(out: Path) -> list[str]:
                return cli.eval_engine_args(cfg, target_path, layers, out, gpus)

            stream = VLLMStream(cfg, target_path, layers, compute, work, engine_args=engine_args)
            stream.head = head
        self.stream, self.head, self.served_layers = stream, stream.head, list(layers)

    def _read(self, rendered, files: list[str]) -> list:
        """The sequences' states, their aux states the served layers' columns of what the engine captured."""
        states = read_states(self.stream.assemble, rendered, files, self.stream.layers, "vLLM's eval capture")
        captured = {"aux_layers": self.stream.captured, "hidden_size": states[0].aux.shape[1] // self.stream.layers}
        columns = layer_columns(captured, self.served_layers)
        if columns is None:
            return states
        return [dataclasses.replace(s, aux=s.aux.index_select(1, columns)) for s in states]

    def served(self, sequences: list[list[int]]):
        """Per sequence: the served states [L, K*H] and the target's greedy token at each position [L]."""
        report, out = self.stream.ask(sequences)
        self.version = report["vllm_version"]
        states = self._read([Rendered(list(ids), [1] * len(ids)) for ids in sequences], report["files"])
        shutil.rmtree(out)
        kept = torch.zeros(1, dtype=torch.long, device=self.device)
        for s in states:
            with torch.no_grad():
                _, best = self.head(s.teacher.float().to(self.device), kept)
            yield s.aux, best.cpu()

    def continuations(self, prompts: list[list[int]], max_new: int):
        """Per prompt: its length, the prompt and the engine's greedy continuation (at most `max_new` tokens, through
        the end token), and the served states of all its tokens but the last, generated and captured in one request."""
        ends = end_token_ids(self.tokenizer)
        # one token past the budget, so that a continuation cut at max_new has a state for each of its tokens
        report, out = self.stream.ask(prompts, include_output_tokens=True, max_tokens=max_new + 1)
        self.version = report["vllm_version"]
        for prompt, generated, path in zip(prompts, report["generated"], report["files"], strict=True):
            sequence = list(prompt) + through_first_end(generated[:max_new], ends)
            captured = sequence[: len(prompt) + len(generated) - 1]
            (states,) = self._read([Rendered(captured, [1] * len(captured))], [path])
            yield len(prompt), sequence, states.aux
        shutil.rmtree(out)

    def describe(self) -> str:
        return f"vllm {self.version} extract_hidden_states"

    def close(self) -> None:
        if self.owned:  # a service's engine stays up for its other consumers
            self.stream.close()


def _requests(count: int) -> str:
    return f"{count} request{'s' if count != 1 else ''}"


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
