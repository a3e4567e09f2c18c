"""Golden files in tests/golden/: a missing or different file fails its test; only EAGLE_UPDATE_GOLDEN=1 writes them."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE_VARIABLE = "EAGLE_UPDATE_GOLDEN"


def assert_matches_golden(name: str, text: str, golden_dir: Path = GOLDEN_DIR) -> None:
    """`text` must equal the golden file `golden_dir/name`. With EAGLE_UPDATE_GOLDEN=1 the file is (re)written
    instead, for review in the diff before committing."""
    path = golden_dir / name
    rewrite = f"{UPDATE_VARIABLE}=1 .venv/bin/python -m pytest {_calling_test()}"
    if os.environ.get(UPDATE_VARIABLE) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"golden file {path} written ({UPDATE_VARIABLE}=1): review its diff before committing")
        return
    if not path.exists():
        pytest.fail(f"golden file {path} is missing; create it with `{rewrite}` and review it", pytrace=False)
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "actual"))
        pytest.fail(
            f"output differs from golden file {path}; if the change is intended, `{rewrite}` rewrites it:\n{diff}",
            pytrace=False,
        )


def _calling_test() -> str:
    """The running test's file, relative to the repository (pytest names it in PYTEST_CURRENT_TEST)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0] or "tests/"
