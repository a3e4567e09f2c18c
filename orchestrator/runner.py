"""The only module that talks to submitit: turns a stage call into a job on the configured cluster."""

from __future__ import annotations

import codecs
import dataclasses
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import submitit

from orchestrator.config import ClusterConfig, Resources


class StageFailed(RuntimeError):
    """A stage job that raised or died; carries the job's log tail, and `line`, what the command line says of it:
    one line naming the stage, its error (whose message names the key or file) and the log to read."""

    def __init__(self, message: str, line: str | None = None):
        super().__init__(message)
        self.line = line or message.splitlines()[0]


class SubmissionFailed(RuntimeError):
    """The cluster refused a stage job; the run's jobs submitted before it were cancelled."""


def executor(
    cluster: ClusterConfig,
    folder: Path,
    name: str,
    resources: Resources,
    tasks_per_node: int = 1,
    dependency: list[str] | None = None,
    after_start: list[str] | None = None,
    resumes: bool = False,
):
    """submitit's executor for one stage job: `tasks_per_node` processes on each of `resources.nodes` nodes (one
    torch.distributed rank each, see `StageJob`). On Slurm the job starts once the `dependency` jobs have completed
    and the `after_start` jobs have started; it is signalled `cluster.signal_delay_s` before its time limit, and
    requeued then (submitit) up to `cluster.spare_requeues` times. A job that `resumes` where it stopped (training
    from its checkpoint, extraction per shard, the capture service from its consumers' floors) and asks more than the
    partition's longest job runs as several allocations of that length (`allocations`), each requeued at its
    limit."""
    folder = Path(folder)
    if cluster.kind == "debug":
        if tasks_per_node * resources.nodes > 1:
            raise ValueError(
                "cluster.kind=debug runs a job in this process: it cannot run "
                f"{tasks_per_node * resources.nodes} tasks; use cluster=local"
            )
        ex = submitit.DebugExecutor(folder=folder)
    elif cluster.kind == "local":
        if resources.nodes > 1:
            raise ValueError(f"cluster.kind=local runs on this machine: resources.nodes={resources.nodes}, expected 1")
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(
            timeout_min=resources.timeout_min, tasks_per_node=tasks_per_node, gpus_per_node=resources.gpus_per_node
        )
    elif cluster.kind == "slurm":
        most = site_max_time(cluster)[0] if resumes else None
        count = allocations(resources.timeout_min, most)
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=count - 1 + cluster.spare_requeues)
        if count > 1:
            resources = dataclasses.replace(resources, timeout_min=most)
        ex.update_parameters(**slurm_parameters(cluster, name, resources, tasks_per_node, dependency, after_start))
    else:
        raise ValueError(f"cluster.kind={cluster.kind!r}: expected local, debug or slurm")
    return ex


def slurm_minutes(text: str) -> int | None:
    """Whole minutes of a Slurm time limit as `sinfo -o %l` prints it, in any of Slurm's formats (minutes,
    minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds; sbatch(1));
    None for `infinite` / `UNLIMITED` / `n/a`. ValueError for anything else."""
    text = text.strip()
    if text.lower() in ("infinite", "unlimited", "n/a"):
        return None
    days, dash, clock = text.rpartition("-")
    try:
        parts = [int(x) for x in clock.split(":")]
        day_count = int(days) if dash else 0
    except ValueError:
        raise ValueError(f"not a Slurm time limit: {text!r}") from None
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"not a Slurm time limit: {text!r}")
    if dash:  # days-hours[:minutes[:seconds]]
        hours, minutes = parts[0], parts[1] if len(parts) > 1 else 0
    elif len(parts) == 3:  # hours:minutes:seconds
        hours, minutes = parts[0], parts[1]
    else:  # minutes[:seconds]
        hours, minutes = 0, parts[0]
    return (day_count * 24 + hours) * 60 + minutes


def partition_max_time(partition: str | None) -> tuple[int | None, str] | None:
    """The partition's longest job in minutes as this Slurm cluster says it (`sinfo -h -o "%P %l"`; the default
    partition, marked `*`, where `partition` is None), and where that came from; None where sinfo is not here or
    does not answer. (None, ...) for a partition without a limit."""
    import shutil
    import subprocess

    if shutil.which("sinfo") is None:
        return None
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%P %l"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    for line in done.stdout.splitlines():
        name, _, limit = line.strip().partition(" ")
        default = name.endswith("*")
        name = name.rstrip("*")
        if name == partition or (partition is None and default):
            return slurm_minutes(limit), f"sinfo's MaxTime of partition {name}"
    return None


# the stages whose job resumes where it stopped when Slurm requeues it: one longer than the partition allows runs as
# several allocations (`executor`); eval and serve start over, so each must fit one (`preflight`)
RESUMING = ("extract", "train")
_SINFO: dict[str | None, tuple[int | None, str] | None] = {}


def site_max_time(cluster: ClusterConfig) -> tuple[int | None, str]:
    """The partition's longest job in minutes and where that came from: `cluster.max_time_min`, else on a Slurm
    cluster what `sinfo` says of `cluster.partition` (asked once a process); (None, ...) where neither says."""
    if cluster.max_time_min is not None:
        return cluster.max_time_min, f"cluster.max_time_min={cluster.max_time_min}"
    if cluster.kind != "slurm":
        return None, "no partition limit off Slurm"
    if cluster.partition not in _SINFO:
        _SINFO[cluster.partition] = partition_max_time(cluster.partition)
    most, source = _SINFO[cluster.partition] or (None, "sinfo did not answer")
    return most, f"{source}; cluster.max_time_min sets it"


def allocations(minutes: int, most: int | None) -> int:
    """How many allocations of at most `most` minutes a job of `minutes` takes (Slurm requeues it at each limit)."""
    return 1 if most is None or minutes <= most else -(-minutes // most)


def slurm_parameters(
    cluster: ClusterConfig,
    name: str,
    resources: Resources,
    tasks_per_node: int,
    dependency: list[str] | None,
    after_start: list[str] | None = None,
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "job_name": name,
        "nodes": resources.nodes,
        "cpus_per_task": resources.cpus_per_task,
        "mem": f"{resources.mem_gb}GB",
        "time": resources.timeout_min,
        "ntasks_per_node": tasks_per_node,
        "signal_delay_s": cluster.signal_delay_s,
    }
    if resources.gpus_per_node:
        params["gpus_per_node"] = resources.gpus_per_node
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(cluster, key)
        if value:
            params[key] = value
    if cluster.setup:
        params["setup"] = list(cluster.setup)
    # One task that exits with an error ends the job's other tasks: a rank left waiting for a dead peer holds the
    # GPUs until the time limit otherwise.
    params["srun_args"] = ["--kill-on-bad-exit=1"]
    rules = []
    if dependency:
        # A failed upstream job cancels its dependents instead of leaving them pending forever.
        rules.append("afterok:" + ":".join(dependency))
        params["additional_parameters"] = {"kill_on_invalid_dep": "yes"}
    if after_start:  # sbatch(1): "after:job_id" begins once the job has started; "," joins rules that all must hold
        rules.append("after:" + ":".join(after_start))
    if rules:
        params["dependency"] = ",".join(rules)
    return params


class StageJob(submitit.helpers.Checkpointable):
    """A stage as a submitit job. On preemption or time-out (SIGUSR2 on Slurm) submitit calls `checkpoint`,
    which requeues the same call: training then resumes from its own checkpoint file, while extraction resumes
    at shard granularity and serving restarts its benchmark clean.

    Every task of the job runs this call. Each first exports its place in the job (submitit's task model: rank,
    world size, local rank, the first node's address and a port derived from the job id) as torch.distributed's
    standard variables, which `compute.setup` reads."""

    def __call__(self, run: Callable[..., Any], stage: str, cfg, plan, run_id: str, finalize: bool):
        """`run(stage, cfg, plan, run_id, finalize=finalize)` in this task: the pipeline's `run_stage`."""
        env = submitit.JobEnvironment()
        if env.num_tasks > 1:
            # CUDA_VISIBLE_DEVICES stays the job's: compute.setup splits the node's GPUs between its tasks.
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        try:
            result = run(stage, cfg, plan, run_id, finalize=finalize)
        except BaseException as exc:
            # When one rank fails, its peers fail after it (their collectives are aborted): the time of each
            # rank's failure tells `wait` which one was the cause.
            _write_failure(env, {"rank": env.global_rank, "time": time.time(), "error": f"{type(exc).__name__}: {exc}"})
            raise
        if env.name() != "debug":  # a job process of its own (a debug job runs in the driver's)
            # The stage's work is done: a pre-emption signal from now on is ignored, not obeyed. Submitit's handler
            # would requeue a finished stage; once the interpreter exits, Python restores the signal's default
            # action, which kills the task, and Slurm records a job whose work completed as FAILED.
            signal.signal(getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG), signal.SIG_IGN)
            exiting()
        return result


class Requeueable(submitit.helpers.Checkpointable):
    """A call that is not a stage (the capture service of a streamed training) as a job Slurm requeues on its time
    limit or pre-emption, as `StageJob`: it starts again under the same job id, and resumes from its own durable
    state (the service: from its consumers' floors, `states.stream`)."""

    def __call__(self, fn: Callable[..., Any], *args):
        result = fn(*args)
        if submitit.JobEnvironment().name() != "debug":  # done: a late signal is ignored (see StageJob)
            signal.signal(getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG), signal.SIG_IGN)
            exiting()
        return result


def exiting() -> None:
    """Called by a process whose work is done and which is about to exit (a job task once its call returned, the
    command line once its run ended): its objects go to the garbage collector's permanent generation
    (`gc.freeze`), so the interpreter's collections at exit no longer walk them. A job that imported torch, MLflow
    and transformers spent about a second there on 2 cores (0.9 s of 3.5 s for the imports and exit alone); the
    atexit handlers (MLflow's, logging's) still run and every file is still flushed and closed. Never in a process
    that goes on working: what it frees later would stay allocated."""
    import gc

    gc.freeze()


def submit(
    cluster: ClusterConfig,
    folder: Path,
    name: str,
    resources: Resources,
    tasks_per_node: int,
    *args,
    dependency=None,
    after_start=None,
    resumes=False,
):
    ex = executor(cluster, folder, name, resources, tasks_per_node, dependency, after_start, resumes)
    return ex.submit(StageJob(), *args)


def job_state(cluster: ClusterConfig, folder: Path, job_id: str) -> str:
    """Slurm's state of a job submitted earlier (e.g. by another sweep point, or a stream's other side), asked of
    Slurm now (submitit's watcher would answer from a cache up to ten minutes old), or UNKNOWN."""
    if cluster.kind != "slurm":
        return "UNKNOWN"
    try:
        state = submitit.SlurmJob(folder=folder, job_id=job_id).get_info(mode="force").get("State") or "UNKNOWN"
    except Exception:
        return "UNKNOWN"
    return state.split()[0]  # "CANCELLED by 0": the state


ACTIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED")


def wait(job, stage: str, follow_log: bool = True) -> Any:
    """The job's result, or StageFailed with the error and the tail of the job's stderr. With `follow_log`, a job
    that runs in another process (local or Slurm) has its log streamed to the console meanwhile; a debug job runs
    in this process, so its output reaches the console anyway."""
    if follow_log and not isinstance(job, submitit.DebugJob):
        print(f"[{stage}] job {job.job_id} log: {job.paths.stdout} (stderr: {job.paths.stderr})", flush=True)
        follow_logs(job)
    try:
        return job.results()[0]  # every task's outcome (any rank's error raises); rank 0 holds the stage's result
    except Exception as exc:  # submitit wraps the remote traceback in its own exception types
        tail = ""
        try:
            tail = "\n".join((job.stderr() or "").splitlines()[-30:])
        except Exception:
            pass
        first = first_failure(job)
        cause = f"rank {first['rank']} failed first: {first['error']}\n" if first else ""
        rank = f"rank {first['rank']} failed first: " if first and job.num_tasks > 1 else ""
        error = (first["error"].splitlines() or [""])[0] if first else error_line(str(exc))
        log = job.task(first["rank"] if first else 0).paths.stderr
        raise StageFailed(
            f"stage {stage} (job {job.job_id}) failed: {cause}{exc}\n--- job log tail ---\n{tail}",
            line=f"stage {stage} (job {job.job_id}) failed: {rank}{error}; log: {log}",
        ) from None


def error_line(report: str) -> str:
    """The exception line (`Type: message`) of a traceback as submitit reports it, the last of its kind: what
    was raised, below the frames; the report's first line where it has none."""
    raised = [line for line in report.splitlines() if re.match(r"[A-Za-z_][\w.]*: \S", line)]
    return raised[-1] if raised else (report.splitlines() or [""])[0]


def _write_failure(env, record: dict[str, Any]) -> None:
    import json

    try:
        (Path(env.paths.folder) / f"{env.job_id}_{env.global_rank}_failure.json").write_text(json.dumps(record))
    except Exception:  # no job folder (a debug job), a full disk: nothing may hide the error being raised
        pass


def attempt_id() -> str:
    """This job attempt's name, the same in all of its tasks: the job id, and Slurm's restart count after a
    requeue. Outside a job (a test calling a stage itself), "nojob"."""
    import os

    try:
        job_id = submitit.JobEnvironment().job_id
    except Exception:
        return "nojob"
    return f"{job_id}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def peer_failures() -> list[dict[str, Any]]:
    """The failure records the tasks of this job have written so far (see `StageJob`), earliest first."""
    try:
        env = submitit.JobEnvironment()
        return _failure_records(Path(env.paths.folder), env.job_id)
    except Exception:
        return []


def _failure_records(folder: Path, job_id: str) -> list[dict[str, Any]]:
    import json

    records = []
    for path in folder.glob(f"{job_id}_*_failure.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: r["time"])


def first_failure(job) -> dict[str, Any] | None:
    """The failure record of the job's rank that failed first (its peers' errors follow from it), if any rank
    wrote one."""
    records = _failure_records(Path(job.paths.folder), job.job_id)
    return records[0] if records else None


def follow_logs(job, out: TextIO | None = None, err: TextIO | None = None, poll_s: float = 0.3) -> None:
    """Copies the job's stdout and stderr files (to `out` and `err`, the console by default) from their start as
    they grow, as `tail -f` would, until the job is done, then copies what is left. Carriage returns pass through
    unchanged, so progress bars redraw in place."""
    out = sys.stdout if out is None else out  # looked up per call: pytest and others swap sys.stdout
    err = sys.stderr if err is None else err
    logs = [_FollowedFile(job.paths.stdout, out), _FollowedFile(job.paths.stderr, err)]
    while True:
        done = job.done()  # read before copying, so the last copy sees everything the job wrote
        for log in logs:
            log.copy_new_bytes()
        if done:
            return
        time.sleep(poll_s)


class _FollowedFile:
    """A file that another process appends to (and may not have created yet), copied to a stream piece by piece."""

    def __init__(self, path: Path, sink: TextIO):
        self.path = Path(path)
        self.sink = sink
        self.offset = 0
        # A read can end inside a multi-byte character: the decoder keeps the partial bytes for the next one.
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def copy_new_bytes(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        if data:
            self.offset += len(data)
            self.sink.write(self.decoder.decode(data))
            self.sink.flush()


def render_sbatch(
    cluster: ClusterConfig,
    folder: Path,
    name: str,
    resources: Resources,
    tasks_per_node: int = 1,
    dependency: list[str] | None = None,
) -> str:
    """The sbatch file submitit would write for a stage (for the golden tests), written by submitit's own function
    from the parameters `executor` gives its SlurmExecutor: on any machine, where the executor itself refuses to
    start without `srun` on the PATH."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = slurm_parameters(cluster, name, resources, tasks_per_node, dependency, None)
    return _make_sbatch_string(command=f"python -u -m submitit.core._submit {folder}", folder=folder, **params)
