"""The loss mask under published chat templates (tests/data/chat_templates, sources in its SOURCES.md): for a
multi-turn conversation with a system prompt, the mask covers exactly the assistant turns' tokens, end markers
included, and nothing of the system, user or next-turn headers; templates that rewrite history are handled or
refused as `orchestrator.data.assistant_spans` documents. The tokenizer is a small byte-level BPE built here,
with each template's markers as special tokens, as the models' own tokenizers have them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.data import ChatTemplateError, assistant_spans, render

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]
# Per template, the text each assistant turn's masked tokens cover, read off the template's own rendering.
EXPECTED = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ["4.<|eot_id|>", "6.<|eot_id|>"],
    "Qwen-Qwen2.5-7B-Instruct.jinja": ["4.<|im_end|>", "6.<|im_end|>"],
    # the last turn only carries an empty think block, which the model writes after the generation prompt
    "Qwen-Qwen3-0.6B.jinja": ["4.<|im_end|>", "<think>\n\n</think>\n\n6.<|im_end|>"],
    # the generation prompt ends with </think> (non-thinking mode)
    "deepseek-ai-DeepSeek-V3.1.jinja": ["4.<｜end▁of▁sentence｜>", "6.<｜end▁of▁sentence｜>"],
    "moonshotai-Kimi-K2.jinja": ["4.<|im_end|>", "6.<|im_end|>"],
    "Kimi-K2-Thinking.jinja": ["<think></think>4.<|im_end|>", "<think></think>6.<|im_end|>"],
    # the system prompt moves to the last user turn: history rewritten, the turns found by content
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ["4.</s>", "6.</s>"],
    # no end marker: the next turn's <|user|> ends a turn, and is not masked
    "GLM-4.6.jinja": ["\n<think></think>\n4.", "\n<think></think>\n6."],
}
MARKERS = re.compile(r"<\|[^|>\s]+\|>|<｜[^｜]+｜>|</?[a-z_]+>|\[/?INST\]|\[gMASK\]|<sop>")


def tokenizer_for(template: str):
    """A byte-level BPE tokenizer whose special tokens are the template's markers, with the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = sorted(set(MARKERS.findall(template)) | {"<s>", "</s>"})
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["What is 2+2? And 3+3? You are terse. 4. 6. Cutting Knowledge Date"], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=specials,
        chat_template=template,
    )


def masked_runs(tokenizer, conversation) -> list[str]:
    """The text under each run of consecutive masked tokens."""
    full = tokenizer.apply_chat_template(conversation, tools=getattr(conversation, "tools", None), tokenize=False)
    offsets = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    mask = render(tokenizer, conversation, 1 << 20).loss_mask
    runs, start = [], None
    for k, ((a, b), m) in enumerate(zip(offsets, mask + [0])):
        if m and start is None:
            start = a
        if start is not None and (not m or k == len(mask) - 1):
            runs.append(full[start : (b if m else offsets[k - 1][1])])
            start = None
    return runs


def test_every_template_has_its_source():
    sources = (TEMPLATES / "SOURCES.md").read_text()
    stored = sorted(p.name for p in TEMPLATES.glob("*.jinja"))
    assert len(stored) >= 8 and all(f"`{name}`" in sources for name in stored), stored


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_mask_is_exactly_the_assistant_turns(name):
    tokenizer = tokenizer_for((TEMPLATES / name).read_text())
    rendered = render(tokenizer, CONVERSATION, 1 << 20)
    # the ids are the template's own tokenization, as apply_chat_template gives it
    assert rendered.input_ids == list(
        tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    )
    assert masked_runs(tokenizer, CONVERSATION) == EXPECTED[name]
    full, spans = assistant_spans(tokenizer, CONVERSATION)
    masked = "".join(full[a:b] for a, b in spans)
    assert "terse" not in masked and "2+2" not in masked and "3+3" not in masked


def test_the_project_template_and_the_generation_markers_agree():
    """The project's own template has `{% generation %}` markers: HF's assistant mask and the prefix rendering
    give the same mask."""
    from orchestrator.tiny.build import CHAT_TEMPLATE

    tokenizer = tokenizer_for(CHAT_TEMPLATE)
    marked = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert render(tokenizer, CONVERSATION, 1 << 20).loss_mask == list(marked["assistant_masks"])
    assert sum(marked["assistant_masks"]) > 0


def test_a_template_that_drops_past_reasoning_is_refused_with_the_ways_out():
    """Qwen3 drops the reasoning of turns before the last user message: the turn as generated (with its
    reasoning) is not in the rendering, so the mask cannot be matched; refused, naming the turn and the fixes."""
    tokenizer = tokenizer_for((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    reasoning = [dict(m) for m in CONVERSATION]
    reasoning[2]["content"] = "<think>\nTwo and two.\n</think>\n\n4."
    with pytest.raises(ChatTemplateError, match=r"messages\[2\].*renders differently.*data\.regenerate\.enabled=true"):
        render(tokenizer, reasoning, 1 << 20, "data.chat_template=Qwen3")
    # the last turn keeps its reasoning, and the model writes it: masked
    last = [dict(m) for m in CONVERSATION]
    last[4]["content"] = "<think>\nThree and three.\n</think>\n\n6."
    runs = masked_runs(tokenizer, last)
    assert runs[-1].startswith("<think>\nThree and three.\n</think>") and runs[-1].endswith("6.<|im_end|>")


def test_a_template_that_refuses_a_role_names_it():
    tokenizer = tokenizer_for((TEMPLATES / "google-gemma-2-2b-it.jinja").read_text())
    with pytest.raises(ChatTemplateError, match=r"gemma cannot render .*'system'.*System role not supported"):
        render(tokenizer, CONVERSATION, 1 << 20, "gemma")
    assert masked_runs(tokenizer, CONVERSATION[1:]) == ["4.<end_of_turn>", "6.<end_of_turn>"]
