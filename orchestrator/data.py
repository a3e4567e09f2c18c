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

    def text(messages: list[dict], generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
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
    first_user = []
    for message in conversation:
        if message["role"] == "assistant":
            break
        first_user.append(message)
    out = tokenizer.apply_chat_template(first_user, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])[-max_len:]
