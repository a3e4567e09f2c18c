"""Where a streamed training's states travel from the capture service to its trainers: a `StateStore`.

The stream's control plane (positions, consumers, heartbeats, reads, replay: `orchestrator/states/stream.py`) lives
in the spool folder and moves a few bytes per sequence. The data plane, one object per sequence keyed
`<position>-<index>`, is a store chosen per run (`train.stream.transport`):

- `file`: one safetensors file per key in the spool, written atomically. For one node (the spool on `/dev/shm` or
  local disk): across nodes every state would cross the shared file system.
- `mooncake`: Mooncake Store (`mooncake-transfer-engine-non-cuda`, the store SpecForge, TorchSpec and speculators'
  hs-connectors move states with). The service's job starts `mooncake_master` as its child (with its HTTP metadata
  server), waits for its port, and publishes its address in the spool (`store.json`); its own client contributes
  the segment that holds the objects, so a state is put into the service node's memory once and pulled from there
  by the trainer that reads it (TCP, or RDMA where the site has it), never through the shared file system. Objects
  are hard-pinned: a full segment refuses a put (`put` returns False and the service waits for room), it never
  evicts an unread state. A read leases an object for the master's `default_kv_lease_ttl` (10 s), so objects are
  removed with `force`. The keys held are listed in the spool (`held/<key>`, holding the object's size), written
  after the object is in and removed before it is: the trainers find a sequence's key there.

Every store: `put(key, tensors)` (False: no room now), `take(key)` (None: not there), `release(key)`, `keys()`,
`held_bytes()`, `describe()` (what the manifest and MLflow record: the transport, and for Mooncake the protocol it
really got), `close()`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load, load_file, save, save_file

from orchestrator.artifacts import atomic_path

PUBLISHED = "store.json"  # the service's store: its transport, and where a consumer connects
MASTER_LOG = "mooncake_master.log"
HELD = "held"  # mooncake: the keys held, one empty-ish file each holding the object's size
MOONCAKE_NO_ROOM = -200  # mooncake's NO_AVAILABLE_HANDLE: a hard-pinned segment is full
SUFFIX = ".safetensors"


class StoreError(RuntimeError):
    pass


class StateStore(Protocol):
    transport: str

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> bool: ...
    def take(self, key: str) -> dict[str, torch.Tensor] | None: ...
    def release(self, key: str) -> None: ...
    def keys(self) -> list[str]: ...
    def held_bytes(self) -> int: ...
    def describe(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def key(position: int, index: int) -> str:
    """A sequence's key: its place in the trainers' global order, then its place in the split."""
    return f"{position:012d}-{index:09d}"


def position_of(name: str) -> int:
    return int(name.split("-")[0])


def index_of(name: str) -> int:
    return int(name.split("-")[1])


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class FileStore:
    """Each key a safetensors file in `folder` (the spool), written atomically, read and deleted by its reader."""

    transport = "file"

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def path(self, name: str) -> Path:
        return self.folder / f"{name}{SUFFIX}"

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> bool:
        with atomic_path(self.path(key)) as tmp:
            save_file(tensors, str(tmp))
        return True

    def take(self, key: str) -> dict[str, torch.Tensor] | None:
        try:
            return load_file(str(self.path(key)))
        except FileNotFoundError:
            return None

    def release(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        return sorted(e.name[: -len(SUFFIX)] for e in os.scandir(self.folder) if e.name.endswith(SUFFIX))

    def held_bytes(self) -> int:
        total = 0
        for entry in os.scandir(self.folder):
            if entry.name.endswith(SUFFIX):
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:  # read and deleted meanwhile
                    pass
        return total

    def describe(self) -> dict[str, Any]:
        return {"transport": "file", "folder": str(self.folder)}

    def close(self) -> None:
        pass


class MooncakeStore:
    """A client of a Mooncake Store whose master the service started (`MooncakeMaster`). The service's client
    (`segment_bytes` > 0) holds the objects in its segment; a consumer's contributes none and pulls each object into
    a buffer it registered with the transfer engine, grown as objects grow."""

    transport = "mooncake"

    def __init__(self, spool: Path, address: dict[str, Any], segment_bytes: int = 0):
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.spool, self.address, self.held = Path(spool), address, Path(spool) / HELD
        self.held.mkdir(exist_ok=True)
        # this client's own address: loopback beside a loopback master, else this node's
        local = address["host"] if address["host"].startswith("127.") else socket.gethostbyname(socket.gethostname())
        os.environ["MC_TCP_BIND_ADDRESS"] = local  # else the engine binds the first non-loopback interface
        self.client = MooncakeDistributedStore()
        code = self.client.setup(
            local, address["metadata"], int(segment_bytes), 16 << 20, address["protocol"], "", address["master"]
        )
        if code != 0:
            raise StoreError(
                f"Mooncake Store at {address['master']} (train.stream.transport=mooncake) refused this client: "
                f"setup returned {code}; is the capture service's master up (its log)?"
            )
        self.pinned = ReplicateConfig()
        self.pinned.replica_num, self.pinned.with_hard_pin = 1, True
        self.buffer: torch.Tensor | None = None
        self.sizes: dict[str, int] = {}  # the service's: what it put and has not seen released

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> bool:
        data = save(tensors)
        code = self.client.put(key, data, self.pinned)
        if code == MOONCAKE_NO_ROOM:
            return False
        if code != 0:
            raise StoreError(f"Mooncake Store at {self.address['master']}: put of {key} ({len(data)} bytes) "
                             f"returned {code}")  # fmt: skip
        with atomic_path(self.held / key) as tmp:
            tmp.write_text(str(len(data)))
        self.sizes[key] = len(data)
        return True

    def take(self, key: str) -> dict[str, torch.Tensor] | None:
        size = self.client.get_size(key)
        if size <= 0:
            return None
        if self.buffer is None or self.buffer.numel() < size:
            if self.buffer is not None:
                self.client.unregister_buffer(self.buffer.data_ptr())
            self.buffer = torch.empty(max(size, 2 * (0 if self.buffer is None else self.buffer.numel())),
                                      dtype=torch.uint8)  # fmt: skip
            code = self.client.register_buffer(self.buffer.data_ptr(), self.buffer.numel())
            if code != 0:
                raise StoreError(f"Mooncake Store: registering a {self.buffer.numel()}-byte buffer returned {code}")
        got = self.client.get_into(key, self.buffer.data_ptr(), size)
        if got != size:
            if got < 0 and self.client.is_exist(key) != 1:  # released meanwhile
                return None
            raise StoreError(f"Mooncake Store at {self.address['master']}: get of {key} gave {got} of {size} bytes")
        return load(self.buffer[:size].numpy().tobytes())

    def release(self, key: str) -> None:
        (self.held / key).unlink(missing_ok=True)  # no reader finds it from now on
        code = self.client.remove(key, force=True)  # a read leases it for 10 s: force
        if code not in (0, -704):  # -704: OBJECT_NOT_FOUND, released already
            raise StoreError(f"Mooncake Store at {self.address['master']}: removing {key} returned {code}")

    def keys(self) -> list[str]:
        try:
            return sorted(name for name in os.listdir(self.held) if not name.endswith(".tmp"))  # one being written
        except FileNotFoundError:  # a service starting again clears it
            return []

    def held_bytes(self) -> int:
        """What this (the service's) client put and is still held: keys another client released are gone."""
        gone = set(self.sizes) - set(self.keys())
        for name in gone:
            del self.sizes[name]
        return sum(self.sizes.values())

    def describe(self) -> dict[str, Any]:
        return {"transport": "mooncake", **{k: self.address[k] for k in ("master", "protocol", "requested")}}

    def close(self) -> None:
        if self.buffer is not None:
            self.client.unregister_buffer(self.buffer.data_ptr())
        self.client.close()


def rdma_devices() -> list[str]:
    """The RDMA devices this node has (what Mooncake's RDMA transport would find: none means TCP)."""
    folder = Path("/sys/class/infiniband")
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def mooncake_master_binary() -> str:
    """`mooncake_master` of the environment that runs the service (the wheel installs it beside python)."""
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if not found:
        raise StoreError(
            "train.stream.transport=mooncake: mooncake_master is not installed beside "
            f"{sys.executable} (pip install -c requirements.lock '.[mooncake]'; it needs Debian's libibverbs1)"
        )
    return found


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """`mooncake_master` with its HTTP metadata server, started by the service as its child on `host`, its output
    in `log`; `address` is what the service publishes for its consumers."""

    def __init__(self, host: str, protocol: str, log: Path, startup_timeout_s: float = 60.0):
        binary = mooncake_master_binary()
        self.host, self.rpc, self.http = host, free_port(host), free_port(host)
        # its metrics and admin server on a port of its own (the default, 9003, is one per node: a second master on
        # the node, another run's or a requeued service's, would fail to start)
        command = [binary, f"--rpc_address={host}", f"--rpc_port={self.rpc}", "--enable_http_metadata_server=true",
                   f"--http_metadata_server_host={host}", f"--http_metadata_server_port={self.http}",
                   f"--metrics_host={host}", f"--metrics_port={free_port(host)}"]  # fmt: skip
        self.log = Path(log)
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        began = time.monotonic()
        while not all(_listening(host, port) for port in (self.rpc, self.http)):
            if self.proc.poll() is not None or time.monotonic() - began > startup_timeout_s:
                self.close()
                raise StoreError(f"mooncake_master did not come up on {host}:{self.rpc} within {startup_timeout_s:g} s "
                                 f"(exit {self.proc.returncode}); its log: {self.log}")  # fmt: skip
            time.sleep(0.05)
        got = "rdma" if protocol == "rdma" and rdma_devices() else "tcp"
        self.address = {
            "transport": "mooncake", "host": host, "master": f"{host}:{self.rpc}",
            "metadata": f"http://{host}:{self.http}/metadata", "protocol": got, "requested": protocol,
            "command": command,
        }  # fmt: skip

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _die_with_parent() -> None:
    """In the master's process before it starts: Linux ends it (SIGTERM) when the service that started it dies, even
    by SIGKILL, so a killed service leaves no master holding its ports and memory (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def service_host(cfg) -> str:
    """The address the service's store listens on: `train.stream.mooncake.host`, else loopback for a run on this
    machine (cluster=local or debug) and this node's address on a Slurm cluster."""
    chosen = cfg.train.stream.mooncake.host
    if chosen:
        return chosen
    if cfg.cluster.kind != "slurm":
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def open_service_store(cfg, spool: Path, buffer_bytes: int) -> tuple[StateStore, MooncakeMaster | None]:
    """The service's store, and the Mooncake master it started (None for `file`; its log `MASTER_LOG` in the spool),
    published in the spool for the consumers (`open_consumer_store`). A plan that asked for RDMA and got TCP is
    refused unless allowed. Mooncake's segment holds twice `buffer_bytes` (the allocator's slack)."""
    st, spool = cfg.train.stream, Path(spool)
    if st.transport == "file":
        store, master = FileStore(spool), None
        address = store.describe()
    else:
        mc = st.mooncake
        for stale in (spool / HELD).glob("*"):  # an earlier start's keys (a requeued service): its master is gone
            stale.unlink(missing_ok=True)
        master = MooncakeMaster(service_host(cfg), mc.protocol, spool / MASTER_LOG)
        address = master.address
        if mc.protocol == "rdma" and address["protocol"] != "rdma" and not mc.allow_tcp:
            master.close()
            raise StoreError(
                f"train.stream.mooncake.protocol=rdma, and this node ({socket.gethostname()}) has no RDMA device "
                "(/sys/class/infiniband is empty): Mooncake would fall back to TCP without a word. Run the service "
                "on a node with RDMA, or set train.stream.mooncake.allow_tcp=true"
            )
        # the segment holds what the buffer allows, twice over for the allocator's slack, and one whole sequence
        segment = max(2 * buffer_bytes, 64 << 20)
        store = MooncakeStore(spool, address, segment_bytes=segment)
    with atomic_path(spool / PUBLISHED) as tmp:
        tmp.write_text(json.dumps(address | {"service_host": socket.gethostname()}))
    return store, master


def published(spool: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(spool) / PUBLISHED).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def open_consumer_store(spool: Path, address: dict[str, Any]) -> StateStore:
    """A consumer's view of the store the service published (`published(spool)`)."""
    if address["transport"] == "file":
        return FileStore(Path(spool))
    return MooncakeStore(Path(spool), address)
