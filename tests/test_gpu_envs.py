"""scripts/make_gpu_envs.sh, whose installs need a GPU node and PyPI: its three modes' pip commands (`--print`), the
CUDA build it chooses from the driver, and what it refuses before installing anything."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_gpu_envs.sh"


def _script(tmp_path: Path, *args: str, driver: str | None = None, python: str = "python3"):
    """The script with a stand-in `nvidia-smi` first on PATH: it prints `driver`, or fails as on a node without
    one. Returns (exit code, stdout and stderr)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho {driver}\n" if driver else "#!/bin/sh\nexit 1\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": python}
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)
    return done.returncode, done.stdout + done.stderr


def test_download_fetches_the_cuda_builds_wheels_and_install_takes_them_offline(tmp_path):
    """`download` on a node with PyPI and no GPU fills DIR/wheelhouse, one folder per engine, with PyTorch's index for
    the chosen CUDA; vLLM's CUDA 12.9 build is its release wheel, not PyPI's. `install` on a compute node takes them
    with --no-index, asking for the release wheel's own version."""
    arch = platform.machine()
    rc, out = _script(tmp_path, "download", str(tmp_path / "envs"), "--cuda", "129", "--print")
    assert rc == 0, out
    fetches = [line for line in out.splitlines() if " -m pip download " in line]
    assert len(fetches) == 2, out
    assert all("--extra-index-url https://download.pytorch.org/whl/cu129" in line for line in fetches), fetches
    assert f"--dest {tmp_path / 'envs' / 'wheelhouse' / 'sglang'}" in fetches[0], fetches[0]
    assert "sglang\\[all\\]==0.5.23" in fetches[0], fetches[0]
    release = f"v0.32.0/vllm-0.32.0+cu129-cp38-abi3-manylinux_2_28_{arch}.whl"
    assert release in fetches[1] and "wheelhouse/vllm" in fetches[1], fetches[1]
    assert "bash scripts/make_gpu_envs.sh install" in out and "--cuda 129" in out

    rc, out = _script(tmp_path, "install", str(tmp_path / "envs"), "--cuda", "129", "--print")
    installs = [line for line in out.splitlines() if " -m pip install " in line]
    assert rc == 0 and len(installs) == 2, out
    assert all("--no-index --find-links " in line and "download.pytorch.org" not in line for line in installs)
    assert installs[1].endswith("vllm==0.32.0+cu129 "), installs[1]
    assert f"export SGLANG_PYTHON={tmp_path / 'envs' / 'sglang-gpu-env' / 'bin' / 'python'}" in out


def test_the_cuda_build_follows_the_driver_and_a_node_without_one_must_say(tmp_path):
    """--cuda auto: driver R580 or newer takes CUDA 13 (vLLM's PyPI wheel), an older one CUDA 12.9; a node without
    nvidia-smi (a login node) is refused naming --cuda, before anything is installed."""
    rc, out = _script(tmp_path, str(tmp_path / "envs"), "--print", driver="580.65.06")
    assert rc == 0 and "driver 580.65.06: CUDA 130 builds" in out, out
    assert "--extra-index-url https://download.pytorch.org/whl/cu130 vllm==0.32.0" in out, out
    rc, out = _script(tmp_path, str(tmp_path / "envs"), "--print", driver="575.57.08")
    assert rc == 0 and "cu129" in out and "releases/download/v0.32.0/vllm-0.32.0+cu129" in out, out
    rc, out = _script(tmp_path, "download", str(tmp_path / "envs"), "--print")
    assert rc == 1 and "--cuda 130 (driver R580 or newer) or --cuda 129" in out, out
    rc, out = _script(tmp_path, str(tmp_path / "envs"), "--cuda", "118", "--print")
    assert rc == 1 and "--cuda 118: expected auto, 129 or 130" in out, out
    assert not (tmp_path / "envs").exists(), "nothing made before the refusals"


def test_a_python_older_than_sglang_needs_is_refused(tmp_path):
    """SGLang 0.5.23 needs Python 3.11 or newer: a 3.10 PYTHON is refused, naming both, before any venv."""
    old = tmp_path / "python3.10"
    old.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Python 3.10.12" && exit 0\nexit 1\n')
    old.chmod(0o755)
    rc, out = _script(tmp_path, str(tmp_path / "envs"), "--cuda", "130", "--print", python=str(old))
    assert rc == 1 and "is Python 3.10.12: SGLang 0.5.23 needs Python 3.11 or newer" in out, out
    assert not (tmp_path / "envs").exists()
