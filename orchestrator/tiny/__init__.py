"""Tiny, self-trained HF target models for fast, offline speculative-decoding experiments."""

from .build import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_target,
    load_build_report,
    spec_hash,
    train_tokenizer,
    weights_sha256,
)
from .corpus import Conversation, stdlib_conversations

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "Conversation",
    "build_tiny_target",
    "load_build_report",
    "spec_hash",
    "stdlib_conversations",
    "train_tokenizer",
    "weights_sha256",
]
