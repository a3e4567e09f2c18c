"""data=jsonl: the user's own conversation files (OpenAI or ShareGPT lines), read, split and refused with file:line."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path

import pytest

from orchestrator.config import ConfigError
from orchestrator.data import DataFileError, JsonlRows, conversations, scan_file
from orchestrator.tiny.corpus import stdlib_conversations


def read_conversations(path, fmt: str, key: str) -> list:
    """Every conversation of one file, parsed as the extract stage reads them (`JsonlRows`)."""
    rows = JsonlRows([path], fmt, key)
    return [rows.read(i) for i in range(len(rows))]


REPO = Path(__file__).resolve().parent.parent
OPENAI = REPO / "data" / "sample_chat.jsonl"
SHAREGPT = REPO / "data" / "sample_chat_sharegpt.jsonl"
GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}


@pytest.fixture
def jsonl_config(tiny_config):
    """compose(*overrides) -> the FAST tiny experiment with `data=jsonl`."""
    return lambda *overrides: tiny_config("data=jsonl", *overrides)


def write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_both_sample_formats_parse_into_the_same_conversations():
    openai = read_conversations(OPENAI, "auto", "data.train_files")
    assert len(openai) == 40
    assert read_conversations(OPENAI, "openai", "k") == openai
    assert read_conversations(SHAREGPT, "auto", "k") == openai
    assert read_conversations(SHAREGPT, "sharegpt", "k") == openai
    assert {m["role"] for c in openai for m in c} == {"user", "assistant"}


def test_sharegpt_speakers_map_to_chat_roles(tmp_path):
    turns = [("system", "Be brief."), ("human", "a"), ("gpt", "b"), ("user", "c"), ("chatgpt", "d"), ("assistant", "e")]
    path = write(
        tmp_path / "chat.jsonl", json.dumps({"id": 7, "conversations": [{"from": f, "value": v} for f, v in turns]})
    )
    [conversation] = read_conversations(path, "auto", "k")
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user", "assistant", "assistant"]
    assert [m["content"] for m in conversation] == [v for _, v in turns]


def test_jsonl_config_composes_loads_and_splits_under_the_seed(jsonl_config):
    cfg = jsonl_config(f"data.train_files=['{OPENAI}']")
    assert cfg.data.name == "jsonl" and cfg.data.train_files == [str(OPENAI)] and cfg.data.val_files == []
    assert cfg.data.max_train_conversations == 96 and cfg.data.regenerate.enabled, (
        "the experiment's data block still applies"
    )
    train, val = conversations(cfg.data, cfg.seed)
    assert (len(train), len(val)) == (36, 4)  # val_fraction 0.1 of 40
    assert conversations(cfg.data, cfg.seed) == (train, val)
    every = read_conversations(OPENAI, "auto", "k")
    assert [c for c in every if c not in val] == train, "the rest train, in file order"
    _, other_val = conversations(cfg.data, cfg.seed + 1)
    assert other_val != val


def test_the_default_is_the_sample_from_the_repository_root(monkeypatch, jsonl_config):
    monkeypatch.chdir(REPO)
    cfg = jsonl_config()
    assert cfg.data.train_files == [str(OPENAI)]
    assert sum(map(len, conversations(cfg.data, cfg.seed))) == 40


def test_validation_files_and_the_split_counts(jsonl_config):
    cfg = jsonl_config(
        f"data.train_files=['{OPENAI}']",
        f"data.val_files=['{SHAREGPT}']",
        "data.val_fraction=null",
        "data.max_train_conversations=30",
        "data.max_val_conversations=5",
    )
    train, val = conversations(cfg.data, cfg.seed)
    every = read_conversations(OPENAI, "auto", "k")
    assert train == every[:30] and val == every[:5]


def test_stdlib_chat_is_unchanged(tiny_config):
    cfg = tiny_config("data.max_files=12")
    train, val = stdlib_conversations(cfg.seed, max_files=12)
    assert conversations(cfg.data, cfg.seed) == (train[:96], val[:16])


@pytest.mark.parametrize(
    "line, fragment",
    [
        ('{"messages": [', "invalid JSON"),
        ('["user", "hi"]', "a JSON list; expected an object"),
        (
            '{"text": "hi"}',
            "keys ['text']: expected exactly one of 'messages' (OpenAI), 'conversations' (ShareGPT) or 'data' "
            "(UltraChat)",
        ),
        ('{"messages": []}', "expected 'messages', a non-empty list of turns"),
        (
            '{"messages": [{"role": "narrator", "content": "x"}]}',
            "messages[0].role='narrator': expected one of ['assistant', 'system', 'tool', 'user']",
        ),
        ('{"conversations": [{"from": "bot", "value": "x"}]}', "conversations[0].from='bot': expected one of"),
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}',
            "messages[1].content is empty",
        ),
        (
            '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "  \\n"}]}',
            "conversations[1].value is empty",
        ),
        ('{"messages": [{"role": "user", "content": ["part"]}]}', "messages[0].content is list; expected a string"),
        ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}', "no assistant turn"),
        (
            '{"messages": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "hi"}]}',
            "messages[0] answers before any user turn",
        ),
    ],
)
def test_a_malformed_line_names_the_file_and_the_line(tmp_path, line, fragment):
    path = write(tmp_path / "bad chat.jsonl", json.dumps(GOOD), "", line)  # line 3: blank lines count
    with pytest.raises(DataFileError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(fragment)):
        read_conversations(path, "auto", "data.train_files")


def test_a_forced_format_refuses_the_other_one(tmp_path):
    path = write(tmp_path / "chat.jsonl", json.dumps(GOOD))
    with pytest.raises(
        DataFileError, match=re.escape(f"{path}:1: ") + ".*expected 'conversations'.*data.format=sharegpt"
    ):
        read_conversations(path, "sharegpt", "k")


def test_reading_a_file_that_vanished_names_the_key(tmp_path):
    with pytest.raises(DataFileError, match=re.escape(f"data.val_files[1]='{tmp_path / 'gone.jsonl'}': no such file")):
        scan_file(tmp_path / "gone.jsonl", "auto", "data.val_files[1]")  # the plan's check of every file


def test_too_few_conversations_to_split(tmp_path, jsonl_config):
    path = write(tmp_path / "one.jsonl", json.dumps(GOOD))
    cfg = jsonl_config(f"data.train_files=['{path}']")
    with pytest.raises(DataFileError, match="1 conversation\\(s\\), too few to hold out"):
        conversations(cfg.data, cfg.seed)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["data.train_files=['{missing}']"], "data.train_files[0]='{missing}': no such file"),
        (
            ["data.train_files=['{sample}']", "data.val_files=['{missing}']", "data.val_fraction=null"],
            "data.val_files[0]='{missing}': no such file",
        ),
        (["data.train_files=[]"], "data.train_files=[]: data=jsonl needs at least one file"),
        (
            ["data.train_files=['{sample}']", "data.val_files=['{sample}']"],
            "take validation from the files (add data.val_fraction=null)",
        ),
        (
            ["data.train_files=['{sample}']", "data.val_fraction=1.0"],
            "data.val_fraction=1.0 with data.val_files=[]: expected a fraction in (0, 1)",
        ),
        (
            ["data.train_files=['{sample}']", "data.format=alpaca"],
            "data.format='alpaca': expected one of ('auto', 'openai', 'sharegpt', 'ultrachat')",
        ),
        (["data=stdlib_chat", "data.train_files=['{sample}']"], "data=stdlib_chat reads no files; add `data=jsonl`"),
    ],
)
def test_a_bad_data_config_fails_at_load_naming_the_key(tmp_path, overrides, fragment, jsonl_config):
    values = {"missing": str(tmp_path / "missing.jsonl"), "sample": str(OPENAI)}
    with pytest.raises(ConfigError, match=re.escape(fragment.format(**values))):
        jsonl_config(*(o.format(**values) for o in overrides))


def test_a_data_file_edited_in_place_is_a_new_extraction(tmp_path, tiny_config):
    """The extraction's cache key follows the files' content, and paths are made absolute at load."""
    from orchestrator.pipeline import stage_keys

    chats = tmp_path / "chats.jsonl"
    shutil.copy(OPENAI, chats)
    cfg = tiny_config("data=jsonl", f"data.train_files=[{chats}]")
    assert cfg.data.train_files == [str(chats.resolve())]
    before = stage_keys(cfg)["extract"]
    assert stage_keys(tiny_config("data=jsonl", f"data.train_files=[{chats}]"))["extract"] == before
    chats.write_text("\n".join(chats.read_text().splitlines()[:-1]) + "\n")
    assert stage_keys(tiny_config("data=jsonl", f"data.train_files=[{chats}]"))["extract"] != before


def test_a_million_conversations_stream_from_their_file_without_being_loaded(jsonl_config, tmp_path):
    """A data set of 1,000,000 conversations (about 100 MB of JSON Lines) is split and cut into the extract stage's
    shards holding 8 bytes a conversation (its line's offset) and the held-out indices, never the conversations:
    the peak of Python's allocations stays under 48 MB where the conversations as lists of dicts take over a GB.
    A shard's conversations are read from the file when used, and are the file's lines."""
    import time
    import tracemalloc

    from orchestrator.stages.extract import _shards

    big, n = tmp_path / "million.jsonl", 1_000_000
    with big.open("w", encoding="utf-8") as f:
        for i in range(n):
            f.write(
                f'{{"messages": [{{"role": "user", "content": "q{i}"}}, {{"role": "assistant", "content": "a{i}"}}]}}\n'
            )
    cfg = jsonl_config(f"data.train_files=['{big}']", "data.val_fraction=0.01", f"data.max_train_conversations={n}",
                       "data.max_val_conversations=2000", "extract.shard_conversations=256")  # fmt: skip
    tracemalloc.start()
    began = time.perf_counter()
    shards = _shards(cfg)
    seconds = time.perf_counter() - began
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"1,000,000 conversations split and sharded in {seconds:.1f} s, peak allocations {peak / 2**20:.1f} MiB")
    assert peak < 48 * 2**20, f"{peak / 2**20:.0f} MiB allocated"
    train, val = shards["train"], shards["val"]
    assert sum(len(s) for s in train) == n - 10_000 and sum(len(s) for s in val) == 2000
    assert len(train) == -(-(n - 10_000) // 256)
    texts = [c[0]["content"] for c in train[1000]]
    held = {c[0]["content"] for s in val for c in s}
    numbers = [int(t[1:]) for t in texts]
    assert numbers == sorted(numbers) and len(texts) == 256 and not held & set(texts)
    with big.open() as lines:  # the line the conversation came from
        line = json.loads(next(itertools.islice(lines, numbers[0], None)))
    assert train[1000][0] == line["messages"]


def test_the_plan_reads_each_file_once_for_its_check_and_its_turn_count(tmp_path, jsonl_config):
    """check_rows (every line parsed before any job) and answered_turns (the estimates with regenerate.turns=null)
    share one pass per file; a file edited in place is read again."""
    from orchestrator import data

    train = write(tmp_path / "train.jsonl", *[json.dumps(GOOD)] * 12)
    val = write(tmp_path / "val.jsonl", *[json.dumps(GOOD)] * 4)
    cfg = jsonl_config(f"data.train_files=['{train}']", f"data.val_files=['{val}']", "data.val_fraction=null")
    before = data._scan.cache_info().misses
    assert data.check_rows(cfg.data) == 16 and data.answered_turns(cfg.data) == 1.0
    assert data._scan.cache_info().misses - before == 2, "one pass per file"
    write(train, *[json.dumps(GOOD)] * 13)
    assert data.check_rows(cfg.data) == 17 and data._scan.cache_info().misses - before == 3
