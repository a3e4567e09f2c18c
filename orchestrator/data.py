"""Conversations and their chat rendering: token ids plus the loss mask (assistant tokens only)."""

from __future__ import annotations

import bisect
import contextlib
import functools
import glob
import itertools
import json
import random
from array import array
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import DataConfig


class Conversation(list):
    """A conversation: its chat messages (OpenAI-style dicts), and the tools its record defines (`tools`: the
    function schemas a tool-calling data set keeps beside the turns, None when it has none), which the chat
    template renders too (`apply_chat_template(tools=...)`, in the system prompt for most templates)."""

    def __init__(self, messages=(), tools: list | None = None):
        super().__init__(messages)
        self.tools = tools


def tools_of(conversation: list[dict]) -> list | None:
    return getattr(conversation, "tools", None)


# Per format: the conversation's key, each turn's speaker and text keys, and the speaker names it uses. ShareGPT's
# tool turns (LLaMA-Factory's names): `function_call` is the assistant calling a tool (its value the call's JSON,
# {"name", "arguments"}), `observation` the tool's answer. UltraChat (stingning/ultrachat): `data`, a list of
# strings, the user's and the assistant's turns in alternation.
FORMATS = {
    "openai": (
        "messages",
        "role",
        "content",
        {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"},
    ),
    "sharegpt": (
        "conversations",
        "from",
        "value",
        {
            "system": "system",
            "human": "user",
            "user": "user",
            "gpt": "assistant",
            "assistant": "assistant",
            "chatgpt": "assistant",
            "function_call": "assistant",
            "observation": "tool",
            "tool": "tool",
        },
    ),
    "ultrachat": ("data", None, None, None),
}
# OpenAI message keys kept as they are, for the chat template to render (tool calls and their answers)
TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


class DataFileError(ValueError):
    """A conversation file that cannot be used; the message starts with `file:line` and says what to fix."""


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]


def conversations(data: DataConfig, seed: int) -> tuple[list, list]:
    """(train, val) chat conversations for the configured data set, deterministic under the seed."""
    if data.name == "stdlib_chat":
        from orchestrator.tiny.corpus import stdlib_conversations

        train, val = stdlib_conversations(seed, max_files=data.max_files)
    elif data.name == "jsonl":
        train, val = jsonl_conversations(data, seed)
    elif data.name == "hf":
        return hf_conversations(data, seed)
    else:
        raise ValueError(f"data.name={data.name!r}: expected 'stdlib_chat', 'jsonl' or 'hf'")
    return train[: data.max_train_conversations], val[: data.max_val_conversations]


@contextlib.contextmanager
def _offline():
    """Nothing is downloaded at run time: `datasets` and the hub client read their offline switches per call."""
    import datasets
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def open_hf(data: DataConfig, split: str, key: str):
    """One split of data=hf's data set, as `datasets` opens it: a `save_to_disk` folder (load_from_disk), else
    `load_dataset(data.path, data.subset, data_files=..., revision=..., streaming=data.streaming)` offline, so a
    hub name must already be in the local cache. Errors name the config key and what to do."""
    import datasets

    path = Path(data.path)
    try:
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            saved = datasets.load_from_disk(str(path))
            if isinstance(saved, datasets.DatasetDict):
                if split not in saved:
                    raise DataFileError(f"{key}={split!r}: {path} holds the splits {sorted(saved)}")
                saved = saved[split]
            return saved.to_iterable_dataset() if data.streaming else saved
        name, files = data.path, data.data_files
        if path.is_file():  # one file: its builder by its extension
            if path.suffix not in BUILDERS:
                raise DataFileError(f"data.path={data.path!r}: expected a file ending in one of {sorted(BUILDERS)}")
            name, files = BUILDERS[path.suffix], [str(path)]
        with _offline():
            return datasets.load_dataset(
                name, data.subset, data_files=files, revision=data.revision, split=split, streaming=data.streaming
            )
    except DataFileError:
        raise
    except (ConnectionError, FileNotFoundError) as exc:
        raise DataFileError(
            f"data.path={data.path!r}: no such local file or folder, and not in the local `datasets` cache (nothing "
            f"is downloaded at run time: load it once on a machine with network, or point data.path at the files). "
            f"datasets said: {exc}"
        ) from None
    except ValueError as exc:  # an unknown split or configuration
        raise DataFileError(f"data.path={data.path!r}, {key}={split!r}: {exc}") from None


def hf_conversations(data: DataConfig, seed: int) -> tuple[list[Conversation], list[Conversation]]:
    """(train, val) from a `datasets` data set, read row by row (streamed by default: never whole in memory) and
    only as far as the caps need. Validation is data.val_split's first max_val_conversations rows, or else each
    train-split row is held out with probability data.val_fraction, drawn under the seed in row order (a streamed
    data set has no length to sample from). Every row is parsed by its layout (data.format, data.column); a bad
    row fails naming the data set, the split and the row. With data.streaming=false (a map-style data set) the
    same rows are picked by index and each is read when it is used (`HfRows`)."""
    if not data.streaming:  # a map-style (memory-mapped Arrow) data set: rows picked by index, read when used
        return _indexed_conversations(data, seed)

    def rows(split: str, key: str):
        for i, row in enumerate(open_hf(data, split, key)):
            yield parse_record(row, data.format, f"data.path={data.path!r} [{split}] row {i}", data.column)

    train: list[Conversation] = []
    val: list[Conversation] = []
    if data.val_split is not None:
        train = list(itertools.islice(rows(data.train_split, "data.train_split"), data.max_train_conversations))
        val = list(itertools.islice(rows(data.val_split, "data.val_split"), data.max_val_conversations))
    else:
        draw = random.Random(seed)
        for conversation in rows(data.train_split, "data.train_split"):
            held = draw.random() < data.val_fraction
            split = val if held else train
            if len(split) < (data.max_val_conversations if held else data.max_train_conversations):
                split.append(conversation)
            if len(train) >= data.max_train_conversations and len(val) >= data.max_val_conversations:
                break
    if not train or not val:
        raise DataFileError(
            f"data.path={data.path!r}: {len(train)} train and {len(val)} validation conversations; both splits need "
            "at least one (more rows, or another data.val_fraction or data.val_split)"
        )
    return train, val


class HfRows:
    """The rows of one split of a map-style `datasets` data set (data=hf with data.streaming=false), by index,
    parsed when read: the data set is opened once per process (memory-mapped Arrow, nothing loaded) and not
    pickled, so a job is handed the config, not the rows."""

    def __init__(self, data: DataConfig, split: str, key: str):
        self.data, self.split, self.key, self._opened = data, split, key, None
        self.size = len(self._rows())

    def _rows(self):
        if self._opened is None:
            self._opened = open_hf(self.data, self.split, self.key)
        return self._opened

    def __getstate__(self):
        return {**self.__dict__, "_opened": None}

    def __len__(self) -> int:
        return self.size

    def read(self, index: int) -> Conversation:
        where = f"data.path={self.data.path!r} [{self.split}] row {index}"
        return parse_record(self._rows()[index], self.data.format, where, self.data.column)

    def __repr__(self) -> str:
        return f"{self.data.path} [{self.split}]"


def _indexed_conversations(data: DataConfig, seed: int) -> tuple["Conversations", "Conversations"]:
    """`hf_conversations` for a map-style data set: the same rows, chosen by index under the same draws, each read
    when a shard uses it."""
    train = Conversations(HfRows(data, data.train_split, "data.train_split"))
    if data.val_split is not None:
        val = Conversations(HfRows(data, data.val_split, "data.val_split"))
        train, val = train[: data.max_train_conversations], val[: data.max_val_conversations]
    else:
        draw, picks = random.Random(seed), (array("q"), array("q"))
        for i in range(len(train)):  # the streamed reading's draws, one per row in order, until both caps are met
            held = draw.random() < data.val_fraction
            split = picks[1] if held else picks[0]
            if len(split) < (data.max_val_conversations if held else data.max_train_conversations):
                split.append(i)
            if len(picks[0]) >= data.max_train_conversations and len(picks[1]) >= data.max_val_conversations:
                break
        train, val = train.pick(picks[0]), train.pick(picks[1])
    if not len(train) or not len(val):
        raise DataFileError(
            f"data.path={data.path!r}: {len(train)} train and {len(val)} validation conversations; both splits need "
            "at least one (more rows, or another data.val_fraction or data.val_split)"
        )
    return train, val


def data_identity(data: DataConfig) -> dict:
    """What keys an extraction's data besides the data config: the content of every local file it reads (a file
    edited in place is another data set), or for a hub name its revision as configured (`data.revision`; null: the
    cached copy, which the key cannot see change)."""
    from orchestrator.artifacts import file_sha256

    files = [Path(f) for f in [*data.train_files, *data.val_files]]
    if data.name == "hf":
        path = Path(data.path)
        local = [Path(f) for pattern in (data.data_files or []) for f in sorted(glob.glob(pattern))]
        if path.is_file():
            local.append(path)
        elif path.is_dir():
            local += sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not local:
            return {"hub": data.path, "revision": data.revision}
        files += local
    return {"file_sha256": {str(f): file_sha256(f) for f in files}}


def jsonl_conversations(data: DataConfig, seed: int) -> tuple["Conversations", "Conversations"]:
    """(train, val) from the user's files: `val_files`, or else a seeded `val_fraction` of the train files'
    conversations; each split keeps file order. Neither is read into memory: each is a `Conversations`, which
    reads a conversation from its file when it is used, so a data set of millions of conversations costs 8 bytes
    of memory a conversation (its line's offset) and one pass over the files to find the lines."""
    train = Conversations(JsonlRows(data.train_files, data.format, "data.train_files"))
    if data.val_files:
        return train, Conversations(JsonlRows(data.val_files, data.format, "data.val_files"))
    if len(train) < 2:
        raise DataFileError(
            f"data.train_files={data.train_files}: {len(train)} conversation(s), too few to hold out "
            f"data.val_fraction={data.val_fraction} of them; add conversations or set data.val_files"
        )
    n_val = min(len(train) - 1, max(1, round(len(train) * data.val_fraction)))
    held = set(random.Random(seed).sample(range(len(train)), n_val))  # sampling a range keeps O(n_val) memory
    kept = array("q", (i for i in range(len(train)) if i not in held))
    return train.pick(kept), train.pick(array("q", sorted(held)))


class JsonlRows:
    """The non-blank lines of JSON Lines files, by number across the files: found in one pass that keeps each
    line's byte offset (not its text), and parsed when read. Picklable: it holds no open file."""

    def __init__(self, files, fmt: str, key: str):
        self.fmt, self.files, self.offsets, self.starts = fmt, [], [], [0]
        for i, file in enumerate(files):
            path = Path(file)
            where = f"{key}[{i}]"
            if not path.is_file():
                raise DataFileError(f"{where}={str(path)!r}: no such file (relative paths start at {Path.cwd()})")
            offsets, lines, at = array("q"), array("q"), 0
            with path.open("rb") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        offsets.append(at)
                        lines.append(number)
                    at += len(line)
            if not offsets:
                raise DataFileError(f"{path}: no conversations ({where}); expected one JSON object per line")
            self.files.append((path, lines))
            self.offsets.append(offsets)
            self.starts.append(self.starts[-1] + len(offsets))

    def __len__(self) -> int:
        return self.starts[-1]

    def __repr__(self) -> str:
        return str([str(path) for path, _ in self.files])

    def read(self, index: int) -> Conversation:
        f = bisect.bisect_right(self.starts, index) - 1
        (path, lines), at = self.files[f], index - self.starts[f]
        with path.open("rb") as lines_file:
            lines_file.seek(self.offsets[f][at])
            line = lines_file.readline().decode("utf-8")
        return parse_conversation(line, self.fmt, f"{path}:{lines[at]}")


class Conversations:
    """A split's conversations as a sequence that reads each one from its file when it is used (`JsonlRows`, or a
    map-style data set's `HfRows`):
    indexing, slicing (a slice is another such sequence) and iteration, in the split's order."""

    def __init__(self, rows: "JsonlRows | HfRows", picks=None):
        self.rows = rows
        self.picks = range(len(rows)) if picks is None else picks

    def pick(self, picks) -> "Conversations":
        return Conversations(self.rows, picks)

    def __len__(self) -> int:
        return len(self.picks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Conversations(self.rows, self.picks[i])
        return self.rows.read(self.picks[i])

    def __iter__(self):
        return (self.rows.read(i) for i in self.picks)

    def __eq__(self, other) -> bool:  # the same conversations in the same order, as any sequence of them
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"Conversations({len(self)} of {len(self.rows)} in {self.rows!r})"


def answered_turns(data: DataConfig) -> float:
    """The mean number of assistant turns that turn-by-turn regeneration answers (`turns_after_answers` plus the
    first) per conversation of data=jsonl's train files, for the storage and stream estimates of
    data.regenerate.turns=null (the pass `check_rows` makes, not another)."""
    scans = [scan_file(file, data.format, f"data.train_files[{i}]") for i, file in enumerate(data.train_files)]
    return sum(answered for _, answered in scans) / max(sum(count for count, _ in scans), 1)


def check_rows(data: DataConfig) -> int:
    """Every conversation of data=jsonl's files parsed, one line at a time (none kept), before any job: a
    malformed line fails here naming its file and line, not in the extract job. The number of conversations."""
    return sum(
        scan_file(file, data.format, f"data.{key}[{i}]")[0]
        for key in ("train_files", "val_files")
        for i, file in enumerate(getattr(data, key))
    )


def scan_file(path: str | Path, fmt: str, key: str) -> tuple[int, int]:
    """One JSON Lines file parsed, one line at a time, none kept: its conversations and the assistant turns
    turn-by-turn regeneration answers in them. One pass per file, its result cached by the file's name, size and
    time, for every check and estimate of a plan; `key` names the config entry the path came from."""
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"{key}={str(path)!r}: no such file (relative paths start at {Path.cwd()})")
    stat = path.stat()
    count, answered = _scan(str(path), stat.st_size, stat.st_mtime_ns, fmt)
    if not count:
        raise DataFileError(f"{path}: no conversations ({key}); expected one JSON object per line")
    return count, answered


@functools.lru_cache(maxsize=64)
def _scan(file: str, size: int, mtime_ns: int, fmt: str) -> tuple[int, int]:
    count = answered = 0
    with open(file, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                conversation = parse_conversation(line, fmt, f"{file}:{number}")
                answered += 1 + len(turns_after_answers(conversation))
                count += 1
    return count, answered


def parse_conversation(line: str, fmt: str, where: str) -> Conversation:
    """One line of a conversation file; `where` (file:line) starts every error."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataFileError(
            f"{where}: invalid JSON ({exc.msg}, column {exc.colno}); expected one JSON object per line"
        ) from None
    return parse_record(record, fmt, where)


def parse_record(record, fmt: str, where: str, column: str | None = None) -> Conversation:
    """One conversation (a JSON line's object, or a data set's row) as chat messages; `where` starts every error.
    `column`: the key holding the turns, when it is not the format's own."""

    def fail(message: str) -> DataFileError:
        return DataFileError(f"{where}: {message}")

    if not isinstance(record, dict):
        raise fail(f"a JSON {type(record).__name__}; expected an object with 'messages' or 'conversations'")
    if fmt == "auto":
        found = [name for name, (turns_key, *_) in FORMATS.items() if (column or turns_key) in record]
        if column and column in record:
            found = _layout_of(record[column])
        if len(found) != 1:
            raise fail(
                f"keys {sorted(record)}: expected exactly one of 'messages' (OpenAI), 'conversations' (ShareGPT) or "
                "'data' (UltraChat); name the layout with data.format"
            )
        fmt = found[0]
    turns_key, speaker_key, text_key, roles = FORMATS[fmt]
    turns_key = column or turns_key
    turns = record.get(turns_key)
    if not isinstance(turns, list) or not turns:
        raise fail(f"keys {sorted(record)}: expected {turns_key!r}, a non-empty list of turns (data.format={fmt})")
    if fmt == "ultrachat":
        if not all(isinstance(t, str) and t.strip() for t in turns):
            raise fail(f"{turns_key}: expected a list of non-empty strings, user and assistant in turn (UltraChat)")
        conversation = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    else:
        conversation = [_turn(turn, f"{turns_key}[{i}]", fmt, fail) for i, turn in enumerate(turns)]
    first_answer = next((i for i, m in enumerate(conversation) if m["role"] == "assistant"), None)
    if first_answer is None:
        raise fail("no assistant turn: nothing to train on (the loss covers assistant tokens only)")
    if not any(m["role"] == "user" for m in conversation[:first_answer]):
        raise fail(f"{turns_key}[{first_answer}] answers before any user turn; the prompt would be empty")
    return Conversation(conversation, _tools(record.get("tools"), fail))


def _tools(tools, fail) -> list | None:
    """A record's tool definitions: a list of objects (OpenAI's {"type": "function", "function": {...}}, or the
    function schemas alone), or that list as a JSON string (LLaMA-Factory's ShareGPT layout)."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise fail(f"tools: a string that is not JSON ({exc}); expected a list of tool definitions") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise fail(f"tools: {type(tools).__name__}; expected a list of tool definitions (JSON objects)")
    return tools or None


def _layout_of(turns) -> list[str]:
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
        return ["ultrachat"]
    first = turns[0] if isinstance(turns, list) and turns else None
    if isinstance(first, dict):
        return [name for name, (_, speaker, *_) in FORMATS.items() if speaker and speaker in first][:1]
    return []


def _turn(turn, at: str, fmt: str, fail) -> dict:
    _, speaker_key, text_key, roles = FORMATS[fmt]
    if not isinstance(turn, dict):
        raise fail(f"{at} is a JSON {type(turn).__name__}; expected an object with {speaker_key!r} and {text_key!r}")
    speaker, text = turn.get(speaker_key), turn.get(text_key)
    if not isinstance(speaker, str) or speaker not in roles:
        raise fail(f"{at}.{speaker_key}={speaker!r}: expected one of {sorted(roles)}")
    message = {"role": roles[speaker]}
    if speaker == "function_call":  # ShareGPT's tool call: the value is the call as JSON
        try:
            call = json.loads(text) if isinstance(text, str) else None
        except json.JSONDecodeError:
            call = None
        if not isinstance(call, dict) or "name" not in call:
            raise fail(f"{at}.{text_key}: a function_call's value must be JSON with 'name' and 'arguments'")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # a template may take the arguments as a string
        return message | {"content": "", "tool_calls": [{"type": "function", "function": {
            "name": call["name"], "arguments": arguments}}]}  # fmt: skip
    message |= {k: turn[k] for k in TOOL_KEYS if fmt == "openai" and turn.get(k) is not None}
    if text is None and message.get("tool_calls"):
        text = ""  # an assistant turn that only calls tools
    if not isinstance(text, str):
        raise fail(f"{at}.{text_key} is {type(text).__name__}; expected a string")
    if not text.strip() and not message.get("tool_calls"):
        raise fail(f"{at}.{text_key} is empty; every turn needs text")
    if message.get("tool_calls") is not None and (message["role"] != "assistant" or not isinstance(
            message["tool_calls"], list)):  # fmt: skip
        raise fail(f"{at}.tool_calls: expected a list, on an assistant turn")
    return message | {"content": text}


class ChatTemplateError(ValueError):
    """A chat template whose assistant turns cannot be told apart from the rest of its rendering."""


HISTORY_WAYS_OUT = (
    "data.regenerate.enabled=true (the target answers each prompt: one assistant turn, no history to rewrite), "
    "or data.chat_template=<file> (a template that renders earlier turns as they were generated)"
)


def assistant_spans(tokenizer, conversation: list[dict], source: str = "the target's chat template") -> tuple:
    """The conversation rendered as text under the tokenizer's chat template, and the character span of each
    assistant turn in it: what the model writes for that turn, from the end of the generation prompt through the
    template's end-of-turn marker (trailing whitespace, and the next turn's header, excluded).

    Works for any template, with or without `{% generation %}` markers. For each assistant turn i, the turns
    before it rendered with the generation prompt (H) must be a prefix of the turns through it (F):
    F[len(H):] is what the model generates. Where the whole rendering starts with F, that is the span.
    Some templates render a turn differently once later turns follow: Qwen3 writes an empty `<think>` block on
    the last turn only, Mistral moves the system prompt to the last user turn. Then the turn is found in the
    whole rendering by its content, after the turns before it, followed by the end marker F gives it; the span
    starts where the generated text's lead (a `<think>` block) starts, or at the content where the whole
    rendering dropped it. A turn whose content or end marker the template rewrites (reasoning dropped from past
    turns) raises ChatTemplateError, naming `source`, the turn and the ways out (`HISTORY_WAYS_OUT`)."""

    tools = tools_of(conversation)

    def text(messages: list[dict], generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # jinja's TemplateError from raise_exception, or a template bug
            roles = [m["role"] for m in messages]
            raise ChatTemplateError(f"{source} cannot render a conversation with roles {roles}: {exc}") from None

    full = text(conversation, False)
    spans: list[tuple[int, int]] = []
    cursor = 0  # where the turns after the last span start in `full`
    for i, message in enumerate(conversation):
        content = (message.get("content") or "").strip()
        if message["role"] != "assistant":
            at = full.find(content, cursor) if content else -1
            cursor = at + len(content) if at >= 0 else cursor  # a template may drop it (a system prompt)
            continue
        before, through = text(conversation[:i], True), text(conversation[: i + 1], False)
        generated = (
            through[len(before) :] if through.startswith(before) else _after_prompt(before, through, conversation[:i])
        )
        if generated is None:
            raise ChatTemplateError(
                f"{source}: the rendering of messages[0..{i}] does not continue the generation prompt of "
                f"messages[{i}] (an assistant turn), so the tokens the model writes cannot be told apart. Ways out: "
                f"{HISTORY_WAYS_OUT}"
            )
        if through.startswith(before) and full.startswith(through):
            span = (len(before), len(through.rstrip()))
        else:
            at = generated.rfind(content) if content else -1
            found = full.find(content, cursor) if at >= 0 else -1
            tail = generated[at + len(content) :].rstrip() if at >= 0 else ""
            if found < 0 or not full.startswith(tail, found + len(content)):
                raise ChatTemplateError(
                    f"{source}: messages[{i}] (an assistant turn) renders differently once later turns follow: "
                    "its content or end marker is rewritten (as templates that drop past reasoning do), so the "
                    f"draft would learn text the target does not write. Ways out: {HISTORY_WAYS_OUT}"
                )
            lead = generated[:at]
            start = found - len(lead) if lead and full[:found].endswith(lead) else found
            span = (start, found + len(content) + len(tail))
        spans.append(span)
        cursor = span[1]
    return full, spans


def _after_prompt(before: str, through: str, prompt: list[dict]) -> str | None:
    """What `through` renders after the generation prompt, when the prompt's rendering `before` is not a prefix of
    it (the template moves or drops an earlier message once an answer follows): both are anchored at the last
    prompt message's content, which the generation prompt's header follows in both."""
    last = next((m.get("content") or "" for m in reversed(prompt) if (m.get("content") or "").strip()), "").strip()
    at_before, at_through = before.rfind(last), through.rfind(last)
    if not last or at_before < 0 or at_through < 0:
        return None
    header = before[at_before + len(last) :]
    rest = through[at_through + len(last) :]
    return rest[len(header) :] if rest.startswith(header) else None


def render(tokenizer, conversation: list[dict], max_len: int, source: str = "the target's chat template") -> Rendered:
    """Token ids of the conversation under the tokenizer's chat template (as `apply_chat_template` tokenizes
    it); mask = the tokens that start inside an assistant turn's span (`assistant_spans`)."""
    full, spans = assistant_spans(tokenizer, conversation, source)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])[:max_len]
    mask = [int(any(a <= begin < b for a, b in spans)) for begin, _ in enc["offset_mapping"][:max_len]]
    return Rendered(ids, mask)


def masked_text(tokenizer, conversation: list[dict], source: str = "the target's chat template") -> tuple:
    """(masked fraction, the masked text with ' | ' between turns): what the dry run shows of one sample."""
    full, spans = assistant_spans(tokenizer, conversation, source)
    rendered = render(tokenizer, conversation, 1 << 30, source)
    fraction = sum(rendered.loss_mask) / max(1, len(rendered.loss_mask))
    return fraction, " | ".join(full[a:b] for a, b in spans)


def prompt_ids(tokenizer, conversation: list[dict], max_len: int) -> list[int]:
    """The conversation up to its first assistant turn, with the generation prompt: what a user sends."""
    return chat_prompt_ids(tokenizer, before_first_answer(conversation), tools_of(conversation), max_len)


def before_first_answer(conversation: list[dict]) -> list[dict]:
    """The turns before the conversation's first assistant turn: its first prompt."""
    first = []
    for message in conversation:
        if message["role"] == "assistant":
            break
        first.append(message)
    return first


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list | None, max_len: int) -> list[int]:
    """`messages` rendered by the chat template with the generation prompt, as a client's request renders them:
    its last `max_len` tokens."""
    out = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    return list(out["input_ids"])[-max_len:]


def turns_after_answers(conversation: list[dict]) -> list[list[dict]]:
    """What follows each assistant turn before the next one (the user's next message, tool answers), in order,
    up to the first assistant turn that calls a tool (a regenerated answer would call other tools, or none, and the
    data set's tool answers would not answer it) or that nothing follows: each is the next prompt's new turns when
    a conversation is regenerated turn by turn."""
    segments: list[list[dict]] = []
    current: list[dict] | None = None
    for message in conversation:
        if message["role"] == "assistant":
            if current:
                segments.append(current)
            elif current is not None:  # two answers in a row: the turn after the first has no prompt
                break
            if message.get("tool_calls"):
                return segments
            current = []
        elif current is not None:
            current.append(message)
    if current:  # a last message after the last answer is a prompt too
        segments.append(current)
    return segments
