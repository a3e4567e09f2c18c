"""Which devices, which dtype, which rank, how many: decided once per job, from the job.

A stage job's world comes from submitit's task model (`runner.StageJob` exports it as torch's standard
variables: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). `setup` turns that and the
stage's resources into a `Compute`: the process group (NCCL on GPUs, gloo on CPUs), the devices this process
owns and the dtype it computes in. Stages, `targets.py` and the reference engine receive a `Compute`; nothing
else calls `torch.cuda` or reads rank variables.

Devices: a job given GPUs computes on them, and fails if it sees none. Its N visible GPUs per node are split
evenly between the node's tasks in local-rank order: one GPU each when there is a task per GPU (training; the
extraction of a target that fits one GPU), several when a task must spread a large target over them.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRECISIONS = ("auto", "float32", "bfloat16")


class ComputeError(RuntimeError):
    """A job whose resources and the hardware it landed on disagree."""


def resolve_precision(precision: str, gpus_per_node: int) -> str:
    """`auto` is bfloat16 on GPUs and float32 on CPUs; decided from the stage's resources, so a plan (and its cache
    keys) knows the dtype before any job starts."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    if precision == "auto":
        return "bfloat16" if gpus_per_node > 0 else "float32"
    return precision


@dataclass(frozen=True)
class Compute:
    devices: tuple[torch.device, ...]
    dtype: torch.dtype
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None  # the process group's, when world_size > 1
    _owns_group: bool = field(default=False, compare=False, repr=False)

    @property
    def device(self) -> torch.device:
        """This process's first device: where its inputs and small models go."""
        return self.devices[0]

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes checkpoints, exports, manifests and metrics."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> dict:
        """What the summary and the MLflow run record about how a stage ran."""
        return {
            "device": self.device.type,
            "devices": [str(d) for d in self.devices],
            "dtype": str(self.dtype).removeprefix("torch."),
            "world_size": self.world_size,
            "backend": self.backend,
            "subnormals": denormal_mode(),  # on the CPU threads: "flushed" in a stage job (pipeline.run_stage)
        }

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of `values` over all ranks; itself when alone."""
        return self._all_reduce(values, torch.distributed.ReduceOp.SUM)

    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of `values` over all ranks; itself when alone."""
        return self._all_reduce(values, torch.distributed.ReduceOp.MAX)

    def _all_reduce(self, values: torch.Tensor, op) -> torch.Tensor:
        if not self.distributed:
            return values
        moved = values.to(self.device if self.backend == "nccl" else "cpu")
        torch.distributed.all_reduce(moved, op=op)
        return moved.to(values.device)

    def close(self, failed: bool = False) -> None:
        """Ends this process's part of the process group. `failed`: this rank raised, so its peers may be waiting
        in a collective for it; the group is aborted (not destroyed, which would wait for them) and their pending
        collectives fail at once with a connection error, instead of blocking until the collective timeout.
        Otherwise every rank first waits for the others (rank 0 may still be exporting), so that no rank tears its
        end of the group down while a peer's is in use: a gloo rank that left early was seen to abort at exit
        ("terminate called without an active exception"), failing a job whose work had completed."""
        if not (self._owns_group and torch.distributed.is_initialized()):
            return
        if failed:
            try:
                torch.distributed.distributed_c10d._abort_process_group()  # torch's own (experimental) abort
                return
            except Exception:  # a backend without abort: destroying the group closes its connections too
                pass
        else:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def flush_denormals() -> bool:
    """Subnormal floats flushed to zero (x86's FTZ and DAZ, AArch64's FZ) on every torch CPU thread; whether they
    are now. A CPU computes on subnormals (below 1.2e-38 in float32) in microcode, tens of times slower: the
    softmaxes and SiLUs of a small model trained at a high rate make many, and the tiny Llama's 300-step build took
    1.7 times as long without this (docs/measurements.md#subnormal-floats). The numbers change only where a value
    is that small.

    The mode is each thread's own (torch.set_flush_denormal sets the calling thread's): torch's OpenMP threads take
    it from the thread that starts them, so this must run before the process's first parallel operation. A job
    calls it first (`pipeline.run_stage`); False says some thread started earlier keeps subnormals."""
    torch.set_flush_denormal(True)
    return denormal_mode() == "flushed"


def denormal_mode() -> str:
    """The mode of torch's CPU threads: "flushed" (every one flushes subnormals to zero), "kept" (none does) or
    "mixed". Twice the smallest subnormal, made from its bits (a float literal would itself be flushed), on every
    thread's share of a parallel multiply."""
    doubled = torch.ones(1 << 18, dtype=torch.int32).view(torch.float32) * 2.0
    flushed = int((doubled == 0).sum())
    return "flushed" if flushed == doubled.numel() else "kept" if flushed == 0 else "mixed"


def cpu_name() -> str:
    """The processor, as /proc/cpuinfo names it, with its family and model where it gives them: machines that
    share a host name (containers and VMs often do) can differ in it, and a tiny target's weights and a server's
    speed with it (docs/measurements.md#figures-and-the-processor)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (s.strip() for s in line.partition(":"))
            if key in ("model name", "cpu family", "model") and key not in fields:
                fields[key] = value
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


@functools.cache  # a process's machine does not change: nvidia-smi runs once per job
def hardware(gpus: bool) -> str:
    """The machine a measurement ran on, in words: the processor and, for a job given GPUs, the node's GPUs as
    nvidia-smi names them. nvidia-smi, not torch.cuda: no CUDA context is opened in a job whose engine, started
    beside it, sizes its KV cache from the device memory it finds free."""
    words = cpu_name()
    smi = shutil.which("nvidia-smi") if gpus else None
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            out = ""
        names = [line.strip() for line in out.splitlines() if line.strip()]
        if names:
            counts = {n: names.count(n) for n in dict.fromkeys(names)}
            words += "; " + ", ".join(f"{k}x {n}" for n, k in counts.items())
    return words


def cpu(dtype: str = "float32") -> Compute:
    """One process on the CPU: tools, tests and anything outside a stage job."""
    return Compute(devices=(torch.device("cpu"),), dtype=DTYPES[dtype])


def setup(precision: str, gpus_per_node: int, collective_timeout_min: float, what: str) -> Compute:
    """The Compute of this process in a stage job with `gpus_per_node` GPUs; starts the process group when the
    job has more than one task. A collective (and the group's start-up) that waits longer than
    `collective_timeout_min` for a peer fails, so a rank that hangs or died ends the job in minutes, not at its
    time limit. `what` names the config node in errors (e.g. "train.resources")."""
    dtype = DTYPES[resolve_precision(precision, gpus_per_node)]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpus_per_node > 0:
        devices = _gpus_of_task(local_rank, local_world, gpus_per_node, what)
    else:
        devices = (torch.device("cpu"),)
    backend = None
    owns = False
    if world > 1:
        backend = "nccl" if devices[0].type == "cuda" else "gloo"
        if not torch.distributed.is_initialized():
            if devices[0].type == "cuda":
                torch.cuda.set_device(devices[0])
            torch.distributed.init_process_group(
                backend,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(minutes=collective_timeout_min),
                device_id=devices[0] if devices[0].type == "cuda" else None,
            )
            owns = True
    return Compute(devices, dtype, rank, local_rank, world, backend, owns)


def _gpus_of_task(local_rank: int, local_world: int, gpus_per_node: int, what: str) -> tuple[torch.device, ...]:
    if not torch.cuda.is_available():
        raise ComputeError(
            f"{what}.gpus_per_node={gpus_per_node}, but this job sees no CUDA device (torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Run it where the GPUs are, or set "
            f"{what}.gpus_per_node=0 to compute on the CPU."
        )
    visible = torch.cuda.device_count()
    if visible < local_world or visible % local_world:
        raise ComputeError(
            f"{what}: {local_world} tasks on this node share {visible} visible GPUs; each task needs the same whole "
            f"number of GPUs. Set {what}.tasks_per_node to a divisor of {visible}."
        )
    per_task = visible // local_world
    return tuple(torch.device("cuda", local_rank * per_task + i) for i in range(per_task))


def device_memory_bytes(device: torch.device) -> int:
    """A GPU's total memory, for placing a target across a task's GPUs."""
    return torch.cuda.get_device_properties(device).total_memory


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (timings of GPU code end here)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
