"""Training's states from a live capture service instead of from disk (`train.states=stream`).

At Kimi-K2.5's shape one token's states are 57,344 bytes (three aux states and the teacher, 7168 bf16 values each):
57 TB per billion tokens, which no extraction can keep. With `train.states=stream` the extraction keeps the train
split's token ids alone, and training starts a capture service beside it:

- The service (`python -m orchestrator.states.stream SPOOL`) loads the target once and computes the train split's
  states in the order the trainer asks for them: `step_indices`, from the step the trainer resumes at. It runs the
  capture engine's own code (HF's hooks, `orchestrator.engines.hf.sequence_states`), so a streamed sequence's states
  are the ones an offline extraction stores.
- Each sequence goes into the spool folder as one file, `<position>-<index>.safetensors`, written atomically
  (`artifacts.atomic_path`): position is the sequence's place in the trainer's global order, index its place in
  the split. The trainer's ranks (`StreamedSplit`) each read the files of their share and delete them.
- Flow control: the service writes a file only while the spool holds under `train.stream.buffer_bytes` (one file
  always fits an empty spool), so it runs ahead of the trainer by the buffer and no further; the trainer waits only
  for a file not written yet, and the seconds it waited, the capture rate and the spool's peak are reported.
- Failure: the service's status file (`service.json`) is rewritten every `HEARTBEAT_S`. A trainer waiting for a
  file fails when the service it started has exited, or when the status is older than
  `train.stream.stall_timeout_s`, naming the service's log. The service exits when its trainer is gone (its parent
  changed, or the trainer's pid is dead) or when the trainer writes `stop`.
- Resume: the trainer's checkpoint holds its step, the consumed-sample cursor; a resumed trainer starts a fresh
  service at that step, with the spool emptied first.
- Shared: a layer search's trials train at once from one service (`StreamSpec.shared`, `train.stream.join`). The
  search registers each trial as a consumer (`register`); each trial's rank 0 declares the step it starts at and
  its last (`declare`); the service starts once every registered consumer has declared, at the earliest step, and
  captures the union of the trials' layers, each trial reading its own columns. A file is deleted once every
  consumer has read it (`reads/<consumer>/<position>`, `_collect`) or has ended (`unregister`): N trials cost one
  capture pass per epoch, and the slowest trial sets the pace.

The transport is a folder (node-local disk or /dev/shm on one node; a shared file system across nodes): the file
connector's way, which vLLM's hidden-states extractor also writes. The design follows SpecForge's and speculators'
online training, where the trainer reads a `StateSource` and never knows whether its data is online or offline.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load_file, save_file

from orchestrator.artifacts import ArtifactError, atomic_path
from orchestrator.states import store as stores
from orchestrator.states.shards import SequenceStates, layer_columns, pack
from orchestrator.states.source import step_indices

SPEC = "spec.pkl"
REPLAY = "replay"
STATUS = "service.json"
STOP = "stop"
LOG = "service.log"
CONSUMERS = "consumers"
READS = "reads"
DROPPED = "dropped"  # why a registered consumer was left out, for it to say when it starts (`declare`)
SERVICE_JOB = "service_job"  # the Slurm job id of a service that is a job of its own, for its consumers' `after:`
EVAL = "eval"
SHARED = "shared"  # a number `prepare` writes: every reader of the spool must see it (`check_shared`)
FLOORS = "floors"  # floors/<consumer>/<rank>: the first position that rank may still need (`StreamedSplit`)
HEARTBEAT_S = 2.0
POLL_S = 0.02


class StreamError(RuntimeError):
    pass


@dataclass
class StreamSpec:
    """What the service computes: the run's config (the capture settings, the target), the extraction whose train
    split's token ids it reads, the trainer's order from `start_step` to `total_steps`, and the spool."""

    cfg: Any  # RootConfig
    extract_dir: str
    target_path: str
    start_step: int
    total_steps: int
    buffer_bytes: int
    trainer_pid: int | None  # None: the service is a job of its own, watched through its consumers' heartbeats
    replay_bytes: int = 0
    # several trainers (a layer search's trials) read this service: the steps are theirs (`declare`), not the spec's
    shared: bool = False
    buffer_sequences: int = 2  # how far ahead in sequences, as `buffer_bytes` in bytes
    request_sequences: int = 1  # the sequences of one request to the engine

    @classmethod
    def of(cls, cfg, plan, trainer_pid: int | None, steps: tuple[int, int] | None = None) -> StreamSpec:
        """The service `cfg` asks for, over `plan`'s extraction and target, watching `trainer_pid` (None: a job of
        its own): for one trainer from `steps` = (start step, total steps), or, with no steps, shared by the
        consumers that register with it (each declares its own)."""
        from orchestrator.estimates import stream_buffer

        st, (start, total) = cfg.train.stream, steps or (0, 0)
        request, sequences, size = stream_buffer(cfg)
        return cls(
            cfg, str(plan.dir("extract")), plan.target_dir, start, total, size, trainer_pid, st.replay_bytes,
            shared=steps is None, buffer_sequences=sequences, request_sequences=request,
        )  # fmt: skip


def spool_dir(cfg, default: Path) -> Path:
    """The service's spool: `train.stream.spool`, or `default` (the run's or the search's own folder)."""
    return Path(cfg.train.stream.spool or default)


# ---- the service ---------------------------------------------------------------------------------------------


class _Status:
    """The service's counters, rewritten atomically with its heartbeat (a thread, so a target that takes minutes to
    load is alive meanwhile)."""

    def __init__(self, spool: Path, log: Path):
        self.path, self.lock = spool / STATUS, threading.Lock()
        self.values: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "log": str(log),
            "state": "loading",
            "position": 0,
            "sequences": 0,
            "tokens": 0,
            "capture_s": 0.0,
            "blocked_s": 0.0,
            "peak_spool_bytes": 0,
        }
        self.write()
        threading.Thread(target=self._beat, daemon=True).start()

    def update(self, **values) -> None:
        with self.lock:
            self.values |= values
        self.write()

    def set(self, **values) -> None:
        """Counters the next heartbeat writes (the position, once a sequence: not a file write each)."""
        with self.lock:
            self.values |= values

    def add(self, **values) -> None:
        with self.lock:
            for k, v in values.items():
                self.values[k] += v

    def write(self) -> None:
        with self.lock:
            text = json.dumps(self.values | {"heartbeat": time.time()})
        with atomic_path(self.path) as tmp:
            tmp.write_text(text)

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            self.write()


def _trainer_alive(spec: StreamSpec, parent: int) -> bool:
    if spec.trainer_pid is None:  # a job of its own (Slurm): its consumers' heartbeats tell (`_live_consumers`)
        return True
    if os.getppid() != parent:  # the trainer that started us died (we were handed to init)
        return False
    return _pid_alive(spec.trainer_pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def serve(spool: Path, log: Path | None = None) -> int:
    """The service's main: the train split's states, in the trainer's order, into the spool. Returns 0 when every
    step's states are written, 3 when the trainer is gone or asked it to stop. `log`: where its output goes, for
    the consumers' errors (default: `service.log` in the spool, where `CaptureService` sends it)."""
    from orchestrator import compute as compute_mod
    from orchestrator import engines
    from orchestrator.states.manifest import load_manifest_checked
    from orchestrator.states.shards import load_split

    compute_mod.flush_denormals()  # as the extract job that wrote the offline states (pipeline.run_stage)
    spool = Path(spool)
    parent = os.getppid()
    spec: StreamSpec = pickle.loads((spool / SPEC).read_bytes())
    cfg, status = spec.cfg, _Status(spool, log or spool / LOG)
    extract_dir = Path(spec.extract_dir)
    manifest = load_manifest_checked(extract_dir, cfg)
    tokens = load_split(extract_dir, manifest, "train", verify=False, tokens_only=True)
    gpus = torch.cuda.device_count()
    precision = compute_mod.resolve_precision(cfg.extract.precision, gpus)
    devices = tuple(torch.device("cuda", i) for i in range(gpus)) or (torch.device("cpu"),)
    compute = compute_mod.Compute(devices=devices, dtype=compute_mod.DTYPES[precision])
    status.update(dtype=str(compute.dtype))  # what an eval consumer compares its own with (`open_eval`)
    layers = list(manifest["aux_layers"])
    # the extract stage's capture engine, kept open: HF loads the target here, vLLM starts its engine (with the
    # target's head, and room for eval's continuations, where an eval consumer is registered)
    evals = bool(_role(consumers(spool), "eval"))
    engine = engines.get(cfg.extract.engine, engines.CAPTURE)
    status.update(eval_layers=engine.eval_layers(layers) if evals else [])  # what an eval consumer may ask for
    store, master = stores.open_service_store(cfg, spool, spec.buffer_bytes)
    status.update(store=store.describe())
    print(f"[stream] states travel through {store.describe()}", flush=True)
    try:
        capture = engine.open_stream(cfg, Path(spec.target_path), layers, compute, spool / "engine", evals)
        try:
            return _capture(spool, spec, parent, status, tokens, capture, store)
        except SystemExit:  # submitit requeued this job (its time limit, or pre-emption): its consumers wait for it
            status.update(state="requeued")
            raise
        finally:
            capture.close()
    finally:
        store.close()
        if master is not None:
            master.close()


def _capture(spool: Path, spec: StreamSpec, parent: int, status: _Status, tokens, capture, store) -> int:
    """The trainer's steps into the spool; a shared service's steps are its consumers' (`declare`), from the step
    the slowest of them reads (its floor: a service started again after a requeue goes on where they are, skipping
    what every consumer has read and what the store still holds), and it starts over, the spool emptied, when one
    declares again."""
    replay = _Replay(spool / REPLAY, spec.replay_bytes)
    status.update(replayed_sequences=0)
    batch = spec.cfg.train.batch_size
    while True:
        start, total, declared, skip = spec.start_step, spec.total_steps, {}, None
        if spec.shared:
            found = _declared_steps(spool, spec, parent, status)
            if found is None:
                status.update(state="stopped")
                return 3
            if not found:  # no trainer: eval consumers alone
                return _answer_evals(spool, spec, parent, status, capture, 0)
            declared = {name: c["declared"] for name, c in found.items()}
            floors = {name: floor(spool, name, c, batch) for name, c in found.items()}
            start, total = min(floors.values()) // batch, max(c["steps"][1] for c in found.values())
            held = set(store.keys())
            if start > min(c["steps"][0] for c in found.values()) or held:
                print(f"[stream] the consumers read from step {start} on (their floors); "
                      f"{len(held)} sequences still held", flush=True)  # fmt: skip

            def skip(position: int, index: int, found=found, floors=floors, held=held) -> bool:
                return stores.key(position, index) in held or _done_with(spool, found, floors, position)

        try:
            code = _capture_steps(
                spool, spec, parent, status, tokens, capture, store, replay, start, total, declared, skip
            )
            if code == 0:
                code = _drain(spool, spec, parent, status, store, declared)
            return _answer_evals(spool, spec, parent, status, capture, code)
        except _Conflict as why:
            print(f"[stream] {why}: stopping", flush=True)
            status.update(state="stopped")
            return 3
        except _Rewind as why:
            print(f"[stream] {why}: starting over", flush=True)
            for name in store.keys():
                store.release(name)
            for marks in (spool / READS).glob("*"):
                shutil.rmtree(marks, ignore_errors=True)
                marks.mkdir()


def _drain(spool: Path, spec: StreamSpec, parent: int, status: _Status, store, declared) -> int:
    """Every state is in the store: the service keeps it (Mooncake's objects live in its memory) until its trainers
    have read it and ended, so that a trainer requeued before its last checkpoint declares again (`_Rewind`) and is
    served, rather than finding no service. 0: every state was written."""
    status.update(state="done")
    while not (spool / STOP).exists() and _trainer_alive(spec, parent):
        if spec.shared and not _collect(spool, spec, store, declared, status):
            return 0
        if not spec.shared and not store.keys():  # its one trainer has read every state
            return 0
        time.sleep(POLL_S * 5)
    return 0


def _capture_steps(
    spool: Path,
    spec: StreamSpec,
    parent: int,
    status: _Status,
    tokens,
    capture,
    store,
    replay,
    start,
    total,
    declared,
    skip=None,
) -> int:
    """Steps `start`..`total`'s sequences into the store in the trainers' order. The engine captures the next
    request's sequences (`_captured`, in a thread of its own) while this thread hands the last one's over (waiting
    for room, putting), so neither waits for the other but when the buffer is full."""
    status.update(state="capturing", replay_bytes_used=replay.used)
    print(f"[stream] capturing {len(tokens)} sequences' states, steps {start}..{total}, "
          f"{spec.request_sequences} sequences a request", flush=True)  # fmt: skip
    captured = _captured(spec, status, tokens, capture, replay, start, total, skip)
    with _Ahead(captured, spec.request_sequences) as ahead:
        for position, index, tensors in ahead:
            if not _put(spool, spec, parent, status, store, stores.key(position, index), tensors, declared):
                status.update(state="stopped")
                return 3
            status.set(position=position + 1)
    status.update(state="done")
    print(f"[stream] done: {status.values['sequences']} sequences, {status.values['tokens']} tokens")
    return 0


def _captured(spec: StreamSpec, status: _Status, tokens, capture, replay, start: int, total: int, skip=None):
    """(position, index, tensors) of each sequence of steps `start`..`total`, in the trainers' order, less those
    `skip(position, index)` names (a restarted service's: read already, or still held):
    `spec.request_sequences` sequences a request to the engine (`each_states`, which may send the next request
    before the last one's states are read), those the replay holds read from it instead. The log counts each
    epoch's captured and replayed sequences (`_Passes`)."""
    from collections import deque

    from orchestrator.data import Rendered

    cfg = spec.cfg
    batch = cfg.train.batch_size
    passes, asked = _Passes(math.ceil(len(tokens) / batch)), deque()

    def requests():
        for step in range(start, total):
            order = step_indices(len(tokens), batch, cfg.train.seed, step)
            for first in range(0, len(order), spec.request_sequences):
                chunk = [
                    (step * batch + first + offset, i)
                    for offset, i in enumerate(order[first : first + spec.request_sequences])
                    if skip is None or not skip(step * batch + first + offset, i)
                ]
                if not chunk:
                    continue
                kept = {i: replay.get(i) for _, i in chunk}
                todo = [i for _, i in chunk if kept[i] is None]
                asked.append((step, chunk, kept, todo))
                yield [Rendered(ids.tolist(), mask.int().tolist()) for ids, mask in map(tokens.tokens, todo)]

    waited, answers = time.time(), zip_answers(capture, requests())
    for rendered, captured in _closing(answers):
        step, chunk, kept, todo = asked.popleft()
        passes.at(step, status)
        count = sum(len(r.input_ids) for r in rendered)
        status.add(capture_s=time.time() - waited, sequences=len(todo), tokens=count)
        for index, seq in zip(todo, captured, strict=True):
            kept[index] = pack([seq])
            replay.put(index, kept[index])
        status.add(replayed_sequences=len(chunk) - len(todo))
        status.set(replay_bytes_used=replay.used)
        for position, index in chunk:
            yield position, index, kept[index]
        waited = time.time()
    passes.end(status)


def _closing(generator):
    """`generator`'s items, and the generator closed when this is (a request sent ahead is then answered)."""
    try:
        yield from generator
    finally:
        generator.close()


def zip_answers(capture, requests):
    """(rendered, states) for each request of `requests` (lists of rendered sequences, empty for none), in order:
    through the capture's `each_states` where it has one (vLLM's sends the next request before it reads the
    last one's files, so its engine is not idle meanwhile), else one `states` call a request."""
    if hasattr(capture, "each_states"):
        yield from capture.each_states(requests)
        return
    for rendered in requests:
        yield rendered, capture.states(rendered) if rendered else []


class _Ahead:
    """Iterates `items` (a generator) computed in a thread of its own, at most `depth` items ahead of the reader.
    An error in the thread is raised to the reader; leaving the `with` stops the thread and waits for it, so the
    engine it calls is never called from two threads (a service starting over starts a new one)."""

    _END = object()

    def __init__(self, items, depth: int):
        import queue

        self.items, self.queue, self.stopped = items, queue.Queue(maxsize=max(1, depth)), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="stream-capture")

    def __enter__(self) -> _Ahead:
        self.thread.start()
        return self

    def _run(self) -> None:
        import queue

        try:
            for item in self.items:
                while not self.stopped.is_set():
                    try:
                        self.queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if self.stopped.is_set():
                    return
            self.queue.put(self._END)
        except BaseException as err:  # the reader raises it
            self.queue.put(err)

    def __iter__(self):
        while True:
            item = self.queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def __exit__(self, *exc) -> None:
        import queue

        self.stopped.set()
        while self.thread.is_alive():  # it may be blocked on a full queue: empty it until it sees the flag
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self.items.close()


def _answer_evals(spool: Path, spec: StreamSpec, parent: int, status: _Status, capture, code: int) -> int:
    """Once the trainers are done: the eval stage's live target for each eval consumer (`StreamEval`), on the
    target loaded here, until every one has ended. Each request (`eval/<name>.request`: served states or greedy
    continuations, at the layers serving captures) is answered by the capture engine's own evaluator (the one
    `Capturing.open_eval` gives; HF's on the model loaded here) in `eval/<name>.answer`, or with the error that
    stopped it. `code`: the steps' outcome, returned when no eval consumer waits."""
    folder, evaluators, answered = spool / EVAL, {}, 0
    folder.mkdir(exist_ok=True)
    while not (spool / STOP).exists() and _trainer_alive(spec, parent):
        if not _role(_live_consumers(spool, spec, status), "eval"):
            break
        if status.values["state"] != "answering eval":
            status.update(state="answering eval")
        for request in sorted(folder.glob("*.request")):
            asked = pickle.loads(request.read_bytes())
            try:
                layers = tuple(asked["layers"])
                if layers not in evaluators:
                    evaluators[layers] = capture.evaluator(list(layers))
                live = evaluators[layers]
                if asked["kind"] == "served":
                    answer = [(aux.cpu(), best.cpu()) for aux, best in live.served(asked["sequences"])]
                else:
                    got = live.continuations(asked["prompts"], asked["max_new"])
                    answer = [(n, sequence, aux.cpu()) for n, sequence, aux in got]
                reply = {"answer": answer, "engine": live.describe()}
            except Exception as exc:  # the consumer fails naming it, rather than waiting
                reply = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"[stream] eval request {request.stem} failed: {reply['error']}", flush=True)
            with atomic_path(request.with_suffix(".answer")) as tmp:
                tmp.write_bytes(pickle.dumps(reply))
            request.unlink()
            answered += 1
        time.sleep(POLL_S)
    if answered:
        print(f"[stream] answered {answered} eval requests on the target loaded here", flush=True)
    return code


class _Passes:
    """One line in the service's log per epoch it streamed: the sequences it captured and those it replayed, so a
    log says how many capture passes a training (or a search's trials together) cost."""

    def __init__(self, per_epoch: int):
        self.per_epoch, self.epoch, self.mark = per_epoch, None, (0, 0)

    def at(self, step: int, status: _Status) -> None:
        if self.epoch != step // self.per_epoch:
            self.end(status)
            self.epoch = step // self.per_epoch

    def end(self, status: _Status) -> None:
        counts = (status.values["sequences"], status.values["replayed_sequences"])
        if self.epoch is not None:
            captured, replayed = (now - then for now, then in zip(counts, self.mark))
            print(f"[stream] epoch {self.epoch}: captured {captured} sequences, replayed {replayed}", flush=True)
        self.mark = counts


class _Replay:
    """The first epoch's states kept for the later ones, up to `budget` bytes (`train.stream.replay_bytes`; 0: every
    epoch captures again): one file per sequence, written atomically, kept across a resumed service."""

    def __init__(self, folder: Path, budget: int):
        self.folder, self.budget = folder, budget
        folder.mkdir(exist_ok=True)
        self.used = sum(p.stat().st_size for p in folder.glob("*.safetensors"))

    def path(self, index: int) -> Path:
        return self.folder / f"{index:09d}.safetensors"

    def get(self, index: int) -> dict[str, torch.Tensor] | None:
        return load_file(str(self.path(index))) if self.budget and self.path(index).exists() else None

    def put(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.used + size > self.budget or self.path(index).exists():
            return
        with atomic_path(self.path(index)) as tmp:
            save_file(tensors, str(tmp))
        self.used += self.path(index).stat().st_size


def _put(spool: Path, spec: StreamSpec, parent: int, status: _Status, store, name: str, tensors, declared) -> bool:
    """`tensors` into the store as `name` once it holds under `buffer_bytes` with them (an empty store always has
    room) and the store takes them (a full Mooncake segment refuses: wait); False when the trainer is gone or asked
    to stop. A shared service deletes what its consumers have read meanwhile (`_collect`)."""
    began, size = time.time(), stores.nbytes(tensors)
    while True:
        if (spool / STOP).exists() or not _trainer_alive(spec, parent):
            return False
        if spec.shared and not _collect(spool, spec, store, declared, status):
            print("[stream] every trainer has ended: stopping", flush=True)
            return False
        used, held = store.held_bytes(), len(store.keys())
        if used == 0 or (used + size <= spec.buffer_bytes and held < spec.buffer_sequences):
            if store.put(name, tensors):
                status.add(blocked_s=time.time() - began)
                status.set(peak_spool_bytes=max(status.values["peak_spool_bytes"], used + size))
                return True
            if used == 0:
                raise stores.StoreError(
                    f"{store.describe()}: an empty store refused sequence {name} ({size} bytes): its segment is "
                    "smaller than one sequence (raise train.stream.buffer_bytes)"
                )
        time.sleep(POLL_S)


# ---- consumers of a shared service (a layer search's trials; a Slurm job's trainer) ------------------------------


def register(spool: Path, consumer: str, role: str = "train") -> None:
    """`consumer` will read every file from the step it declares on: none is deleted before it has read it. An
    `eval` consumer reads no file: it asks the service for the eval stage's live target (`StreamEval`), and the
    service stays up, once its trainers are done, until every eval consumer has ended."""
    folder = Path(spool) / CONSUMERS
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / f"{consumer}.json") as tmp:
        tmp.write_text(json.dumps({"steps": None, "declared": None, "role": role}))


def declare(spool: Path, consumer: str, start_step: int, total_steps: int, ranks: int = 1) -> None:
    """The registered `consumer`'s steps: it reads the positions of steps `start_step`..`total_steps`, with `ranks`
    ranks (each keeps its floor, `StreamedSplit`). Declaring again (a requeued or resumed trainer) makes the service
    start over at the earliest declared step when it is the service's only consumer, and stop, saying why, when
    others read beside it (`_Conflict`)."""
    path = Path(spool) / CONSUMERS / f"{consumer}.json"
    if not path.exists():
        dropped = Path(spool) / DROPPED / consumer
        why = dropped.read_text() if dropped.exists() else "no consumer {consumer!r} is registered with that service"
        raise StreamError(f"train.stream.join={spool}: " + why.format(consumer=consumer))
    (Path(spool) / READS / consumer).mkdir(parents=True, exist_ok=True)
    shutil.rmtree(Path(spool) / FLOORS / consumer, ignore_errors=True)  # the last declaration's ranks' floors
    record = json.loads(path.read_text())
    with atomic_path(path) as tmp:
        tmp.write_text(
            json.dumps(record | {"steps": [start_step, total_steps], "declared": time.time(), "ranks": ranks})
        )
    dropped = Path(spool) / DROPPED / consumer
    if dropped.exists():  # left out as it declared (`_drop` writes the reason first, then unregisters it)
        unregister(spool, consumer)
        raise StreamError(f"train.stream.join={spool}: " + dropped.read_text().format(consumer=consumer))


def note_job(spool: Path, consumer: str, folder: Path, job_id: str) -> None:
    """The Slurm job that will read as `consumer`: the service asks Slurm about it where the consumer is silent
    (`_live_consumers`): one not declared yet (a job cancelled in the queue, or failed before training, never will),
    or one whose heartbeat stopped (a requeued job, pending or starting again, keeps its place; one ended for good is
    dropped)."""
    path = Path(spool) / CONSUMERS / f"{consumer}.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:  # left out already (`_drop`): its job fails as it declares
        return
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(record | {"job": [str(folder), str(job_id)]}))


def unregister(spool: Path, consumer: str) -> None:
    """`consumer` has ended (done, pruned or failed): the files it has not read are no longer kept for it."""
    (Path(spool) / CONSUMERS / f"{consumer}.json").unlink(missing_ok=True)
    shutil.rmtree(Path(spool) / READS / consumer, ignore_errors=True)


def consumers(spool: Path) -> dict[str, dict[str, Any]]:
    """The registered consumers: their steps (None until declared), when they declared them, and their heartbeat
    (the record's modification time, which a declared consumer's `_Beat` renews)."""
    found = {}
    for path in sorted((Path(spool) / CONSUMERS).glob("*.json")):
        try:
            found[path.stem] = json.loads(path.read_text()) | {"beat": path.stat().st_mtime}
        except (FileNotFoundError, json.JSONDecodeError):  # unregistered meanwhile
            pass
    return found


class _Beat:
    """A declared consumer's heartbeat: its record's modification time renewed every `HEARTBEAT_S` from a thread, so
    that a service on another node sees a trainer that died without unregistering (kill -9, a lost node)."""

    def __init__(self, spool: Path, consumer: str):
        self.path, self.stopped = Path(spool) / CONSUMERS / f"{consumer}.json", threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:  # unregistered: nothing to keep alive
                return

    def stop(self) -> None:
        self.stopped.set()


class _Rewind(Exception):
    """A consumer declared its steps again: the service starts over at the earliest declared step."""


class _Conflict(Exception):
    """A consumer declared its steps again while others read: starting over would offer them files for positions
    they have passed, kept for them until the buffer fills and every consumer waits. The service stops instead, and
    each consumer fails naming its log."""


def _declared_steps(spool: Path, spec: StreamSpec, parent: int, status: _Status) -> dict[str, dict] | None:
    """The registered trainers once every one has declared its steps, or, `train.stream.declare_timeout_s` after the
    first did, those that have (the others are dropped, each told why); None when stopped first or none is left."""
    status.update(state="waiting for consumers")
    first = None  # when the first trainer declared
    while not (spool / STOP).exists() and _trainer_alive(spec, parent):
        declared = _live_consumers(spool, spec, status)
        if not declared:
            return None
        trainers = _role(declared, "train")  # empty: eval consumers alone (the draft was trained already)
        waiting = [name for name, c in trainers.items() if c["steps"] is None]
        if not waiting:
            return trainers
        if len(waiting) < len(trainers):
            first = first or time.time()  # when this service saw it, by its own clock, not the trainer's host's
            timeout = spec.cfg.train.stream.declare_timeout_s
            if time.time() - first > timeout:
                for name in waiting:
                    _drop(spool, name, timeout)
                return {name: c for name, c in trainers.items() if name not in waiting}
        time.sleep(POLL_S * 5)
    return None


def _drop(spool: Path, name: str, timeout: float) -> None:
    """Leaves out a registered trainer that has not declared its steps `timeout` s after the first one did: the
    others start without it. Its `declare` fails with this reason (in `DROPPED`)."""
    why = (
        "the shared capture service started without consumer {consumer!r}: it had not declared its steps "
        f"{timeout:g} s after the first consumer did (train.stream.declare_timeout_s; on Slurm its job was still in "
        "the queue), and the others read without it. Run fewer trials at once (search.n_jobs) where the cluster "
        "cannot run them and the service together, or raise train.stream.declare_timeout_s"
    )
    (spool / DROPPED).mkdir(exist_ok=True)
    (spool / DROPPED / name).write_text(why)
    unregister(spool, name)
    print(f"[stream] consumer {name} had not declared its steps {timeout:g} s after the first did: "
          "starting without it", flush=True)  # fmt: skip


def _role(found: dict[str, dict[str, Any]], role: str) -> dict[str, dict[str, Any]]:
    return {name: c for name, c in found.items() if c.get("role", "train") == role}


def _live_consumers(spool: Path, spec: StreamSpec, status: _Status | None = None) -> dict[str, dict[str, Any]]:
    """The consumers, less those that have ended (unregistered here, the reason logged). A declared consumer whose
    heartbeat is older than `train.stream.stall_timeout_s` is asked after through Slurm where its job is known
    (`note_job`): a job pending, requeued or starting again keeps its place for up to `train.stream.requeue_wait_min`
    (the status says whom the service waits for), one that ended is dropped. A consumer with no job (a process on
    this machine) is dropped on the silence alone."""
    found, waiting = consumers(spool), []
    st = spec.cfg.train.stream
    for name, c in list(found.items()):
        silent = time.time() - c["beat"]
        if c["steps"] is not None and silent > st.stall_timeout_s:
            if not c.get("job"):
                why = f"gave no sign of life for {silent:.0f} s (train.stream.stall_timeout_s={st.stall_timeout_s:g})"
            else:
                state = _job_state(spec, *c["job"])
                if state in ACTIVE_STATES and silent <= st.requeue_wait_min * 60:
                    waiting.append(f"{name} (job {c['job'][1]} {state})")
                    continue
                why = (f"its job {c['job'][1]} is {state}" if state not in ACTIVE_STATES else
                       f"its job {c['job'][1]} has been {state} without a sign of life for {silent:.0f} s "
                       f"(train.stream.requeue_wait_min={st.requeue_wait_min:g})")  # fmt: skip
        elif c["steps"] is None and c.get("job") and _job_state(spec, *c["job"]) not in ACTIVE_STATES:
            why = f"its job {c['job'][1]} ended before it read ({_job_state(spec, *c['job'])})"
        else:
            continue
        print(f"[stream] consumer {name}: {why}: dropped", flush=True)
        unregister(spool, name)
        del found[name]
    if status is not None and waiting != status.values.get("waiting_for", []):
        status.update(waiting_for=waiting)
        if waiting:
            print(f"[stream] waiting for {', '.join(waiting)}", flush=True)
    return found


# Slurm's states of a job that may read again: queued, requeued, running, or Slurm could not say (sacct down)
ACTIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED", "UNKNOWN")
_JOB_STATES: dict[str, tuple[float, str]] = {}
JOB_CHECK_S = 30.0


def _job_state(spec: StreamSpec, folder: str, job_id: str) -> str:
    """Slurm's state of a consumer's job, asked of Slurm every `JOB_CHECK_S` at most."""
    from orchestrator import runner

    asked, state = _JOB_STATES.get(job_id, (0.0, "UNKNOWN"))
    if time.time() - asked >= JOB_CHECK_S:
        state = runner.job_state(spec.cfg.cluster, Path(folder), job_id)
        _JOB_STATES[job_id] = (time.time(), state)
    return state


def floor(spool: Path, name: str, c: dict[str, Any], batch: int) -> int:
    """The first position consumer `name` (declared as `c`) may still need: the lowest of its ranks' floors (each
    rank's is the first position of the step it reads, `StreamedSplit`), its declared first step's before a rank
    has written one."""
    start = c["steps"][0] * batch
    kept = []
    for rank in range(c.get("ranks") or 1):
        try:
            kept.append(max(start, int((spool / FLOORS / name / str(rank)).read_text())))
        except (FileNotFoundError, ValueError):  # not written yet (or being replaced)
            kept.append(start)
    return min(kept)


def _done_with(spool: Path, declared: dict[str, dict[str, Any]], floors: dict[str, int], position: int) -> bool:
    """Whether every consumer has read `position` (its mark) or is past it (its floor)."""
    return all(position < floors[name] or (spool / READS / name / f"{position:012d}").exists() for name in declared)


def _collect(spool: Path, spec: StreamSpec, store, began: dict[str, float], status: _Status | None = None) -> bool:
    """Deletes the files every consumer has read (or is past), and the read marks below every consumer's floor;
    False when no consumer is left. Raises `_Rewind` when a consumer has declared since the service began (`began`:
    each consumer's declaration then), `_Conflict` when others read meanwhile."""
    declared = _role(_live_consumers(spool, spec, status), "train")
    declared = {name: c for name, c in declared.items() if not (spool / DROPPED / name).exists()}  # leaving (`_drop`)
    if not declared:
        return False
    if any(c["steps"] is None for c in declared.values()):  # registered late: it may need any file
        return True
    again = [name for name, c in declared.items() if began.get(name) != c["declared"]]
    if again and len(again) < len(declared):
        others = [name for name in declared if name not in again]
        raise _Conflict(
            f"consumer {', '.join(again)} declared steps {declared[again[0]]['steps']} while {', '.join(others)} "
            "read: a shared service starts over for one consumer only when it is the only one"
        )
    if again:
        raise _Rewind(f"consumer {', '.join(again)} declared steps {declared[again[0]]['steps']}")
    batch = spec.cfg.train.batch_size
    floors = {name: floor(spool, name, c, batch) for name, c in declared.items()}
    for held in store.keys():
        if _done_with(spool, declared, floors, stores.position_of(held)):
            store.release(held)
    # a mark is kept while its consumer may still be behind it: a service started again (requeued) skips the
    # positions every consumer has read
    for name in declared:
        with os.scandir(spool / READS / name) as marks:
            for mark in marks:
                if mark.name.isdigit() and int(mark.name) < floors[name]:
                    Path(mark.path).unlink(missing_ok=True)
    return True


# ---- the trainer's side ----------------------------------------------------------------------------------------


def prepare(spool: Path, spec: StreamSpec, consumers: Iterable[str] = (), evals: Iterable[str] = ()) -> None:
    """The spool emptied of an earlier run's files (a resumed trainer asks from its cursor on; the replayed first
    epoch is kept), the `consumers` of a shared service registered, and its eval consumers (`evals`), and the
    service's spec written."""
    spool = Path(spool)
    spool.mkdir(parents=True, exist_ok=True)
    for entry in spool.iterdir():
        if entry.name == REPLAY and spec.replay_bytes:  # whole files of the first epoch, kept
            continue
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    for name in consumers:
        register(spool, name)
    for name in evals:
        register(spool, name, role="eval")
    (spool / SHARED).write_text(json.dumps({"mark": secrets.randbits(31), "host": socket.gethostname()}))
    (spool / SPEC).write_bytes(pickle.dumps(spec))


def check_shared(spool: Path, compute, what: str) -> None:
    """Every rank sees the spool `prepare` wrote (the same `SHARED` mark as rank 0): a spool on a node's own disk
    is not the service's, and a trainer there would wait for states that never come. Fails on each rank that does
    not, naming the folder and this node, before any state is awaited."""
    try:
        mark = json.loads((Path(spool) / SHARED).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        mark = {"mark": -1, "host": None}
    seen = torch.zeros(compute.world_size, dtype=torch.int64)
    seen[compute.rank] = mark["mark"]
    seen = compute.all_reduce_sum(seen.to(compute.device)).cpu() if compute.distributed else seen
    if mark["mark"] == -1 or seen[compute.rank] != seen[0]:
        found = "nothing there" if mark["mark"] == -1 else f"another service's folder (prepared on {mark['host']})"
        raise StreamError(
            f"{what}={spool}: this node ({socket.gethostname()}, rank {compute.rank}) does not see the capture "
            f"service's spool ({found}): the folder must be on a file system that the service's node and every "
            "trainer's share (a node's /tmp or /dev/shm is its own). Across nodes, set train.stream.spool to a "
            "shared folder, with train.stream.transport=mooncake so that the states themselves do not cross it"
        )


def serve_job(spool: str) -> int:
    """The service as a job of its own (submitit, `pipeline.submit_stream_service`): its log is the job's."""
    import submitit

    code = serve(Path(spool), submitit.JobEnvironment().paths.stdout)
    print(f"[stream] service ended with code {code}", flush=True)
    return code


class CaptureService:
    """The service as the trainer's rank 0 runs it locally: a child process with its log in the spool, stopped when
    training ends (or fails)."""

    def __init__(self, spool: Path, spec: StreamSpec):
        self.spool, self.spec, self.proc = Path(spool), spec, None

    @property
    def log(self) -> Path:
        return self.spool / LOG

    def start(self, consumers: Iterable[str] = (), evals: Iterable[str] = ()) -> CaptureService:
        """Starts the service on an emptied spool; a shared one (`StreamSpec.shared`) with its `consumers` and its
        eval consumers (`evals`) registered first."""
        prepare(self.spool, self.spec, consumers, evals)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.states.stream", str(self.spool)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ | {"PYTHONUNBUFFERED": "1"},
            )
        print(f"[train] capture service pid {self.proc.pid}: states streamed through {self.spool} (log {self.log})")
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        (self.spool / STOP).touch()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def read_status(spool: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(spool) / STATUS).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class StreamedSplit:
    """The train split as a `StateSource` read from the spool: `take(indices)` waits for each sequence's file, reads
    it (with `layers`' columns of what the extraction's layers captured) and deletes it. Any rank can read its share;
    the rank that started the service passes it, so that its exit is seen at once, the others watch its status.

    A consumer of a shared service (`consumer`: a joined one, each rank `rank` of `ranks`) marks what it read and
    keeps its floor in the spool (`floors/<consumer>/<rank>`: the first position of the step it reads), so that a
    service started again (requeued) goes on where its consumers are. A rank reads positions in order: it never
    takes a file below the last it took (a later epoch's copy of a sequence comes later). `watch`: the service's
    Slurm job, asked after where the service is silent (`ServiceJob`)."""

    def __init__(
        self,
        spool: Path,
        size: int,
        columns: torch.Tensor | None,
        stall_timeout_s: float,
        service: CaptureService | None = None,
        consumer: str | None = None,
        start_position: int = 0,
        beat: _Beat | None = None,
        rank: int = 0,
        batch: int = 1,
        watch: ServiceJob | None = None,
    ):
        self.spool, self.size, self.columns = Path(spool), size, columns
        self.stall_timeout_s, self.service, self.watch = stall_timeout_s, service, watch
        # a shared service's consumer marks what it read (the service deletes a file all its consumers read);
        # a trainer with a service of its own deletes each file as it reads it
        self.consumer, self.start_position, self.beat = consumer, start_position, beat
        self.rank, self.batch, self.next_position, self.floor_at = rank, batch, start_position, -1
        self.wait_s, self.opened = 0.0, time.time()
        self.store: stores.StateStore | None = None  # the service's, once it has published it
        self.address: dict[str, Any] | None = None
        self.connected = 0.0  # when the published address was last read (`_connect`)
        if consumer is not None:
            self._floor(start_position)

    def __len__(self) -> int:
        return self.size

    def take(self, indices: Iterable[int]) -> list[SequenceStates]:
        return [self._next(int(i)) for i in indices]

    def close(self, requeued: bool = False) -> None:
        """Ends the reading; `requeued`: this job was requeued (submitit's handler): its consumer stays registered
        for the job's next start, which declares again."""
        if self.service is not None:
            self.service.stop()
        if self.beat is not None:  # the rank that declared this consumer says it has ended, however it ended
            self.beat.stop()
            if not requeued:
                unregister(self.spool, self.consumer)
        if self.store is not None:
            self.store.close()

    def _next(self, index: int) -> SequenceStates:
        began = time.time()
        while True:
            tensors = self._take(index)
            if tensors is not None:
                self.wait_s += time.time() - began
                aux = tensors["aux_hidden_states"]
                return SequenceStates(
                    tensors["input_ids"].long(),
                    tensors["loss_mask"].bool(),
                    aux if self.columns is None else aux[:, self.columns],
                    tensors["teacher_hidden_state"],
                )
            self._check_alive(index)
            time.sleep(POLL_S)

    def _take(self, index: int) -> dict[str, torch.Tensor] | None:
        """Sequence `index`'s tensors at its earliest position from the last this rank took on (a later one is the
        same sequence in a later epoch), released (its own service's) or marked read (a shared one's); None while
        there is none."""
        if (self.store is None or time.time() - self.connected > 1.0) and not self._connect():
            return None  # the service has not opened its store yet
        found = [k for k in self.store.keys() if stores.index_of(k) == index]
        found = [k for k in found if stores.position_of(k) >= self.next_position]
        if self.consumer is not None:  # another consumer's, or one this consumer read in an earlier epoch
            found = [k for k in found if self._unread(k)]
        for name in found:
            try:
                tensors = self.store.take(name)
            except stores.StoreError:  # its service is gone (a requeued one's Mooncake master): ask again
                self.address = None
                return None
            if tensors is None:  # released meanwhile (another epoch's, read by every consumer)
                continue
            position = stores.position_of(name)
            if self.consumer is None:
                self.store.release(name)
            else:
                (self.spool / READS / self.consumer / name.split("-")[0]).touch()
                if position // self.batch * self.batch > self.floor_at:  # a new step: this rank's floor
                    self._floor(position // self.batch * self.batch)
            self.next_position = position + 1
            return tensors
        return None

    def _connect(self) -> bool:
        """The store the service published, opened again when it has changed (a service started again: its Mooncake
        master is new); False while there is none."""
        address, self.connected = stores.published(self.spool), time.time()
        if address is None or address == self.address:
            return self.store is not None
        if self.store is not None:
            self.store.close()
        self.store, self.address = stores.open_consumer_store(self.spool, address), address
        return True

    def _floor(self, position: int) -> None:
        folder = self.spool / FLOORS / self.consumer
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(folder / str(self.rank)) as tmp:
            tmp.write_text(str(position))
        self.floor_at = position

    def _unread(self, name: str) -> bool:
        position = name.split("-")[0]
        return int(position) >= self.start_position and not (self.spool / READS / self.consumer / position).exists()

    def _check_alive(self, index: int) -> None:
        self._connect()
        check_service(
            self.spool, self.service, f"sequence {index}", "streamed", self.stall_timeout_s, self.opened, self.watch
        )

    def report(self) -> dict[str, Any]:
        """What the stream cost: the trainer's wait, the service's capture rate, the spool's peak against the
        buffer."""
        status = read_status(self.spool) or {}
        capture_s = status.get("capture_s", 0.0)
        return {
            "transport": (status.get("store") or {}).get("transport", "file"),
            "store": status.get("store"),
            "wait_s": round(self.wait_s, 3),
            "captured_sequences": status.get("sequences", 0),
            "captured_tokens": status.get("tokens", 0),
            "capture_tokens_per_s": status.get("tokens", 0) / capture_s if capture_s else 0.0,
            "service_blocked_s": round(status.get("blocked_s", 0.0), 3),
            "replayed_sequences": status.get("replayed_sequences", 0),
            "replay_bytes_used": status.get("replay_bytes_used", 0),
            "peak_spool_bytes": status.get("peak_spool_bytes", 0),
        }


class ServiceJob:
    """A capture service that is a Slurm job of its own, as its consumers watch it: where the service is silent
    (exited, requeued, or its heartbeat older than `train.stream.stall_timeout_s`), Slurm says whether its job is
    coming back (pending, requeued, starting again: wait, up to `train.stream.requeue_wait_min`) or has ended (fail
    now, naming its state)."""

    def __init__(self, cfg, spool: Path, job_id: str):
        self.cfg, self.spool, self.job_id = cfg, Path(spool), job_id
        self.asked, self.state, self.silent_since, self.said = 0.0, "UNKNOWN", None, None

    @classmethod
    def of(cls, cfg, spool: Path) -> ServiceJob | None:
        path = Path(spool) / SERVICE_JOB
        if cfg.cluster.kind != "slurm" or not path.exists():
            return None
        return cls(cfg, spool, path.read_text().strip())

    def waits(self) -> str | None:
        """None when the service is not coming back; else what the consumer waits for (said once a state)."""
        from orchestrator import runner

        now = time.time()
        self.silent_since = self.silent_since or now
        if now - self.asked >= min(JOB_CHECK_S, self.cfg.train.stream.stall_timeout_s):
            self.asked, self.state = now, runner.job_state(self.cfg.cluster, self.spool, self.job_id)
        if self.state not in ACTIVE_STATES:
            return None
        if now - self.silent_since > self.cfg.train.stream.requeue_wait_min * 60:
            return None
        what = f"the capture service's job {self.job_id} ({self.state})"
        if what != self.said:
            wait = self.cfg.train.stream.requeue_wait_min
            print(f"[stream] waiting for {what} to serve again (train.stream.requeue_wait_min={wait:g})", flush=True)
            self.said = what
        return what

    def serving(self) -> None:
        self.silent_since, self.said = None, None

    def why(self) -> str:
        if self.state in ACTIVE_STATES:
            return (f"has been {self.state} for over train.stream.requeue_wait_min="
                    f"{self.cfg.train.stream.requeue_wait_min:g} minutes without serving")  # fmt: skip
        return f"is {self.state}: it is not coming back"


def check_service(
    spool: Path,
    service: CaptureService | None,
    awaited: str,
    done: str,
    stall_timeout_s: float,
    opened: float,
    watch: ServiceJob | None = None,
) -> None:
    """Raises `StreamError` naming the service's log when the service a consumer waits on for `awaited` has exited,
    stopped, or given no heartbeat for `stall_timeout_s` (since `opened` before its first). `service`: the one this
    process started, whose exit is seen at once; else the status tells (its pid on this host). `watch`: the
    service's Slurm job: while it is coming back (requeued, pending), the consumer waits instead."""
    status = read_status(spool)
    log = service.log if service else Path(status["log"]) if status else spool / LOG
    proc = service.proc if service else None
    if proc is not None and proc.poll() is not None:
        raise StreamError(
            f"the capture service (pid {proc.pid}) exited with code {proc.returncode} before {awaited} was {done}; "
            f"its log: {log}\n{_tail(log)}"
        )
    if status and status.get("state") == "stopped":
        raise StreamError(
            f"the capture service stopped before {awaited} was {done} (it saw no consumer left, was "
            f"asked to stop, or could not serve every consumer: the log says which); its log: {log}\n{_tail(log)}"
        )
    beat = status["heartbeat"] if status else opened
    exited = status and proc is None and status.get("host") == socket.gethostname() and not _pid_alive(status["pid"])
    silent = time.time() - beat > stall_timeout_s
    if not (exited or silent or (status and status.get("state") == "requeued")):
        if watch is not None:
            watch.serving()
        return
    if watch is not None:
        if watch.waits():
            return
        raise StreamError(
            f"the capture service's Slurm job {watch.job_id} {watch.why()}, and {awaited} was not {done}; "
            f"its log: {log}\n{_tail(log)}"
        )
    if exited:
        raise StreamError(
            f"the capture service (pid {status['pid']}) has exited before {awaited} was {done}; "
            f"its log: {log}\n{_tail(log)}"
        )
    if silent:
        raise StreamError(
            f"the capture service has given no sign of life for {time.time() - beat:.0f} s "
            f"(train.stream.stall_timeout_s={stall_timeout_s}) while {awaited} was awaited; "
            f"its log: {log}\n{_tail(log)}"
        )


class StreamEval:
    """The eval stage's live target (`Capturing.open_eval`'s interface) in the capture service that trained the
    draft, so that the target is loaded once for training and eval: eval's requests go to the service
    (`eval/<consumer>-<n>.request`), which answers them with its capture engine's evaluator on the target it holds
    (`_answer_evals`) once its trainers are done. The tokenizer is read here (it is small)."""

    def __init__(
        self, spool: Path, consumer: str, layers: list[int], tokenizer, stall_timeout_s: float, watch=None
    ):  # fmt: skip
        self.spool, self.consumer, self.layers, self.tokenizer = Path(spool), consumer, list(layers), tokenizer
        self.stall_timeout_s, self.opened, self.sent, self.engine = stall_timeout_s, time.time(), 0, None
        self.watch = watch  # the service's Slurm job (`ServiceJob`), or None
        declare(self.spool, consumer, 0, 0)
        self.beat = _Beat(self.spool, consumer)

    def _ask(self, kind: str, **what) -> list:
        self.sent += 1
        name = f"{self.consumer}-{self.sent:06d}"
        folder = self.spool / EVAL
        with atomic_path(folder / f"{name}.request") as tmp:
            tmp.write_bytes(pickle.dumps({"kind": kind, "layers": self.layers} | what))
        answer = folder / f"{name}.answer"
        while not answer.exists():
            check_service(self.spool, None, f"eval's request {name}", "answered", self.stall_timeout_s, self.opened,
                          self.watch)  # fmt: skip
            time.sleep(POLL_S)
        reply = pickle.loads(answer.read_bytes())
        answer.unlink()
        if "error" in reply:
            log = (read_status(self.spool) or {}).get("log", self.spool / LOG)
            raise StreamError(f"the capture service could not answer eval's request {name}: {reply['error']}; its "
                              f"log: {log}")  # fmt: skip
        self.engine = reply["engine"]
        return reply["answer"]

    # One request a sequence or prompt, asked as eval reads the answers: an answer holds one sequence's states
    # (at Kimi's shape and 8192 tokens, 350 MB in bf16 for three aux states), not the whole validation set's.

    def served(self, sequences: list[list[int]]):
        for sequence in sequences:
            yield from self._ask("served", sequences=[sequence])

    def continuations(self, prompts: list[list[int]], max_new: int):
        for prompt in prompts:
            yield from self._ask("continuations", prompts=[prompt], max_new=max_new)

    def describe(self) -> str:
        return f"{self.engine}, in the capture service of train.states=stream ({self.spool})"

    def close(self) -> None:
        self.beat.stop()
        unregister(self.spool, self.consumer)


def eval_consumer(plan) -> str:
    """The name a run's eval stage has among a capture service's consumers (its training's is the run's name)."""
    return f"{Path(plan.run_dir).name}.eval"


def open_eval(cfg, plan, layers: list[int], compute):
    """The eval stage's live target in the capture service it was registered with (`train.stream.join`, by the
    run's driver or a search's), or None: eval then loads the target itself. The service computes in the
    extraction's precision, so an eval job that computes in another loads its own, saying so."""
    from orchestrator.targets import load_tokenizer

    join = cfg.train.stream.join
    if (
        cfg.train.states != "stream"
        or join is None
        or not (Path(join) / CONSUMERS / f"{eval_consumer(plan)}.json").exists()
    ):
        return None
    opened = time.time()  # the service says what it answers before its engine starts: a starting one is waited for
    watch = ServiceJob.of(cfg, Path(join))
    while "eval_layers" not in (status := read_status(Path(join)) or {}):
        check_service(Path(join), None, "what it answers eval at", "known", cfg.train.stream.stall_timeout_s, opened,
                      watch)  # fmt: skip
        time.sleep(POLL_S)
    answerable = status["eval_layers"]
    why = None
    if status.get("dtype") not in (None, str(compute.dtype)):
        why = (f"the capture service computes in {status['dtype']} and this job in {compute.dtype} "
               "(extract.precision, eval.precision)")  # fmt: skip
    elif answerable is not None and not set(layers) <= set(answerable):
        why = f"serving captures {layers} for the draft's config, and the capture service only {answerable}"
    if why:
        print(f"[eval] {why}: the target is loaded here")
        unregister(Path(join), eval_consumer(plan))
        return None
    tokenizer = load_tokenizer(Path(plan.target_dir), cfg.target.trust_remote_code, cfg.data.chat_template)
    print(f"[eval] the live target is the capture service's ({join}): it is not loaded again")
    return StreamEval(Path(join), eval_consumer(plan), layers, tokenizer, cfg.train.stream.stall_timeout_s, watch)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def open_stream(cfg, plan, manifest: dict[str, Any], layers: list[int], compute, start_step: int, total: int):
    """The train split as a stream: rank 0 starts the service (emptying the spool first), every rank reads its
    share from the spool once rank 0 has started it."""
    from orchestrator.states.shards import load_split

    st = cfg.train.stream
    size = len(load_split(plan.dir("extract"), manifest, "train", verify=False, tokens_only=True))
    columns = layer_columns(manifest, layers)
    if st.join is not None:  # a service the layer search runs for its trials: this run is one of its consumers
        spool, consumer, beat = Path(st.join), Path(plan.run_dir).name, None
        check_shared(spool, compute, "train.stream.join")
        if compute.is_main:
            _check_joinable(spool, cfg, plan)
            declare(spool, consumer, start_step, total, ranks=compute.world_size)
            beat = _Beat(spool, consumer)
        compute.barrier()
        start = start_step * cfg.train.batch_size
        return StreamedSplit(
            spool, size, columns, st.stall_timeout_s, consumer=consumer, start_position=start, beat=beat,
            rank=compute.rank, batch=cfg.train.batch_size, watch=ServiceJob.of(cfg, spool),
        )  # fmt: skip
    spool = spool_dir(cfg, Path(plan.dir("train")) / "stream")
    service = None
    if compute.is_main:
        service = CaptureService(spool, StreamSpec.of(cfg, plan, os.getpid(), (start_step, total))).start()
    compute.barrier()
    check_shared(spool, compute, "train.stream.spool")
    return StreamedSplit(spool, size, columns, st.stall_timeout_s, service)


def read_nothing(cfg, plan, manifest: dict[str, Any]) -> StreamedSplit:
    """The stream of a training with no step left (a job requeued after its last checkpoint, to export): it declares
    nothing and reads nothing; its report is the service's status as the spool keeps it."""
    from orchestrator.states.shards import load_split

    st = cfg.train.stream
    size = len(load_split(plan.dir("extract"), manifest, "train", verify=False, tokens_only=True))
    spool = Path(st.join) if st.join is not None else spool_dir(cfg, Path(plan.dir("train")) / "stream")
    return StreamedSplit(spool, size, None, st.stall_timeout_s)


def _check_joinable(spool: Path, cfg, plan) -> None:
    """A joined service streams this run's extraction in this run's order, or the draft would learn other batches."""
    try:
        spec: StreamSpec = pickle.loads((spool / SPEC).read_bytes())
    except FileNotFoundError:
        raise StreamError(f"train.stream.join={spool}: no capture service was started there ({SPEC} is missing)")
    theirs, ours = spec.cfg.train, cfg.train
    differ = [k for k in ("batch_size", "seed") if getattr(theirs, k) != getattr(ours, k)]
    if Path(spec.extract_dir) != Path(plan.dir("extract")):
        differ.append(f"the extraction ({spec.extract_dir}, not {plan.dir('extract')})")
    if differ:
        raise StreamError(
            f"train.stream.join={spool}: the service streams another order than this run reads; it differs in "
            + ", ".join(f"train.{k}" if " " not in k else k for k in differ)
        )


if __name__ == "__main__":
    try:
        sys.exit(serve(Path(sys.argv[1])))
    except ArtifactError as err:
        print(f"[stream] {err}", file=sys.stderr)
        sys.exit(2)
