"""Chat corpus built from the local Python standard library sources.

The stdlib is always present, needs no network and is plenty of text (~11 MB of
``*.py``), so the tiny targets can be trained anywhere.  Each conversation asks
for a chunk of a source file and answers with that chunk, so the assistant
turns are real, highly structured code the target can learn quickly.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import sysconfig
from pathlib import Path

Message = dict[str, str]
Conversation = list[Message]

SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
HELDOUT_PERCENT = 5
MIN_CHUNK_CHARS = 300
MAX_CHUNK_CHARS = 1200
TWO_TURN_PROB = 0.1
# A minified or data line can be enormous; cap it so a chunk stays near the target size.
MAX_LINE_CHARS = 400

_FIRST_PROMPTS = (
    "Show the source of `{path}` starting at line {line}.",
    "Print `{path}` from line {line}.",
    "What does `{path}` contain at line {line}?",
    "Give me lines of `{path}` beginning at line {line}.",
    "Continue reading `{path}` at line {line}.",
)
_FOLLOWUP_PROMPTS = (
    "Continue.",
    "And the next part?",
    "Keep going from line {line}.",
    "Show the following lines.",
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=4)
def _stdlib_files(root: Path) -> tuple[Path, ...]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]  # prune: the test suite is big
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return tuple(sorted(files))


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Sorted stdlib ``*.py`` files, excluding test suites and IDLE."""
    return list(_stdlib_files(stdlib_root() if root is None else Path(root)))


def is_heldout(rel_path: str) -> bool:
    """File-level split; independent of the seed so heldout is the same for every build."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def _chunks(lines: list[str], rng: random.Random) -> list[tuple[int, str]]:
    """Split a file into (1-based start line, text) chunks of ~300-1200 chars at line boundaries."""
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        target = rng.randint(MIN_CHUNK_CHARS, MAX_CHUNK_CHARS)
        start, size, buf = i, 0, []
        while i < len(lines) and (not buf or size + len(lines[i]) <= target):
            line = lines[i]
            if len(line) > MAX_LINE_CHARS:
                line = line[:MAX_LINE_CHARS] + "\n"
            buf.append(line)
            size += len(line)
            i += 1
        text = "".join(buf)
        if text.strip():
            out.append((start + 1, text))
    return out


def file_conversations(rel_path: str, text: str, rng: random.Random) -> list[Conversation]:
    chunks = _chunks(text.splitlines(keepends=True), rng)
    convs: list[Conversation] = []
    k = 0
    while k < len(chunks):
        line, body = chunks[k]
        prompt = rng.choice(_FIRST_PROMPTS).format(path=rel_path, line=line)
        conv: Conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": body}]
        k += 1
        if k < len(chunks) and rng.random() < TWO_TURN_PROB:
            line, body = chunks[k]
            follow = rng.choice(_FOLLOWUP_PROMPTS).format(path=rel_path, line=line)
            conv += [{"role": "user", "content": follow}, {"role": "assistant", "content": body}]
            k += 1
        convs.append(conv)
    return convs


def stdlib_conversations(seed: int, max_files: int | None = None) -> tuple[list[Conversation], list[Conversation]]:
    """(train, heldout) conversations over the stdlib sources, deterministic given ``seed``.

    ``max_files`` keeps a seeded sample of that many files (at least one heldout), for fast tests.
    Conversations are returned in file order; callers shuffle as they need.
    """
    root = stdlib_root()
    files = stdlib_files(root)
    rng = random.Random(seed)
    if max_files is not None and max_files < len(files):
        # Sample each side of the split separately so a small sample still has heldout files.
        held = [p for p in files if is_heldout(p.relative_to(root).as_posix())]
        rest = [p for p in files if not is_heldout(p.relative_to(root).as_posix())]
        n_held = min(len(held), max(1, round(max_files * HELDOUT_PERCENT / 100)))
        n_rest = min(len(rest), max(max_files - n_held, 0))
        files = sorted(rng.sample(held, n_held) + rng.sample(rest, n_rest))
    train: list[Conversation] = []
    heldout: list[Conversation] = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        # One RNG per file (seeded by seed + path) so a file's chunks don't depend on which
        # other files were included.
        file_rng = random.Random(f"{seed}:{rel}")
        convs = file_conversations(rel, text, file_rng)
        (heldout if is_heldout(rel) else train).extend(convs)
    return train, heldout


def corpus_fingerprint(convs: list[Conversation]) -> str:
    """sha256 over the conversations; the stdlib differs between Python versions."""
    h = hashlib.sha256()
    for conv in convs:
        for m in conv:
            h.update(m["role"].encode())
            h.update(b"\0")
            h.update(m["content"].encode("utf-8", errors="replace"))
            h.update(b"\0")
        h.update(b"\1")
    return h.hexdigest()
