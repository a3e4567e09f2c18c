"""Conversations and their chat rendering: token ids plus the loss mask (assistant tokens only)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import DataConfig

Conversation = list[dict[str, str]]

# Per format: the conversation's key, each turn's speaker and text keys, and the speaker names it uses.
FORMATS = {
    "openai": ("messages", "role", "content", {"system": "system", "user": "user", "assistant": "assistant"}),
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
        },
    ),
}


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
    else:
        raise ValueError(f"data.name={data.name!r}: expected 'stdlib_chat' or 'jsonl'")
    return train[: data.max_train_conversations], val[: data.max_val_conversations]


def jsonl_conversations(data: DataConfig, seed: int) -> tuple[list[Conversation], list[Conversation]]:
    """(train, val) from the user's files: `val_files`, or else a seeded `val_fraction` of the train files'
    conversations; each split keeps file order."""
    train = [
        c for i, f in enumerate(data.train_files) for c in read_conversations(f, data.format, f"data.train_files[{i}]")
    ]
    if data.val_files:
        val = [
            c for i, f in enumerate(data.val_files) for c in read_conversations(f, data.format, f"data.val_files[{i}]")
        ]
        return train, val
    if len(train) < 2:
        raise DataFileError(
            f"data.train_files={data.train_files}: {len(train)} conversation(s), too few to hold out "
            f"data.val_fraction={data.val_fraction} of them; add conversations or set data.val_files"
        )
    n_val = min(len(train) - 1, max(1, round(len(train) * data.val_fraction)))
    held = set(random.Random(seed).sample(range(len(train)), n_val))
    return [c for i, c in enumerate(train) if i not in held], [c for i, c in enumerate(train) if i in held]


def read_conversations(path: str | Path, fmt: str, key: str) -> list[Conversation]:
    """The conversations of one JSON Lines file (blank lines skipped), as system/user/assistant messages.
    `fmt`: auto, openai or sharegpt; `key` names the config entry the path came from, for the errors."""
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"{key}={str(path)!r}: no such file (relative paths start at {Path.cwd()})")
    out: list[Conversation] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                out.append(parse_conversation(line, fmt, f"{path}:{number}"))
    if not out:
        raise DataFileError(f"{path}: no conversations ({key}); expected one JSON object per line")
    return out


def parse_conversation(line: str, fmt: str, where: str) -> Conversation:
    """One line of a conversation file; `where` (file:line) starts every error."""

    def fail(message: str) -> DataFileError:
        return DataFileError(f"{where}: {message}")

    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise fail(f"invalid JSON ({exc.msg}, column {exc.colno}); expected one JSON object per line") from None
    if not isinstance(record, dict):
        raise fail(f"a JSON {type(record).__name__}; expected an object with 'messages' or 'conversations'")
    if fmt == "auto":
        found = [name for name, (turns_key, *_) in FORMATS.items() if turns_key in record]
        if len(found) != 1:
            raise fail(
                f"keys {sorted(record)}: expected exactly one of 'messages' (OpenAI) or 'conversations' (ShareGPT)"
            )
        fmt = found[0]
    turns_key, speaker_key, text_key, roles = FORMATS[fmt]
    turns = record.get(turns_key)
    if not isinstance(turns, list) or not turns:
        raise fail(f"keys {sorted(record)}: expected {turns_key!r}, a non-empty list of turns (data.format={fmt})")
    conversation: Conversation = []
    for i, turn in enumerate(turns):
        at = f"{turns_key}[{i}]"
        if not isinstance(turn, dict):
            raise fail(
                f"{at} is a JSON {type(turn).__name__}; expected an object with {speaker_key!r} and {text_key!r}"
            )
        speaker, text = turn.get(speaker_key), turn.get(text_key)
        if not isinstance(speaker, str) or speaker not in roles:
            raise fail(f"{at}.{speaker_key}={speaker!r}: expected one of {sorted(roles)}")
        if not isinstance(text, str):
            raise fail(f"{at}.{text_key} is {type(text).__name__}; expected a string")
        if not text.strip():
            raise fail(f"{at}.{text_key} is empty; every turn needs text")
        conversation.append({"role": roles[speaker], "content": text})
    first_answer = next((i for i, m in enumerate(conversation) if m["role"] == "assistant"), None)
    if first_answer is None:
        raise fail("no assistant turn: nothing to train on (the loss covers assistant tokens only)")
    if not any(m["role"] == "user" for m in conversation[:first_answer]):
        raise fail(f"{turns_key}[{first_answer}] answers before any user turn; the prompt would be empty")
    return conversation


def render(tokenizer, conversation: list[dict], max_len: int) -> Rendered:
    """Token ids of the conversation under the target's chat template; mask = assistant tokens."""
    out = tokenizer.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = list(out["input_ids"])[:max_len]
    mask = list(out["assistant_masks"])[:max_len]
    return Rendered(ids, mask)


def prompt_ids(tokenizer, conversation: list[dict], max_len: int) -> list[int]:
    """The conversation up to its first assistant turn, with the generation prompt: what a user sends."""
    first_user = []
    for message in conversation:
        if message["role"] == "assistant":
            break
        first_user.append(message)
    out = tokenizer.apply_chat_template(first_user, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])[-max_len:]
