"""Self-describing stage outputs: atomic writes, content hashes and manifests.

Nothing is written in place: every file goes to a temporary name in the same folder and is renamed over the
final name, so a reader never sees half a file. A stage folder's `manifest.json` is written last; a folder
without one is unfinished.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# Bumped when a stage's code changes what it writes; part of every cache key. The code each stage's output
# depends on is listed in STAGE_CODE, and its digest as of the version is recorded in code_versions.json: a change to
# that code without a bump (or a recorded reason why its outputs cannot change) fails tests/test_code_versions.py,
# so a cached result is never read for code that would compute another (scripts/record_code_versions.py).
CODE_VERSION = {"extract": 5, "train": 4, "eval": 6, "serve": 7}
# The modules (relative to the package, globs allowed) whose code decides each stage's cached output.
STAGE_CODE = {
    "extract": ("stages/extract.py", "capture.py", "regenerate.py", "data.py", "states/*.py", "engines/hf/*.py",
                "engines/vllm/capture.py", "engines/vllm/side/*.py", "engines/sglang/capture.py",
                "engines/sglang/cli.py", "engines/sglang/cpu_kernels/*.py",
                "engines/sglang/cpu_kernels/sgl_kernel/*.py", "tiny/*.py", "wrappers.py", "families.py", "layers.py",
                "targets.py", "compute.py"),
    "train": ("stages/train.py", "draft/*.py", "states/*.py", "compute.py"),
    "eval": ("stages/eval.py", "draft/*.py", "capture.py", "engines/hf/*.py", "engines/vllm/capture.py",
             "engines/vllm/side/*.py", "states/*.py", "compute.py"),
    "serve": ("stages/serve.py", "engines/client.py", "engines/reference/*.py", "engines/vllm/cli.py",
              "engines/vllm/ids.py", "engines/sglang/*.py", "engines/sglang/cpu_kernels/*.py",
              "engines/sglang/cpu_kernels/sgl_kernel/*.py", "draft/export.py", "draft/served.py", "compute.py"),
}  # fmt: skip
CODE_VERSIONS_FILE = Path(__file__).with_name("code_versions.json")


def code_files(stage: str) -> list[Path]:
    """The package's modules that decide `stage`'s output (`STAGE_CODE`), sorted."""
    root = Path(__file__).parent
    return sorted({f for pattern in STAGE_CODE[stage] for f in root.glob(pattern)})


def code_digest(source: str) -> str:
    """A module's code, not its comments, formatting or docstrings: the hash of its syntax tree with every
    docstring dropped."""
    import ast

    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()[:16]


def code_digests() -> dict[str, dict[str, str]]:
    """Each stage's modules (relative to the package) and their code digests, as they are now."""
    root = Path(__file__).parent
    return {
        stage: {f.relative_to(root).as_posix(): code_digest(f.read_text()) for f in code_files(stage)}
        for stage in STAGE_CODE
    }


class ArtifactError(ValueError):
    """An upstream artifact that is missing, unfinished, corrupt or inconsistent with the config."""


class DiskFull(ArtifactError):
    """A write that the disk had no room for; nothing was left under the file's final name."""


@contextmanager
def atomic_path(final: Path, needs_bytes: int | None = None) -> Iterator[Path]:
    """Yields a temporary path beside `final`; renames it over `final` only if the block succeeds. The file is
    readable by others (0644, not mkstemp's 0600): an MLflow UI or a colleague may run as another user. A full
    disk raises `DiskFull` naming the file, the bytes it needed (`needs_bytes`, where the caller knows them) and
    the space left."""
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    except OSError as exc:
        _raise_if_full(exc, final, needs_bytes)
        raise
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    except Exception as exc:  # a writer in Rust or C (safetensors) reports a full disk in its own exception type
        _raise_if_full(exc, final, needs_bytes)
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _raise_if_full(exc: BaseException, final: Path, needs_bytes: int | None) -> None:
    import errno
    import shutil

    full = getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    full = full or any(s in str(exc) for s in ("No space left", "StorageFull", "os error 28", "Disk quota exceeded"))
    if not full:
        return
    try:
        free = f"{shutil.disk_usage(final.parent).free:,} bytes free there"
    except OSError:
        free = "free space unknown"
    needs = f"{needs_bytes:,} bytes" if needs_bytes is not None else "more space"
    raise DiskFull(
        f"{final}: no space left on the device ({str(exc)[:200]}): writing it needs {needs}, {free}. Nothing was "
        "left under its name; free space (or move outputs_dir) and run the same command: finished work is kept"
    ) from None


def write_json(path: Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: Path, what: str = "file") -> Any:
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{what} {path} is not valid JSON: {exc}") from None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hash of a JSON-able object, independent of dict order."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    write_json(Path(folder) / MANIFEST, {"format_version": FORMAT_VERSION, **manifest})


def read_manifest(folder: Path, stage: str) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.exists():
        raise ArtifactError(f"{stage} output {folder} has no {MANIFEST}: the {stage} stage did not finish there")
    manifest = read_json(path, f"{stage} manifest")
    if manifest.get("stage") != stage:
        raise ArtifactError(f"{path}: written by stage {manifest.get('stage')!r}, expected {stage!r}")
    return manifest


def require_equal(manifest_path: Path | str, field: str, found: Any, expected: Any, fix: str) -> None:
    """Refuses an upstream artifact whose recorded `field` differs from what this stage's config says."""
    if found != expected:
        raise ArtifactError(f"{manifest_path}: {field} is {found!r} but this run's config says {expected!r}. {fix}")


def dir_fingerprint(folder: Path, full_hash_limit: int = 2 << 30) -> str:
    """Content hash of a model folder: every file's bytes when small, names and sizes plus config when huge."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    total = sum(p.stat().st_size for p in files)
    h = hashlib.sha256()
    for p in files:
        rel = str(p.relative_to(folder))
        h.update(rel.encode())
        if total <= full_hash_limit or p.suffix in (".json", ".jinja", ".txt"):
            h.update(file_sha256(p).encode())
        else:
            h.update(str(p.stat().st_size).encode())
    return h.hexdigest()[:16]


def record_code_versions(
    recorded: dict[str, Any], now: dict[str, dict[str, str]], versions: dict[str, int], reason: str | None
) -> tuple[dict[str, Any], list[str]]:
    """`recorded` (code_versions.json's content) brought to the code as it is `now`, and the stages refused: a stage
    whose code changed is recorded at its bumped version (`versions`, CODE_VERSION), or at the same version with
    `reason` (why its outputs cannot change: a refactor, a message), which the log keeps; else it is refused."""
    import sys

    # the syntax tree's dump is Python's own: digests compare under the minor version that recorded them
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = {"python": python, "stages": dict(recorded.get("stages", {})), "log": list(recorded.get("log", []))}
    refused = []
    for stage, files in now.items():
        before = out["stages"].get(stage, {"version": None, "files": {}})
        if before["files"] == files and before["version"] == versions[stage]:
            continue
        changed = sorted(f for f in files.keys() | before["files"].keys() if files.get(f) != before["files"].get(f))
        if before["version"] is not None and versions[stage] <= before["version"] and not reason:
            refused.append(
                f"{stage}: its code changed ({', '.join(changed)}) at CODE_VERSION[{stage!r}]={versions[stage]}: bump "
                "it in orchestrator/artifacts.py if the change can alter what the stage computes (its cached results "
                "are then computed again), or give --reason saying why it cannot"
            )
            continue
        out["stages"][stage] = {"version": versions[stage], "files": files}
        if reason and before["version"] == versions[stage]:
            out["log"].append({"stage": stage, "version": versions[stage], "files": changed, "reason": reason})
    return out, refused
