"""Regenerated training data: the target's own greedy responses, token for token, as a server produces them."""

from __future__ import annotations

import torch

from orchestrator.data import conversations, prompt_ids
from orchestrator.regenerate import regenerate, sequences
from orchestrator.targets import ensure_target, load_target


def test_regenerated_sequences_are_the_targets_greedy_responses(tiny_config):
    cfg = tiny_config("data.regenerate.max_new_tokens=20", "data.regenerate.batch_size=3")
    model, tokenizer = load_target(ensure_target(cfg, progress=False))
    _, val = conversations(cfg.data, cfg.seed)
    val = val[:5]  # two batches, the second one smaller: left padding differs between them
    regenerated = sequences(val, "val", cfg, tokenizer, model=model)
    for conv, seq in zip(val, regenerated):
        prompt = prompt_ids(tokenizer, conv, cfg.data.max_seq_len)
        n = len(prompt)
        assert seq.input_ids[:n] == prompt
        assert seq.loss_mask == [0] * n + [1] * (len(seq.input_ids) - n), "the mask covers the response only"
        response = seq.input_ids[n:]
        assert 1 <= len(response) <= 20
        assert tokenizer.eos_token_id not in response[:-1], "nothing after the end token"
        ids = torch.tensor([prompt])
        alone = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=len(response),
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )[0, n:].tolist()
        assert response == alone, "batched (left-padded) regeneration must equal the unbatched greedy response"

    cfg_off = tiny_config("data.regenerate.enabled=false")
    rendered = sequences(val, "val", cfg_off, tokenizer)
    assert [r.input_ids for r in rendered] != [r.input_ids for r in regenerated]


def test_sampled_regeneration_is_seeded(tiny_config):
    cfg = tiny_config("data.regenerate.max_new_tokens=12", "data.regenerate.temperature=1.0")
    model, tokenizer = load_target(ensure_target(cfg, progress=False))
    _, val = conversations(cfg.data, cfg.seed)
    first, again, other = (
        [r.input_ids for r in regenerate(val[:4], cfg, tokenizer, seed, model=model)] for seed in (0, 0, 1)
    )
    assert first == again, "the same seed samples the same responses"
    assert first != other, "another seed samples other responses"


def test_regenerated_sequences_are_kept_for_a_restarted_extraction(tiny_config, tmp_path):
    from orchestrator.stages.extract import _sequences

    cfg = tiny_config("data.regenerate.max_new_tokens=10")
    model, tokenizer = load_target(ensure_target(cfg, progress=False))
    _, val = conversations(cfg.data, cfg.seed)
    first = _sequences(model, tokenizer, val[:5], "val", 3, tmp_path, cfg)
    kept = tmp_path / "val" / "regenerated_00003.safetensors"  # the shard's own file
    assert kept.exists() and not list(kept.parent.glob(".*.tmp")), "written under a temporary name, then renamed"
    again = _sequences(None, tokenizer, val[:5], "val", 3, tmp_path, cfg)  # no model: it must read, not generate
    assert [(r.input_ids, r.loss_mask) for r in again] == [(r.input_ids, r.loss_mask) for r in first]


def test_prefix_mask_equals_the_generation_markers_mask_on_the_corpus(tiny_config):
    """The tiny target's template has `{% generation %}` markers: on every conversation of the test corpus (both
    splits), the mask found by rendering prefixes (`orchestrator.data.render`) equals transformers' assistant
    mask, and the ids equal apply_chat_template's."""
    from orchestrator.data import render
    from orchestrator.targets import load_tokenizer

    cfg = tiny_config()
    tokenizer = load_tokenizer(ensure_target(cfg, progress=False))
    train, val = conversations(cfg.data, cfg.seed)
    assert len(train) + len(val) >= 100
    for conversation in train + val:
        marked = tokenizer.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        rendered = render(tokenizer, conversation, 1 << 20)
        assert rendered.input_ids == list(marked["input_ids"])
        assert rendered.loss_mask == list(marked["assistant_masks"]) and sum(rendered.loss_mask) > 0


def test_a_shard_below_the_loss_fraction_fails_extraction_naming_the_key(outputs, tiny_config, tmp_path):
    """With data.min_loss_fraction above what the template masks, extraction refuses the first shard, naming the
    key and the fixes; no shard is written."""
    import pytest
    from conftest import compose_config, copy_cache

    from orchestrator import runner
    from orchestrator.pipeline import make_plan, run_pipeline

    # An outputs folder of its own: the fraction is a check, not part of the extraction's key, so the session's
    # finished FAST extraction would be taken as cached.
    ensure_target(tiny_config(), progress=False)
    root = copy_cache(outputs, tmp_path / "outputs", ("targets",))
    cfg = compose_config(root, "stages=[extract]", "cluster=local", "data.min_loss_fraction=0.99")
    with pytest.raises(runner.StageFailed, match=r"train shard 0: .* below data\.min_loss_fraction=0\.99"):
        run_pipeline(cfg, tmp_path / "run")
    assert not list(make_plan(cfg, tmp_path / "run").dir("extract").glob("*/shard_*.safetensors"))


def test_extraction_runs_the_decoder_stack_without_the_vocabulary_head(tiny_config):
    """A shard's states come from the decoder stack alone: the head, whose logits ([batch, length, vocab]; 163,840
    wide at Kimi's vocabulary) extraction would throw away, is never run. The states equal the whole model's
    hidden states at those layers (hidden_states[k + 1] is layer k's output) and after the final norm."""
    from orchestrator.compute import cpu
    from orchestrator.data import render
    from orchestrator.engines.hf import extract_chunk

    cfg = tiny_config("extract.batch_size=2", "extract.dtype=float32")
    model, tokenizer = load_target(ensure_target(cfg, progress=False))
    _, val = conversations(cfg.data, cfg.seed)
    chunk = [render(tokenizer, c, cfg.data.max_seq_len) for c in val[:3]]
    head_calls = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    try:
        with torch.no_grad():
            shard = extract_chunk(model, tokenizer, chunk, [1, 4, 6], cfg, cpu())  # layers 1, 4, 6's outputs
    finally:
        hook.remove()
    assert head_calls == [], "extraction ran the vocabulary head"
    offset = 0
    for r in chunk:
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([r.input_ids]), output_hidden_states=True).hidden_states
        n = len(r.input_ids)
        expected = torch.cat([hidden[2], hidden[5], hidden[7]], dim=-1)[0]
        assert torch.allclose(shard["aux_hidden_states"][offset : offset + n], expected, atol=1e-5)
        assert torch.allclose(shard["teacher_hidden_state"][offset : offset + n], hidden[-1][0], atol=1e-5)
        offset += n
    assert offset == len(shard["input_ids"])
