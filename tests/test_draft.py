"""The EAGLE-3 draft: the unrolled (training/eval) path equals the cached (serving) path; vocabulary maps;
the exported directory against SGLang's rules."""

import json

import pytest
import torch
from conftest import SMALL_DRAFT_SHAPE
from safetensors.torch import load_file, save_file

from orchestrator.draft import export as E
from orchestrator.draft.model import DraftCache, Eagle3Draft

SHAPE = SMALL_DRAFT_SHAPE
TARGET_CONFIG = {"hidden_size": 32, "vocab_size": 50, "max_position_embeddings": 64, "rope_theta": 10000.0}


def make_draft(seed=0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(SHAPE)
    for p in draft.parameters():
        p.data.normal_(0, 0.3)
    counts = torch.randint(0, 100, (SHAPE.vocab_size,))
    draft.set_vocab_map(*E.build_vocab_map(counts, SHAPE.draft_vocab_size))
    return draft.eval()


@torch.no_grad()
def test_unrolled_chain_equals_cached_serving_chain():
    draft = make_draft()
    length, steps = 12, 4
    aux = torch.randn(1, length, 3 * 32)
    next_ids = torch.randint(0, 50, (1, length))
    unrolled = draft.unroll(aux, next_ids, torch.ones(1, length, dtype=torch.bool), steps)
    for start in (0, 5, length - 1):
        cache = DraftCache()
        draft.extend(aux[:, :start], next_ids[:, :start], 0, cache) if start else None
        out = draft.extend(aux[:, start : start + 1], next_ids[:, start : start + 1], start, cache)
        tokens = draft.chain(out, start, cache, steps)
        assert tokens == [int(unrolled.tokens[k][0, start]) for k in range(steps)]
        assert cache.length == start + 1, "the chain's own entries are dropped after drafting"


@torch.no_grad()
def test_teacher_forcing_feeds_the_token_serving_would():
    """TTT step k+1 consumes token t+k+2 (the one step k predicts), never the token it must predict: on a text
    that follows the draft's own chain from a position, teacher-forced drafting equals own-token drafting."""
    from orchestrator.stages.train import Batch, ttt_step_targets

    draft = make_draft()
    length, steps = 16, 4
    aux = torch.randn(1, length, 3 * 32)
    ids = torch.randint(0, 50, (1, length))
    valid = torch.ones(1, length - 1, dtype=torch.bool)
    own = draft.unroll(aux[:, :-1], ids[:, 1:], valid, steps)
    chains = [[int(own.tokens[k][0, t]) for k in range(steps)] for t in range(length - steps - 1)]
    # a position whose chain changes token from one step to the next, so feeding the wrong one shows
    t = next(t for t, c in enumerate(chains) if any(a != b for a, b in zip(c, c[1:])))
    ids[0, t + 2 : t + steps + 1] = torch.tensor(chains[t][:-1])  # later positions only: t's chain is unchanged
    batch = Batch(ids, torch.ones(1, length, dtype=torch.bool), torch.tensor([length]), aux, torch.zeros(1, length, 32))
    targets = ttt_step_targets(batch, torch.zeros(1, length, 50), steps)
    forced = draft.unroll(aux[:, :-1], ids[:, 1:], valid, steps, token_source=lambda k, _t: targets[k + 1][2])
    assert [int(forced.tokens[k][0, t]) for k in range(steps)] == chains[t]


@torch.no_grad()
def test_extend_in_pieces_equals_extend_at_once():
    draft = make_draft()
    aux, ids = torch.randn(1, 9, 96), torch.randint(0, 50, (1, 9))
    a, b = DraftCache(), DraftCache()
    whole = draft.extend(aux, ids, 0, a)
    draft.extend(aux[:, :4], ids[:, :4], 0, b)
    pieces = draft.extend(aux[:, 4:], ids[:, 4:], 4, b)
    torch.testing.assert_close(whole, pieces)


def test_vocab_map_keeps_most_frequent_sorted_by_id():
    counts = torch.tensor([5, 0, 9, 1, 9, 0, 3])
    d2t, t2d = E.build_vocab_map(counts, 3)
    kept = torch.arange(3) + d2t
    assert kept.tolist() == [0, 2, 4]
    assert t2d.tolist() == [True, False, True, False, True, False, False]
    assert E.check_vocab_map(d2t, t2d, 7) == []


def test_vocab_map_rejects_target_ids_stored_instead_of_offsets():
    d2t, t2d = E.build_vocab_map(torch.arange(50), 20)
    as_ids = d2t + torch.arange(20)  # the classic bug: storing target ids, not offsets
    assert any("offsets" in p for p in E.check_vocab_map(as_ids, t2d, 50))


def export_dir(tmp_path, draft=None):
    folder = tmp_path / "draft"
    draft = draft or make_draft()
    conf = E.draft_config(SHAPE, [0, 2, 4], "bfloat16", TARGET_CONFIG, 64)
    E.export(draft, folder, conf, {"aux_layers": [0, 2, 4]}, TARGET_CONFIG)
    return folder


def test_exported_directory_meets_sglang_rules(tmp_path):
    folder = export_dir(tmp_path)
    conf = json.loads((folder / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["num_hidden_layers"] == 1
    assert conf["draft_vocab_size"] == 20 and conf["vocab_size"] == 50
    assert conf["target_hidden_size"] == 32
    assert conf["torch_dtype"] == "bfloat16" and conf["tie_word_embeddings"] is False
    assert conf["max_position_embeddings"] >= TARGET_CONFIG["max_position_embeddings"]
    assert conf["rope_theta"] == TARGET_CONFIG["rope_theta"]
    assert conf["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], "use_aux_hidden_state": True}
    weights = load_file(str(folder / "model.safetensors"))
    expected = E.expected_weight_shapes(SHAPE)
    assert set(weights) == set(expected) | {"embed_tokens.weight"}
    for name, shape in expected.items():
        assert tuple(weights[name].shape) == shape, name
    assert weights["fc.weight"].dtype == torch.bfloat16
    assert weights["d2t"].dtype == torch.int64
    target_ids = weights["d2t"] + torch.arange(20)
    assert int(target_ids.min()) >= 0 and int(target_ids.max()) < 50  # every draft id lands in the target vocab
    assert bool(weights["t2d"][target_ids].all()) and int(weights["t2d"].sum()) == 20
    assert E.validate_draft_dir(folder, TARGET_CONFIG) == []
    loaded, _ = E.load_draft(folder)
    assert torch.equal(loaded.d2t, weights["d2t"])


@pytest.mark.parametrize(
    "breakage, fragment",
    [
        (lambda c, w: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
        (lambda c, w: c.pop("draft_vocab_size"), "draft_vocab_size"),
        (lambda c, w: c.pop("torch_dtype"), "torch_dtype"),
        (lambda c, w: c.update(max_position_embeddings=32), "max_position_embeddings"),
        (lambda c, w: c.update(rope_theta=500000.0), "rope_theta"),
        (lambda c, w: c.pop("eagle_config"), "eagle_config"),
        (lambda c, w: w.update({"layers.0.mlp.up_proj.weight": w.pop("midlayer.mlp.up_proj.weight")}), "unknown keys"),
        (lambda c, w: w.pop("d2t"), "d2t missing"),
        (lambda c, w: w.update(d2t=w["d2t"] + torch.arange(20)), "offsets"),
        (lambda c, w: w.update({"fc.weight": w["fc.weight"][:, :64].contiguous()}), "fc.weight has shape"),
    ],
)
def test_validator_catches(tmp_path, breakage, fragment):
    folder = export_dir(tmp_path)
    conf = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    breakage(conf, weights)
    (folder / "config.json").write_text(json.dumps(conf))
    save_file(weights, str(folder / "model.safetensors"))
    problems = E.validate_draft_dir(folder, TARGET_CONFIG)
    assert any(fragment in p for p in problems), problems


def _reference_unroll(draft, aux, next_ids, valid, steps, token_source=None):
    """The unroll as first written, with an explicit [B, h, L, L] score tensor per step: the oracle for the
    memory-efficient one."""
    import math

    b, length, _ = aux.shape
    positions = torch.arange(length).expand(b, length)
    mask0 = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    attn = draft.midlayer.self_attn
    scale = 1.0 / math.sqrt(attn.head_dim)
    h = draft.fc(aux.to(draft.fc.weight.dtype))
    ids, keys0, vals0, chain_k, chain_v, logits_out, tokens_out = next_ids, None, None, [], [], [], []
    for k in range(steps):
        x = draft.midlayer.attn_input(draft.embed_tokens(ids), h)
        q, key, val = attn.qkv(x, positions + k)
        if k == 0:
            keys0, vals0 = key, val
            probs = ((q @ keys0.transpose(-1, -2)) * scale).masked_fill(~mask0, float("-inf")).softmax(-1)
            ctx = probs @ vals0
        else:
            chain_k.append(key)
            chain_v.append(val)
            causal_scores = ((q @ keys0.transpose(-1, -2)) * scale).masked_fill(~mask0, float("-inf"))
            diag = torch.stack([(q * ck).sum(-1) for ck in chain_k], dim=-1) * scale
            probs = torch.cat([causal_scores, diag], dim=-1).softmax(-1)
            ctx = probs[..., :length] @ vals0
            for j, cv in enumerate(chain_v):
                ctx = ctx + probs[..., length + j, None] * cv
        h = draft.midlayer.finish(h, attn.out(ctx))
        logits = draft.logits(h)
        tokens = draft.to_target_ids(logits.argmax(-1))
        logits_out.append(logits)
        tokens_out.append(tokens)
        if k + 1 < steps:
            ids = tokens if token_source is None else token_source(k, tokens)
    return logits_out, tokens_out


@pytest.mark.parametrize("forced", [False, True])
def test_unroll_equals_explicit_score_reference_with_padding(forced):
    """The SDPA unroll gives the explicit-score unroll's logits, tokens and gradients, padded positions included."""
    draft = make_draft().train()
    torch.manual_seed(1)
    steps, length = 5, 17
    aux, ids = torch.randn(3, length, 96), torch.randint(0, 50, (3, length))
    valid = torch.arange(length)[None] < torch.tensor([length, 9, 4])[:, None]
    texts = torch.randint(0, 50, (steps, 3, length))
    source = (lambda k, _tokens: texts[k]) if forced else None
    params = [p for p in draft.parameters() if p.requires_grad]

    new = draft.unroll(aux, ids, valid, steps, token_source=source)
    ref_logits, ref_tokens = _reference_unroll(draft, aux, ids, valid, steps, token_source=source)
    for k in range(steps):
        torch.testing.assert_close(new.logits[k], ref_logits[k], rtol=1e-5, atol=1e-5)
        assert torch.equal(new.tokens[k], ref_tokens[k]), k
    new_grads = torch.autograd.grad(sum(x.square().sum() for x in new.logits), params)
    ref_grads = torch.autograd.grad(sum(x.square().sum() for x in ref_logits), params)
    for a, b in zip(new_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
