"""Cache keys follow the code: each stage's key holds its CODE_VERSION, and the code that decides its output
(`artifacts.STAGE_CODE`) is recorded at that version (orchestrator/code_versions.json). A change to that code with
neither a bump nor a recorded reason fails here, so a result cached by the old code is never read for the new.

Chosen over a digest of the code in the key itself: a comment, a message or a refactor would then recompute a
Kimi-scale extraction (days of GPU time); here whoever changes a stage's code decides, and says why where the
outputs cannot change."""

from __future__ import annotations

import json
import sys

import pytest

from orchestrator import artifacts
from orchestrator.artifacts import CODE_VERSION, CODE_VERSIONS_FILE, code_digest, code_digests, record_code_versions


def test_every_stages_code_is_recorded_at_its_version():
    recorded = json.loads(CODE_VERSIONS_FILE.read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if recorded["python"] != here:
        pytest.skip(f"digests recorded under Python {recorded['python']}; this is {here}, whose syntax trees differ")
    _, refused = record_code_versions(recorded, code_digests(), CODE_VERSION, None)
    assert not refused, "\n".join(refused) + "\nthen run: .venv/bin/python scripts/record_code_versions.py"
    stale = {s: v["version"] for s, v in recorded["stages"].items() if v["version"] != CODE_VERSION[s]}
    assert not stale, f"CODE_VERSION bumped without its code recorded {stale}: scripts/record_code_versions.py"
    assert {s: v["files"] for s, v in recorded["stages"].items()} == code_digests(), (
        "a stage's code changed since it was recorded: scripts/record_code_versions.py"
    )


def test_a_modules_digest_is_its_code_not_its_comments_or_docstrings():
    code = 'def f(x):\n    """Twice x."""\n    return 2 * x\n'
    assert code_digest(code) == code_digest("def f(x):\n    # double it\n    return 2 * x  # exact\n")
    assert code_digest(code) == code_digest('"""A module."""\n\n\ndef f(x):\n    return 2*x\n')
    assert code_digest(code) != code_digest("def f(x):\n    return 3 * x\n")
    assert code_digest(code) != code_digest('def f(x):\n    """Twice x."""\n    return 2 * x + 0\n')


def test_a_changed_stage_is_refused_unless_bumped_or_given_a_reason():
    now = code_digests()
    recorded, _ = record_code_versions({}, now, CODE_VERSION, None)
    changed = {**now, "serve": {**now["serve"], "stages/serve.py": "0" * 16}}
    _, refused = record_code_versions(recorded, changed, CODE_VERSION, None)
    assert len(refused) == 1 and refused[0].startswith("serve: its code changed (stages/serve.py) at CODE_VERSION")
    bumped, refused = record_code_versions(recorded, changed, CODE_VERSION | {"serve": CODE_VERSION["serve"] + 1}, None)
    assert not refused and bumped["stages"]["serve"]["version"] == CODE_VERSION["serve"] + 1 and bumped["log"] == []
    kept, refused = record_code_versions(recorded, changed, CODE_VERSION, "a message reworded")
    assert not refused and kept["stages"]["serve"]["version"] == CODE_VERSION["serve"]
    assert kept["log"] == [{"stage": "serve", "version": CODE_VERSION["serve"], "files": ["stages/serve.py"],
                            "reason": "a message reworded"}]  # fmt: skip
    # every stage names modules that exist: a moved module is not silently dropped from its stage's code
    for stage, patterns in artifacts.STAGE_CODE.items():
        root = CODE_VERSIONS_FILE.parent
        assert all(list(root.glob(p)) for p in patterns), stage
