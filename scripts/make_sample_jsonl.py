"""The sample conversation files of `data=jsonl`, written from the stdlib corpus in both formats users have.

    .venv/bin/python scripts/make_sample_jsonl.py

Writes data/sample_chat.jsonl (OpenAI `messages`) and data/sample_chat_sharegpt.jsonl (ShareGPT
`conversations`, from/value): the same conversations, byte-identical on every run under one Python. The
corpus is the running Python's stdlib, so another version writes other text: the committed files are fixed
inputs, not rebuilt by the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.tiny.corpus import stdlib_conversations

COUNT = 40
MAX_FILES = 12
SHAREGPT_SPEAKER = {"system": "system", "user": "human", "assistant": "gpt"}
DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def sample() -> list[list[dict[str, str]]]:
    """COUNT conversations spread evenly over the seeded sample of files, not the first file's chunks."""
    train, val = stdlib_conversations(seed=0, max_files=MAX_FILES)
    every = train + val
    if len(every) < COUNT:
        raise SystemExit(
            f"{len(every)} conversations from {MAX_FILES} stdlib files: fewer than {COUNT}; raise MAX_FILES"
        )
    return every[:: len(every) // COUNT][:COUNT]


def write_lines(path: Path, records: list[dict]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
    path.write_bytes(text.encode("utf-8"))
    print(f"{path}: {len(records)} conversations, {len(text.encode('utf-8')):,} bytes")


def main() -> None:
    conversations = sample()
    DATA_DIR.mkdir(exist_ok=True)
    write_lines(DATA_DIR / "sample_chat.jsonl", [{"messages": c} for c in conversations])
    write_lines(
        DATA_DIR / "sample_chat_sharegpt.jsonl",
        [
            {"conversations": [{"from": SHAREGPT_SPEAKER[m["role"]], "value": m["content"]} for m in c]}
            for c in conversations
        ],
    )


if __name__ == "__main__":
    main()
