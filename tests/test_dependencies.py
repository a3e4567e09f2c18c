"""Declared dependencies match the imports, every module imports, and every pytest marker in use is declared.

A package that is only installed because something else pulls it in (as `rich` came with typer) works until that
something drops it: these tests read pyproject.toml itself, so they catch the gap in any venv."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import pkgutil
import re
import sys
import tomllib
from pathlib import Path

import pytest

import orchestrator

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Markers that pytest and its usual plugins define themselves.
BUILTIN_MARKERS = {"parametrize", "skipif", "skip", "xfail", "usefixtures", "filterwarnings", "timeout"}
# Runs the command line on import: `python -m orchestrator` is its only use, and app.py holds what it imports.
ENTRY_POINT = "orchestrator.__main__"


def canonical(distribution: str) -> str:
    """A distribution name as PEP 503 compares them: case, `-`, `_` and `.` do not matter."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def declared(requirements: list[str]) -> set[str]:
    return {canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r.strip()).group()) for r in requirements}


EXTRAS = PYPROJECT["project"]["optional-dependencies"]
# the runtime extras (kimi, mooncake) are features a user installs for a run that needs them: the code may import them
RUNTIME = declared(PYPROJECT["project"]["dependencies"]) | {
    name for extra, pins in EXTRAS.items() if extra != "dev" for name in declared(pins)
}
DEV = RUNTIME | declared(EXTRAS["dev"])


def imported_modules(path: Path) -> dict[str, int]:
    """Top-level names of the absolute imports in a file, at any depth (lazy imports inside functions too),
    each with the line of its first import."""
    names: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        for module in modules:
            names.setdefault(module.split(".")[0], node.lineno)
    return names


# Imported only where a separate install provides them, never from the project's environment (they pin their own
# torch and transformers): module -> where it comes from.
SEPARATE = {
    "specforge": (
        "benchmarks/bench_train_gpu.py's comparison, a --no-deps wheel on the GPU machine (scripts/gpu_wheels.py)"
    ),
    "vllm": "orchestrator/engines/vllm/side/load_check.py, run by serve.python (scripts/make_vllm_env.sh)",
    "llvmlite": "orchestrator/engines/vllm/side/capture.py, in vLLM's environment, where numba brings it",
    "speculators": "scripts/speculators_export.py, in its own environment (scripts/make_speculators_env.sh)",
    "sglang": (
        "tests/sglang_rope_probe.py and orchestrator/engines/sglang/cpu_kernels/launch.py, run by SGLANG_PYTHON "
        "(scripts/make_sglang_env.sh), never by the project's venv"
    ),
    # the project's own stand-ins there, put on SGLang's path by cpu_kernels/launch.py where no real one loads
    "sgl_kernel": "orchestrator/engines/sglang/cpu_kernels/sgl_kernel/, in SGLang's environment only",
    "torchvision": "orchestrator/engines/sglang/cpu_kernels/no_torchvision/, in SGLang's environment only",
}


def undeclared_imports(folder: Path, allowed: set[str], local: set[str]) -> list[str]:
    """One line per import under `folder` of a third-party module whose distribution is not in `allowed`."""
    distributions = importlib.metadata.packages_distributions()
    problems = []
    for path in sorted(folder.rglob("*.py")):
        for module, line in imported_modules(path).items():
            if module in sys.stdlib_module_names or module in local or module in SEPARATE:
                continue
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            installed = distributions.get(module)
            if not installed:
                problems.append(
                    f"{where}, which no installed distribution provides (and pyproject.toml does not declare)"
                )
            elif not allowed & {canonical(d) for d in installed}:
                problems.append(f"{where}, provided by {' or '.join(installed)}, which pyproject.toml does not declare")
    return problems


@pytest.mark.parametrize("folder", ["orchestrator", "scripts", "benchmarks", "examples"])
def test_package_and_script_imports_are_declared_dependencies(folder):
    # scripts/, benchmarks/ and examples/ run from the project's venv with nothing else installed, so they get the
    # same dependencies.
    problems = undeclared_imports(ROOT / folder, RUNTIME, local={"orchestrator"})
    assert not problems, "add to [project] dependencies in pyproject.toml:\n" + "\n".join(problems)


def test_test_imports_are_declared_dependencies():
    tests = ROOT / "tests"
    local = {"orchestrator"} | {p.stem for p in tests.glob("*.py")} | {p.name for p in tests.iterdir() if p.is_dir()}
    # a test may import a script to check its pieces
    local |= {p.stem for folder in ("scripts", "benchmarks", "examples") for p in (ROOT / folder).glob("*.py")}
    problems = undeclared_imports(tests, DEV, local)
    assert not problems, "add to [project] dependencies or the dev extra in pyproject.toml:\n" + "\n".join(problems)


def test_every_module_imports():
    failures = []
    packages = pkgutil.walk_packages(
        orchestrator.__path__, "orchestrator.", onerror=lambda name: failures.append(f"{name}: {sys.exc_info()[1]!r}")
    )
    for module in sorted(info.name for info in packages if info.name != ENTRY_POINT):
        try:
            importlib.import_module(module)
        except Exception as exc:
            failures.append(f"{module}: {exc!r}")
    assert not failures, "modules that fail to import:\n" + "\n".join(failures)


def used_markers(path: Path) -> dict[str, int]:
    """The `pytest.mark.<name>` names in a file, each with the line of its first use."""
    names: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "pytest"
        ):
            names.setdefault(node.attr, node.lineno)
    return names


def test_every_marker_in_use_is_declared():
    declared_markers = {m.split(":")[0].strip() for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    problems = [
        f"{path.relative_to(ROOT)}:{line} uses pytest.mark.{name}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for name, line in used_markers(path).items()
        if name not in declared_markers | BUILTIN_MARKERS
    ]
    assert not problems, "declare these markers in [tool.pytest.ini_options] markers of pyproject.toml:\n" + "\n".join(
        problems
    )
