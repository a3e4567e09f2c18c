"""data=hf: a Hugging Face `datasets` data set as users keep it (local files and folders in the OpenAI-messages,
ShareGPT and UltraChat layouts, a save_to_disk folder with its splits, a hub name that must already be cached),
read row by row and only as far as the caps need; tool-call turns kept for the chat template to render."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import compose_config

from orchestrator.config import ConfigError
from orchestrator.data import DataFileError, conversations, parse_record, prompt_ids, render

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def chat(i: int) -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"question {i}"},
        {"role": "assistant", "content": f"answer {i}"},
    ]


def openai_row(i: int) -> dict:
    return {"messages": chat(i), "id": i}


def sharegpt_row(i: int) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in chat(i)]}


def ultrachat_row(i: int) -> dict:
    return {"id": str(i), "data": [f"question {i}", f"answer {i}"]}


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hf(tmp_path, *overrides: str):
    return compose_config(tmp_path / "outputs", "data=hf", *overrides)


def test_each_layout_from_local_files(tmp_path):
    """A parquet file of OpenAI messages, a folder of ShareGPT JSON Lines and an UltraChat file read through the
    builder name: each gives the same conversations, held out under the seed."""
    import datasets

    parquet = tmp_path / "openai.parquet"
    datasets.Dataset.from_list([openai_row(i) for i in range(40)]).to_parquet(str(parquet))
    write_jsonl(tmp_path / "sharegpt" / "part-0.jsonl", [sharegpt_row(i) for i in range(20)])
    write_jsonl(tmp_path / "sharegpt" / "part-1.jsonl", [sharegpt_row(i) for i in range(20, 40)])
    ultra = write_jsonl(tmp_path / "ultrachat.jsonl", [ultrachat_row(i) for i in range(40)])

    seen = []
    for overrides in (
        [f"data.path={parquet}"],
        [f"data.path={tmp_path / 'sharegpt'}"],
        ["data.path=json", f"data.data_files=[{ultra}]", "data.format=ultrachat"],
    ):
        cfg = hf(tmp_path, *overrides, "data.val_fraction=0.25")
        train, val = conversations(cfg.data, cfg.seed)
        assert len(train) + len(val) == 40 and len(val) > 0
        seen.append((train, val))
    ultra_train, ultra_val = seen[2]
    # UltraChat has no system turn: the same conversations without it
    assert [[m for m in c if m["role"] != "system"] for c in seen[0][0]] == ultra_train
    assert seen[0] == seen[1] and [c[1:] for c in seen[0][1]] == ultra_val
    # the seed decides the held-out rows
    cfg = hf(tmp_path, f"data.path={parquet}", "data.val_fraction=0.25", "seed=1")
    assert conversations(cfg.data, cfg.seed)[1] != seen[0][1]


def test_a_saved_data_set_with_its_own_validation_split(tmp_path):
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train_sft": datasets.Dataset.from_list([openai_row(i) for i in range(30)]),
            "test_sft": datasets.Dataset.from_list([openai_row(i) for i in range(100, 110)]),
        }
    ).save_to_disk(str(saved))
    cfg = hf(tmp_path, f"data.path={saved}", "data.train_split=train_sft", "data.val_split=test_sft",
             "data.val_fraction=null", "data.max_train_conversations=25")  # fmt: skip
    train, val = conversations(cfg.data, cfg.seed)
    assert train == [chat(i) for i in range(25)] and val == [chat(i) for i in range(100, 110)]
    cfg = hf(tmp_path, f"data.path={saved}", "data.train_split=train")
    splits = r"data.train_split='train': .* holds the splits \['test_sft', 'train_sft'\]"
    with pytest.raises(DataFileError, match=splits):
        conversations(cfg.data, cfg.seed)


def test_rows_are_read_only_as_far_as_the_caps_need(tmp_path):
    """Streamed: a bad row after the rows the caps take is never read; with larger caps it is reached, and the
    error names the data set, the split and the row."""
    rows = [openai_row(i) for i in range(200)] + [{"messages": [{"role": "user", "content": "no answer"}]}]
    data = write_jsonl(tmp_path / "big.jsonl", rows)
    cfg = hf(tmp_path, "data.path=json", f"data.data_files=[{data}]", "data.max_train_conversations=20",
             "data.max_val_conversations=5", "data.val_fraction=0.2")  # fmt: skip
    train, val = conversations(cfg.data, cfg.seed)
    assert (len(train), len(val)) == (20, 5)
    cfg = hf(tmp_path, "data.path=json", f"data.data_files=[{data}]", "data.max_train_conversations=1000")
    with pytest.raises(DataFileError, match=r"\[train\] row 200: no assistant turn"):
        conversations(cfg.data, cfg.seed)


def test_a_hub_name_already_in_the_local_cache_loads_offline(tmp_path, monkeypatch):
    """A hub data set that an earlier online `load_dataset("acme/chats")` left in the `datasets` cache, in the
    layout the library writes (`<namespace>___<name>/<config>/<version>/<hash>/<name>-<split>.arrow` with its
    dataset_info.json; here made by the library's own json builder, then named as the hub download would be):
    data.path=acme/chats loads it, streamed, with no network."""
    import shutil

    import datasets

    cache = tmp_path / "hf-datasets-cache"
    files = write_jsonl(tmp_path / "chats.jsonl", [openai_row(i) for i in range(30)])
    built = datasets.load_dataset("json", data_files=str(files), split="train", cache_dir=str(cache))
    arrow = Path(built.cache_files[0]["filename"])
    version_dir = arrow.parent  # json/default-<hash>/0.0.0/<hash>
    hub = cache / "acme___chats" / "default"
    shutil.move(str(version_dir.parent.parent), str(hub))
    moved = hub / version_dir.parent.name / version_dir.name
    (moved / arrow.name).rename(moved / "chats-train.arrow")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    cfg = hf(tmp_path, "data.path=acme/chats", "data.val_fraction=0.2")
    train, val = conversations(cfg.data, cfg.seed)
    assert sorted(map(json.dumps, train + val)) == sorted(json.dumps(chat(i)) for i in range(30)) and val


def test_a_hub_name_not_in_the_local_cache_is_never_downloaded(tmp_path, monkeypatch):
    """The network is blocked, and every attempt to use it recorded: a hub name missing from the cache fails
    naming the cache, without one attempt (an online lookup would resolve the hub's address first)."""
    import socket

    import datasets

    attempts = []

    def blocked(*args, **kwargs):
        attempts.append(args)
        raise OSError("the network is blocked in this test")

    monkeypatch.setattr(socket, "getaddrinfo", blocked)
    monkeypatch.setattr(socket.socket, "connect", lambda sock, address: blocked(address))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")
    cfg = hf(tmp_path, "data.path=acme/no-such-chats")
    with pytest.raises(DataFileError, match=r"data.path='acme/no-such-chats': .*not in the local `datasets` cache"):
        conversations(cfg.data, cfg.seed)
    assert attempts == [], f"the network was touched: {attempts}"


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path is unset: data=hf needs a data set"):
        hf(tmp_path)
    with pytest.raises(ConfigError, match=r"data.path='x': a key of data=hf, not of data=jsonl"):
        compose_config(tmp_path, "data=jsonl", "+data.path=x")
    with pytest.raises(ConfigError, match=r"data.data_files\[0\]='missing.jsonl': no such file"):
        hf(tmp_path, "data.path=json", "data.data_files=[missing.jsonl]")
    with pytest.raises(ConfigError, match=r"data.val_split='test' and data.val_fraction=0.05"):
        hf(tmp_path, "data.path=json", "data.val_split=test")


TOOL_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOL_CHAT = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": TOOL_CALL}]},
    {"role": "tool", "content": "18C and sunny"},
    {"role": "assistant", "content": "It is 18C and sunny."},
]


def test_tool_call_turns_are_kept_in_both_layouts_and_masked_as_the_assistant_writes_them():
    """OpenAI messages with tool_calls and a tool turn, and ShareGPT's function_call/observation, parse to the same
    messages; under Qwen 2.5's published template (it renders tool calls) the mask is the assistant's tool call and
    its answer, each with its end marker, and never the tool's output or the user's question."""
    from test_chat_templates import masked_runs, tokenizer_for

    assert parse_record({"messages": TOOL_CHAT}, "auto", "row") == TOOL_CHAT
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "You can call tools."},
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": json.dumps(TOOL_CALL)},
            {"from": "observation", "value": "18C and sunny"},
            {"from": "gpt", "value": "It is 18C and sunny."},
        ]
    }
    assert parse_record(sharegpt, "auto", "row") == TOOL_CHAT
    tokenizer = tokenizer_for((TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    runs = masked_runs(tokenizer, TOOL_CHAT)
    assert len(runs) == 2 and "get_weather" in runs[0] and runs[0].endswith("<|im_end|>"), runs
    assert runs[1] == "It is 18C and sunny.<|im_end|>", runs
    assert not any("18C and sunny" in r for r in runs[:1]) and not any("Weather in Paris" in r for r in runs)
    assert sum(render(tokenizer, TOOL_CHAT, 1 << 20).loss_mask) > 0


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_a_records_tool_definitions_reach_the_template_and_stay_out_of_the_mask():
    """A record's `tools` (OpenAI's list, or LLaMA-Factory's ShareGPT JSON string) go to the chat template with its
    turns: under Qwen 2.5's published template they are rendered in the system prompt, in the training sequence and
    in the prompt regeneration sends, and the mask still covers only what the assistant writes. A `tools` that is
    not a list of objects is refused, naming the row."""
    from test_chat_templates import masked_runs, tokenizer_for

    openai = parse_record({"messages": TOOL_CHAT, "tools": [WEATHER_TOOL]}, "auto", "row 3")
    assert openai == TOOL_CHAT and openai.tools == [WEATHER_TOOL]
    sharegpt = {
        "conversations": [{"from": "human", "value": "Weather in Paris?"}, {"from": "gpt", "value": "Let me look."}],
        "tools": json.dumps([WEATHER_TOOL["function"]]),
    }
    assert parse_record(sharegpt, "auto", "row 4").tools == [WEATHER_TOOL["function"]]
    assert parse_record({"messages": TOOL_CHAT}, "auto", "row 5").tools is None

    tokenizer = tokenizer_for((TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    with_tools, without = render(tokenizer, openai, 1 << 20), render(tokenizer, TOOL_CHAT, 1 << 20)
    text = tokenizer.decode(with_tools.input_ids)
    assert (
        "# Tools" in text
        and "The weather in a city now" in text
        and "# Tools" not in tokenizer.decode(without.input_ids)
    )
    assert masked_runs(tokenizer, openai) == masked_runs(tokenizer, TOOL_CHAT), "the tools are not the assistant's"
    assert sum(with_tools.loss_mask) == sum(without.loss_mask)
    assert "The weather in a city now" in tokenizer.decode(prompt_ids(tokenizer, openai, 1 << 20))
    with pytest.raises(DataFileError, match=r"row 6: tools: dict; expected a list of tool definitions"):
        parse_record({"messages": TOOL_CHAT, "tools": WEATHER_TOOL}, "auto", "row 6")
    with pytest.raises(DataFileError, match=r"row 7: tools: a string that is not JSON"):
        parse_record({"messages": TOOL_CHAT, "tools": "[{"}, "auto", "row 7")


def test_a_map_style_data_set_gives_the_streamed_rows_without_loading_them(tmp_path):
    """data.streaming=false: the same train and validation conversations as streamed, under the seed's draws or a
    validation split; held as row indices into the memory-mapped data set (a split of 100,000 rows costs Python
    under 8 MiB, and pickles to a few kB for a job); a bad row fails when it is read, naming the row."""
    import pickle
    import tracemalloc

    import datasets

    parquet = tmp_path / "chats.parquet"
    rows = [openai_row(i) for i in range(300)] + [{"messages": [{"role": "user", "content": "no answer"}]}]
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    for extra in (["data.val_fraction=0.25"], ["data.val_fraction=0.1", "data.max_train_conversations=50"]):
        streamed = conversations(hf(tmp_path, f"data.path={parquet}", *extra).data, 0)
        cfg = hf(tmp_path, f"data.path={parquet}", "data.streaming=false", *extra)
        indexed = conversations(cfg.data, 0)
        assert indexed[0] == streamed[0] and indexed[1] == streamed[1] and len(indexed[1]) > 0
    assert len(pickle.dumps(indexed)) < 10_000
    cfg = hf(tmp_path, f"data.path={parquet}", "data.streaming=false", "data.max_train_conversations=1000")
    train, _ = conversations(cfg.data, 0)
    with pytest.raises(DataFileError, match=r"\[train\] row 300: no assistant turn"):
        list(train)

    big = tmp_path / "big.parquet"
    datasets.Dataset.from_dict({"messages": [chat(i % 50) for i in range(100_000)]}).to_parquet(str(big))
    cfg = hf(tmp_path, f"data.path={big}", "data.streaming=false", "data.max_train_conversations=1000000",
             "data.max_val_conversations=1000000")  # fmt: skip
    tracemalloc.start()
    train, val = conversations(cfg.data, 0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(train) + len(val) == 100_000 and train[-1] == chat((train.picks[-1]) % 50)
    assert peak < 8 * 2**20, f"{peak / 2**20:.1f} MiB"
