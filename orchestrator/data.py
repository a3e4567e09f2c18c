"""Conversations and their chat rendering: token ids plus the loss mask (assistant tokens only)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config import DataConfig


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]


def conversations(data: DataConfig, seed: int) -> tuple[list, list]:
    """(train, val) chat conversations for the configured data set, deterministic under the seed."""
    if data.name != "stdlib_chat":
        raise ValueError(f"data.name={data.name!r}: expected 'stdlib_chat' (the only built-in data set)")
    from orchestrator.tiny.corpus import stdlib_conversations

    train, val = stdlib_conversations(seed, max_files=data.max_files)
    return train[: data.max_train_conversations], val[: data.max_val_conversations]


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
