"""Record each stage's code digest at its CODE_VERSION (orchestrator/code_versions.json), after a change to a
stage's code: the stage's version bumped in orchestrator/artifacts.py (its cached results are computed again), or
`--reason` saying why its outputs cannot change (kept in the file's log). tests/test_code_versions.py fails until
the file matches the code.

    .venv/bin/python scripts/record_code_versions.py [--reason "a refactor: the same arithmetic"]
"""

from __future__ import annotations

import argparse
import json
import sys

from orchestrator.artifacts import CODE_VERSION, CODE_VERSIONS_FILE, code_digests, record_code_versions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reason", default=None, help="why a changed stage's outputs cannot change (no bump)")
    args = parser.parse_args()
    recorded = json.loads(CODE_VERSIONS_FILE.read_text()) if CODE_VERSIONS_FILE.exists() else {}
    updated, refused = record_code_versions(recorded, code_digests(), CODE_VERSION, args.reason)
    for line in refused:
        print(f"refused: {line}", file=sys.stderr)
    if refused:
        return 1
    CODE_VERSIONS_FILE.write_text(json.dumps(updated, indent=1, sort_keys=True) + "\n")
    print(f"recorded {CODE_VERSIONS_FILE}: " + ", ".join(f"{s} {v['version']}" for s, v in updated["stages"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
