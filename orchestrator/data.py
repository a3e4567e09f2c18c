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


def sequences(model, tokenizer, conversations_: list, data, split: str, seed: int) -> list[Rendered]:
    """A split's training sequences: the data set's conversations rendered, or, with `data.regenerate.enabled`,
    the target's own responses to their prompts. Extraction and standalone eval both take them from here."""
    if not data.regenerate.enabled:
        return [render(tokenizer, c, data.max_seq_len) for c in conversations_]
    split_seed = seed + (0 if split == "train" else 1)
    return regenerate(model, tokenizer, conversations_, data.max_seq_len, data.regenerate, split_seed, desc=f"regenerate {split}")


def regenerate(model, tokenizer, conversations_: list, max_len: int, cfg, seed: int, desc: str = "regenerate") -> list[Rendered]:
    """The target's own responses to each conversation's prompt (its first user turn), as served.

    ids = prompt + generated tokens (up to and including the end token, or until `cfg.max_new_tokens` or
    `max_len`); the loss mask covers the generated tokens. Token ids are kept as generated, never re-tokenized
    from text, so training sees exactly the sequences the serving engine produces. Greedy at temperature 0;
    sampling is seeded.
    """
    import torch
    from tqdm import tqdm

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    prompts = [prompt_ids(tokenizer, c, max(1, max_len - 1)) for c in conversations_]
    generator_seed = torch.Generator().manual_seed(seed)
    out: list[Rendered] = []
    starts = range(0, len(prompts), cfg.batch_size)
    for start in tqdm(starts, desc=desc, unit="batch", total=len(starts)):
        batch = prompts[start : start + cfg.batch_size]
        width = max(len(p) for p in batch)
        new_tokens = min(cfg.max_new_tokens, max_len - min(len(p) for p in batch))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):  # left padding: every row's next token is at the same column
            ids[row, width - len(p) :] = torch.tensor(p)
            attn[row, width - len(p) :] = 1
        sampling = {"do_sample": False} if cfg.temperature == 0 else {"do_sample": True, "temperature": cfg.temperature, "top_k": 0, "top_p": 1.0}
        if cfg.temperature > 0:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator_seed)))
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens, pad_token_id=pad,
                eos_token_id=eos, **sampling,
            )[:, width:]
        for row, p in enumerate(batch):
            response = generated[row].tolist()
            if eos in response:
                response = response[: response.index(eos) + 1]
            response = response[: max_len - len(p)]
            out.append(Rendered(list(p) + response, [0] * len(p) + [1] * len(response)))
    return out
